"""The pytest plugin that installing opsadv registers (entry point `pytest11: opsadv`): the conformance options
in every pytest run, so `pytest --opsadv-backend NAME` works without `-p opsadv.testing`.

Thin on purpose, and outside the opsadv package (importing opsadv.anything runs `import opsadv`, which loads
torch): it loads in every pytest session of every project where opsadv is installed, so it imports neither
torch nor opsadv until `--opsadv-backend` is given.  `-p opsadv.testing` still works alongside it: the
options are added once (by whichever of the two registers first) and the catalogue's items are collected by
`opsadv.testing` when that module is a plugin of the run, else here.  `-p no:opsadv` turns the entry point off."""
from __future__ import annotations

FULL_PLUGIN = "opsadv.testing"


def add_options(parser) -> None:
    """--opsadv-backend / --opsadv-quick / --opsadv-device, once per parser (this module and opsadv.testing both
    call it; adding an option twice is an error in pytest)."""
    group = parser.getgroup("opsadv", "opsadv conformance")
    if any("--opsadv-backend" in opt.names() for opt in group.options):
        return
    group.addoption("--opsadv-backend", action="append", default=[],
                    help="run the opsadv conformance catalogue against this backend (repeatable)")
    group.addoption("--opsadv-quick", action="store_true", help="quick catalogue")
    group.addoption("--opsadv-device", default=None, help="device for the backend's tensors (default: its own)")


def pytest_addoption(parser):
    add_options(parser)


def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("--opsadv-backend") or config.pluginmanager.has_plugin(FULL_PLUGIN):
        return              # nothing asked, or `-p opsadv.testing` collects the items itself
    from opsadv.testing import collect_conformance_items
    collect_conformance_items(session, config, items)
