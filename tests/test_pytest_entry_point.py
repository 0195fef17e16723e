"""The pytest11 entry point (`pytest --opsadv-backend NAME` without -p): a thin module (pytest_opsadv) that
coexists with `-p opsadv.testing` (options added once, items collected once) and loads neither opsadv nor torch
until asked.  Entry-point loading is tested through a dist-info on the subprocess's path that declares exactly
what pyproject declares; the installed distribution is tested too where it is this checkout (`pip install -e .`)."""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DECLARED = PYPROJECT["project"]["entry-points"]["pytest11"]


def test_pyproject_declares_the_thin_module():
    assert DECLARED == {"opsadv": "pytest_opsadv"}
    assert "pytest_opsadv" in PYPROJECT["tool"]["setuptools"]["py-modules"]
    assert (ROOT / "pytest_opsadv.py").is_file()


@pytest.fixture
def ep_site(tmp_path):
    """A site dir whose dist-info declares pyproject's pytest11 entry points (what an install writes)."""
    info = tmp_path / "site" / "opsadv_entry_point_check-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: opsadv-entry-point-check\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in DECLARED.items()))
    return tmp_path / "site"


def _pytest(tmp_path, *args, site=None):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "test_light.py").write_text(
        "import sys\n\ndef test_plugin_did_not_import_opsadv():\n    assert 'opsadv' not in sys.modules\n")
    path = os.pathsep.join(str(p) for p in (ROOT, site) if p is not None)
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args,
                           str(work)], capture_output=True, text=True, timeout=600, cwd=work, env=env)


def _passed(p) -> int:
    m = re.search(r"(\d+) passed", p.stdout)
    assert p.returncode == 0 and m, p.stdout[-3000:] + p.stderr[-3000:]
    return int(m.group(1))


def test_entry_point_runs_the_catalogue_without_p_and_coexists_with_p(tmp_path, ep_site):
    quick = ("--opsadv-backend", "reference", "--opsadv-quick", "-k", "rms_norm")
    alone = _passed(_pytest(tmp_path, *quick, site=ep_site))
    both = _passed(_pytest(tmp_path, "-p", "opsadv.testing", *quick, site=ep_site))
    only_p = _passed(_pytest(tmp_path, "-p", "opsadv.testing", *quick))
    assert alone == both == only_p > 0          # the catalogue's items once, whichever loads it


def test_entry_point_stays_light_and_documents_its_options(tmp_path, ep_site):
    _passed(_pytest(tmp_path, site=ep_site))     # no --opsadv-backend: opsadv never imported
    h = _pytest(tmp_path, "--help", site=ep_site)
    assert h.returncode == 0 and "--opsadv-backend" in h.stdout and "opsadv conformance" in h.stdout
    off = _pytest(tmp_path, "-p", "no:opsadv", "--opsadv-backend", "reference", site=ep_site)
    assert off.returncode != 0 and "--opsadv-backend" in off.stderr    # `-p no:opsadv` turns it off


def _installed_here() -> str | None:
    """Why the installed opsadv cannot be tested here (None: it is this checkout and declares the entry point)."""
    try:
        dist = importlib.metadata.distribution("opsadv")
    except importlib.metadata.PackageNotFoundError:
        return "opsadv is not installed (pip install -e . from this checkout tests the installed entry point)"
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    where = url.removeprefix("file://")
    if not where or Path(where).resolve() != ROOT:
        return f"the installed opsadv distribution is not this checkout ({url or dist.locate_file('')}, not {ROOT})"
    if not any(ep.group == "pytest11" for ep in dist.entry_points):
        return "the installed opsadv metadata predates the pytest11 entry point: reinstall (pip install -e .)"
    return None


@pytest.mark.skipif(_installed_here() is not None, reason=str(_installed_here()))
def test_installed_distribution_registers_the_plugin(tmp_path):
    dist = importlib.metadata.distribution("opsadv")
    eps = {ep.name: ep.value for ep in dist.entry_points if ep.group == "pytest11"}
    assert eps == DECLARED
    assert _passed(_pytest(tmp_path, "--opsadv-backend", "reference", "--opsadv-quick", "-k", "rms_norm")) > 0
