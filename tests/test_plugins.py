"""Plugin discovery: a real third-party package installed through its entry point passes
conformance; broken plugins are isolated (recorded, warned, skipped) unless strict mode."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# one xdist worker runs this whole module, so its module-scoped fixture is built once (the README's
# `pytest -n auto --dist loadgroup`)
pytestmark = pytest.mark.xdist_group("plugins")

import opsadv
from opsadv.errors import BackendUnavailableError, PluginError
from opsadv.registry import API_VERSION, BackendInfo, ProbeResult, get_registry, hookimpl, reset_registry
from opsadv.registry.manager import Registry

HERE = Path(__file__).parent
ROOT = HERE.parent


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """pip-install the toy and broken plugin packages into a private target dir."""
    target = tmp_path_factory.mktemp("site")
    for pkg in ("opsadv_toy", "opsadv_broken"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-compile", "--target", str(target), str(HERE / "plugins" / pkg)], check=True)
    return target


def _run(args, site, **env):
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TRITON_INTERPRET": "0", **env}
    return subprocess.run([sys.executable, "-m", "opsadv", *args], capture_output=True, text=True, env=e, timeout=300)


def test_installed_plugin_is_discovered_and_broken_ones_isolated(plugin_site):
    p = _run(["info", "--json"], plugin_site)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    names = {b["name"]: b for b in info["backends"]}
    assert names["toy"]["available"] and names["toy"]["impls"] == 2
    assert "entry point opsadv-toy" in names["toy"]["source"]
    failed = {f["name"]: f for f in info["plugin_failures"]}
    assert failed["broken_import"]["stage"] == "import" and "libmissing" in failed["broken_import"]["error"]
    assert failed["broken_register"]["stage"] == "register" and failed["broken_register"]["version"] == "6.6.6"
    assert "broken_register" not in names          # its half-registered impls are dropped
    assert "skipping plugin" in p.stderr            # and the user was warned


def test_third_party_backend_passes_conformance(plugin_site, tmp_path):
    out = tmp_path / "toy.json"
    p = _run(["conformance", "--backend", "toy", "--quick", "--json", str(out), "--ops", "rms_norm,flash_attention"],
             plugin_site)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    by = {(r["op"], r["shape_class"], r["dtype"]): r for r in data["results"]}
    assert data["summary"]["fail"] == 0 and data["summary"]["pass"] > 10
    assert by[("rms_norm", "odd", "float32")]["impl"] == "toy.rms_norm"
    # the toy declares no causal support: skipped with the reason, never silently served by reference
    causal = by[("flash_attention", "causal", "float32")]
    assert causal["status"] == "skip" and "does not support causal" in causal["reason"]


def test_allow_list_and_autoload_switch(plugin_site):
    p = _run(["info", "--json"], plugin_site, OPSADV_PLUGINS="toy")
    info = json.loads(p.stdout)
    third_party_failures = [f for f in info["plugin_failures"] if not f["name"].startswith("opsadv.")]
    assert "toy" in {b["name"] for b in info["backends"]} and third_party_failures == []
    p = _run(["info", "--json"], plugin_site, OPSADV_DISABLE_PLUGIN_AUTOLOAD="1")
    info = json.loads(p.stdout)
    assert "toy" not in {b["name"] for b in info["backends"]}
    assert not [f for f in info["plugin_failures"] if not f["name"].startswith("opsadv.")]
    assert "reference" in {b["name"] for b in info["backends"]}   # built-ins always load


def test_strict_mode_raises(plugin_site):
    p = _run(["info"], plugin_site, OPSADV_STRICT_PLUGINS="1")
    assert p.returncode != 0 and "OPSADV_STRICT_PLUGINS=1" in p.stderr and "failed at" in p.stderr


class _Plugin:
    """An in-memory plugin object (apps may register one without packaging it)."""

    def __init__(self, name="mem", api=API_VERSION, available=True, fail_probe=False):
        self.name, self.api, self.available, self.fail_probe = name, api, available, fail_probe

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name=self.name, device_types=("cpu",), api_version=self.api)

    @hookimpl
    def opsadv_probe(self, env):
        if self.fail_probe:
            raise OSError("probe exploded")
        return ProbeResult(self.available, () if self.available else ("no widget attached",))

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        pass


def test_incompatible_api_and_probe_failure_are_recorded():
    reg = Registry(opsadv.detect())
    with pytest.warns(RuntimeWarning, match="plugin API 2.0"):
        assert reg.register_plugin(_Plugin("future", api="2.0")) is None
    with pytest.warns(RuntimeWarning, match="probe exploded"):
        reg.register_plugin(_Plugin("boom", fail_probe=True))
    assert [(f.name, f.stage) for f in reg.failures] == [("_Plugin", "info"), ("_Plugin", "probe")]


def test_unavailable_backend_raises_with_probe_reasons():
    reg = get_registry()
    rec = reg.register_plugin(_Plugin("widget", available=False), name="widget")
    try:
        with pytest.raises(BackendUnavailableError, match="no widget attached"):
            opsadv.use_backend("widget")
    finally:
        reg.backends.pop("widget", None)
    assert rec is not None


def test_unknown_hook_name_is_rejected():
    class Typo:
        @hookimpl
        def opsadv_backend_infos(self):
            return None

    reg = Registry(opsadv.detect())
    with pytest.warns(RuntimeWarning, match="opsadv_backend_infos"):
        reg.register_plugin(Typo())


def test_import_opsadv_survives_broken_plugin(plugin_site):
    code = "import opsadv, torch; print(opsadv.ops.rms_norm(torch.ones(2, 8)).shape)"
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), str(ROOT)])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert p.returncode == 0 and "torch.Size([2, 8])" in p.stdout, p.stderr


def test_info_lists_every_impl_with_its_declared_support(plugin_site):
    """`opsadv info --impls` lists each registered impl (third-party ones too) with what it declares."""
    p = _run(["info", "--impls", "--json"], plugin_site)
    assert p.returncode == 0, p.stderr
    rows = {r["id"]: r for r in json.loads(p.stdout)["impls"]}
    assert rows["reference.flash_attention"]["op"] == "flash_attention"
    assert {"toy"} <= {r["backend"] for r in rows.values()}
    gluon = rows.get("cuda.gluon.flash_attention")
    if gluon is not None:
        assert gluon["head_dims"] == [64, 128] and gluon["min_cc"] == [9, 0] and not gluon["experimental"]
    cudnn = rows.get("cuda.sdpa.cudnn")            # listed where the cuda backend is available
    if cudnn is not None:
        assert cudnn["inference"] and not cudnn["train"]      # its no-lse forward for no-grad calls
    assert not rows["reference.flash_attention"]["inference"]
    text = _run(["info", "--impls"], plugin_site).stdout
    assert "== impls" in text and "reference.flash_attention prio 0" in text
    assert "impls" not in json.loads(_run(["info", "--json"], plugin_site).stdout)   # only when asked
