"""A third-party plugin defines a NEW op (issue 35): its OpDef comes through the `opsadv_register_ops` hook, with
the same isolation as the other hooks; the reference backend serves it with the OpDef's reference, explain and
`use_backend(impls=...)` know it, and the conformance kit (`opsadv conformance`, `pytest -p opsadv.testing`)
covers it from its cases.  The plugin is tests/plugins/opsadv_toyop (scaled_tanh = tanh(alpha x))."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opsadv
from opsadv.core import opdef
from opsadv.registry import BackendInfo, ProbeResult, hookimpl
from opsadv.registry.manager import Registry

pytestmark = pytest.mark.xdist_group("plugin_ops")

HERE = Path(__file__).parent
ROOT = HERE.parent
PLUGIN = HERE / "plugins" / "opsadv_toyop" / "opsadv_toyop" / "plugin.py"


@pytest.fixture(scope="module")
def toyop_site(tmp_path_factory):
    """pip-install the toyop plugin package into a private target dir."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    "--target", str(target), str(HERE / "plugins" / "opsadv_toyop")], check=True)
    return target


def _env(site, **extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TRITON_INTERPRET": "0",
            "OPSADV_PLUGINS": "toyop", **extra}


@pytest.fixture
def isolated_ops(monkeypatch):
    """Core's op registry as it is now, restored after the test (a plugin's op must not leak into other tests)."""
    monkeypatch.setattr(opdef, "_defs", dict(opdef._defs))
    monkeypatch.setattr(opdef, "_sources", dict(opdef._sources))


def _load_plugin():
    """The toyop plugin module, imported from the source tree (its torch.library ops register once per process)."""
    mod = sys.modules.get("opsadv_toyop_plugin")
    if mod is None:
        spec = importlib.util.spec_from_file_location("opsadv_toyop_plugin", PLUGIN)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["opsadv_toyop_plugin"] = mod
        spec.loader.exec_module(mod)
    return mod


def test_opdef_registry_basics(isolated_ops):
    names = list(opsadv.core.opdef.OPS)
    assert names[:3] == ["flash_attention", "sparse_attention", "gemm"] and "rotary_embedding" in names
    d = opdef.get_op("rms_norm")
    assert d.fn is opsadv.ops.rms_norm and d.reference_impl().id == "reference.rms_norm"
    assert all(c.op == "rms_norm" for c in d.cases) and d.cases
    assert opdef.register_op(d) is False                       # the same definition again: nothing changes
    clash = opdef.OpDef("rms_norm", lambda x: x, d.reference, d.spec)
    with pytest.raises(ValueError, match="'rms_norm' is already defined by"):
        opdef.register_op(clash)
    with pytest.raises(ValueError, match="cases must be Cases of op 'x'"):
        opdef.OpDef("x", lambda x: x, d.reference, d.spec, cases=d.cases)
    with pytest.raises(TypeError, match="reference must be a Reference"):
        opdef.OpDef("x", lambda x: x, d.reference.fn, d.spec)


def test_every_builtin_op_is_derived_from_its_opdef():
    """OPS, explain, the reference backend, the catalogue and the demo read the registered OpDefs."""
    from opsadv.demo import _cases
    from opsadv.registry import get_registry
    from opsadv.testing import CATALOGUE
    reg = get_registry()
    for d in opdef.op_defs():
        assert getattr(opsadv.ops, d.name) is d.fn
        assert [i.id for i in reg.impls_by_op[d.name] if i.backend == "reference"] == [f"reference.{d.name}"]
        assert [c for c in CATALOGUE if c.op == d.name] == list(d.cases)
    assert [op for op, _, _ in _cases("cpu", torch.float32)] == [d.name for d in opdef.op_defs() if d.demo]


def test_plugin_op_in_process(isolated_ops):
    """register_plugin of a plugin that defines an op: core knows the op, the reference backend serves it, the
    plugin's kernel wins, explain and impl pins work, and the conformance runner passes it."""
    from opsadv.backends import reference
    plugin = _load_plugin()
    reg = Registry()
    reg.register_plugin(reference, name="reference", source="builtin")
    assert "scaled_tanh" not in opdef.OPS
    rec = reg.register_plugin(plugin, name="toyop", source="test")
    assert rec is not None and rec.ops == ["scaled_tanh"] and not reg.failures
    assert "scaled_tanh" in opdef.OPS and "plugin toyop" in opdef.op_source("scaled_tanh")
    assert sorted(i.id for i in reg.impls_by_op["scaled_tanh"]) == ["reference.scaled_tanh", "toyop.scaled_tanh"]
    assert "reference.scaled_tanh" in [i.id for i in reg.backends["reference"].impls]
    # a rebuild asks the plugin again: the op is defined already, nothing is added twice
    again = Registry()
    again.register_plugin(reference, name="reference", source="builtin")
    assert again.register_plugin(plugin, name="toyop", source="test") is not None and not again.failures
    assert sorted(i.id for i in again.impls_by_op["scaled_tanh"]) == ["reference.scaled_tanh", "toyop.scaled_tanh"]


def test_plugin_op_dispatch_explain_and_conformance(isolated_ops, monkeypatch):
    from opsadv.backends import reference
    from opsadv.registry import manager
    from opsadv.testing import run_case, run_conformance
    plugin = _load_plugin()
    reg = Registry()
    reg.register_plugin(reference, name="reference", source="builtin")
    reg.register_plugin(plugin, name="toyop", source="test")
    monkeypatch.setattr(manager, "_registry", reg)          # the process's registry, for this test
    opsadv.core.dispatch.clear_cache()
    try:
        x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
        with opsadv.use_backend("toyop", strict=True), opsadv.trace() as t:
            y = plugin.scaled_tanh(x, alpha=0.5)
            y.sum().backward()
        assert dict(t.counts) == {"toyop.scaled_tanh": 2}
        torch.testing.assert_close(y, torch.tanh(0.5 * x))
        torch.testing.assert_close(x.grad, 0.5 * (1 - torch.tanh(0.5 * x.detach()) ** 2))
        with opsadv.use_backend("toyop"):
            exp = opsadv.explain("scaled_tanh", torch.randn(3, 4, dtype=torch.float16))
        assert exp.chosen is None                  # strictly the toyop backend: nothing serves float16
        assert any(c.impl.id == "toyop.scaled_tanh" and "dtype float16 not in" in " ".join(c.reasons)
                   for c in exp.candidates)
        with pytest.raises(TypeError, match="alpa"):
            opsadv.explain("scaled_tanh", x, alpa=2.0)
        with opsadv.use_backend("toyop", impls={"scaled_tanh": "toyop.scaled_tanh"}), opsadv.trace() as t:
            plugin.scaled_tanh(torch.randn(3, 3))
        assert dict(t.counts) == {"toyop.scaled_tanh": 1}
        case = next(c for c in opdef.get_op("scaled_tanh").cases if c.shape_class == "odd")
        r = run_case(case, "toyop", torch.float32, "cpu")
        assert r.status == "pass" and r.impl == "toyop.scaled_tanh" and "backward" in r.checks, r
        results = run_conformance("toyop", ops=["scaled_tanh"])
        by = {(r.shape_class, r.dtype): r for r in results}
        assert {s for s, _ in by} == {"one", "odd", "strided", "compile", "export"}
        assert all(by[(s, d)].status == "pass" for s in ("one", "odd", "strided") for d in ("float32", "float64"))
        assert by[("odd", "float16")].status == "skip" and "dtype float16 not in" in by[("odd", "float16")].reason
        assert by[("compile", "float32")].status == "pass" and by[("export", "float32")].status == "pass"
    finally:
        opsadv.core.dispatch.clear_cache()


def test_a_plugin_cannot_redefine_an_op(isolated_ops):
    """An op name another definition holds is refused at the "ops" stage: the plugin is skipped with the reason,
    its kernels with it, and the op keeps its definition."""
    d = opdef.get_op("gemm")

    class Thief:
        @hookimpl
        def opsadv_backend_info(self):
            return BackendInfo(name="thief", device_types=("cpu",))

        @hookimpl
        def opsadv_probe(self, env):
            return ProbeResult(True)

        @hookimpl
        def opsadv_register_ops(self):
            return [opdef.OpDef("gemm", lambda a, b: a @ b, d.reference, d.spec)]

        @hookimpl
        def opsadv_register_kernels(self, registry, env):
            raise AssertionError("not reached")

    reg = Registry()
    with pytest.warns(RuntimeWarning, match="thief"):
        assert reg.register_plugin(Thief(), name="thief") is None
    assert reg.failures[0].stage == "ops" and "'gemm' is already defined by" in reg.failures[0].error
    assert opdef.get_op("gemm") is d


def test_a_plugin_failing_after_its_ops_defines_nothing(isolated_ops):
    plugin = _load_plugin()

    class Half:
        @hookimpl
        def opsadv_backend_info(self):
            return BackendInfo(name="half", device_types=("cpu",))

        @hookimpl
        def opsadv_probe(self, env):
            return ProbeResult(True)

        @hookimpl
        def opsadv_register_ops(self):
            return [plugin.OPDEF]

        @hookimpl
        def opsadv_register_kernels(self, registry, env):
            raise RuntimeError("driver missing")

    reg = Registry()
    with pytest.warns(RuntimeWarning, match="half"):
        assert reg.register_plugin(Half(), name="half") is None
    assert reg.failures[0].stage == "register" and "scaled_tanh" not in opdef.OPS


def test_installed_op_plugin_passes_opsadv_conformance(toyop_site, tmp_path):
    out = tmp_path / "toyop.json"
    p = subprocess.run([sys.executable, "-m", "opsadv", "conformance", "--backend", "toyop", "--ops", "scaled_tanh",
                        "--json", str(out)], capture_output=True, text=True, env=_env(toyop_site), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    by = {(r["shape_class"], r["dtype"]): r for r in data["results"]}
    assert data["summary"]["fail"] == 0 and by[("strided", "float64")]["status"] == "pass"
    assert by[("odd", "float32")]["impl"] == "toyop.scaled_tanh"
    assert by[("odd", "bfloat16")]["status"] == "skip"
    p = subprocess.run([sys.executable, "-m", "opsadv", "info", "--json"], capture_output=True, text=True,
                       env=_env(toyop_site), timeout=300)
    toyop = next(b for b in json.loads(p.stdout)["backends"] if b["name"] == "toyop")
    assert toyop["ops"] == ["scaled_tanh"] and toyop["impls"] == 1
    # without the plugin the op is unknown, and refused with the valid names
    p = subprocess.run([sys.executable, "-m", "opsadv", "conformance", "--backend", "reference", "--ops", "scaled_tanh"],
                       capture_output=True, text=True, env=_env(toyop_site, OPSADV_PLUGINS="none"), timeout=300)
    assert p.returncode == 2 and "scaled_tanh" in p.stderr and "rms_norm" in p.stderr


def test_installed_op_plugin_under_the_pytest_plugin(toyop_site, tmp_path):
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "opsadv.testing", "--opsadv-backend", "toyop",
                        "--opsadv-quick", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
                        "-k", "scaled_tanh", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                       env=_env(toyop_site), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 passed, 4 skipped" in p.stdout, p.stdout[-2000:]      # float16 / bfloat16: the kernel refuses them
