"""use_backend(impls={op: impl id}) pins one kernel per op: every other impl is refused with the
reason, a call the pinned impl cannot serve raises with its reasons, bad pins are named; the
conformance CLI's --impl runs the catalogue on one kernel."""
from __future__ import annotations

import json

import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError, NoKernelError


def _interp():
    try:
        with opsadv.use_backend("cuda"):
            return True
    except Exception:
        return False


def test_bad_pins_are_named():
    with pytest.raises(InvalidArgumentError, match="impls"):
        opsadv.use_backend("auto", impls={"gemmm": "reference.gemm"})
    with pytest.raises(InvalidArgumentError, match="registered for gemm"):
        opsadv.use_backend("auto", impls={"gemm": "reference.layer_norm"})
    with pytest.raises(InvalidArgumentError, match="dict"):
        opsadv.use_backend("auto", impls=["reference.gemm"])


def test_pinned_impl_runs_and_others_say_why():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    with opsadv.use_backend("auto", impls={"gemm": "reference.gemm"}) as be:
        assert "gemm pinned to reference.gemm" in be.policy.describe()
        with opsadv.trace() as t:
            out = opsadv.ops.gemm(a, b)
        exp = opsadv.explain("gemm", a, b)
    assert dict(t.counts) == {"reference.gemm": 1}
    torch.testing.assert_close(out, a @ b)
    others = [c for c in exp.candidates if c.impl.id != "reference.gemm"]
    assert all("policy pins gemm to 'reference.gemm'" in c.reasons for c in others)


@pytest.mark.skipif(not _interp(), reason="cuda backend unavailable (no GPU, no interpreter)")
def test_pinned_impl_that_cannot_serve_raises_with_reasons():
    q = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    with opsadv.use_backend("cuda", impls={"flash_attention": "cuda.triton.flash_attention"}):
        with pytest.raises(NoKernelError, match="float64"):
            opsadv.ops.flash_attention(q, q, q)


@pytest.mark.skipif(not _interp(), reason="cuda backend unavailable (no GPU, no interpreter)")
def test_conformance_cli_runs_one_impl(tmp_path):
    from opsadv.cli import main
    out = tmp_path / "m.json"
    rc = main(["conformance", "--backend", "cuda", "--quick", "--impl", "cuda.triton.rms_norm", "--json", str(out)])
    data = json.loads(out.read_text())
    cells = [r for r in data["results"] if r["shape_class"] not in ("compile", "export")]
    assert rc == 0 and {r["op"] for r in data["results"]} == {"rms_norm"}
    assert any(r["status"] == "pass" for r in cells)
    assert all(r["impl"] == "cuda.triton.rms_norm" for r in cells if r["status"] == "pass")
    assert "Pinned impls: rms_norm -> cuda.triton.rms_norm" in data.get("note", "")


def test_graph_checks_run_under_the_pin(monkeypatch):
    """compile/export cells compile the pinned kernel (they ignored --impl before: the export cell of
    the pinned Triton flash run on the H200 exported cuda.sdpa.efficient)."""
    from opsadv.testing import runner
    seen = []
    real = opsadv.use_backend

    def spy(*a, **kw):
        seen.append(kw.get("impls"))
        return real(*a, **kw)

    monkeypatch.setattr(runner.opsadv, "use_backend", spy)
    res = runner.run_graph_checks("gemm", "reference", "cpu", impls={"gemm": "reference.gemm"})
    assert seen and all(s == {"gemm": "reference.gemm"} for s in seen)
    assert {r.impl for r in res if r.status == "pass"} == {"reference.gemm"}


def test_conformance_pin_runs_an_experimental_impl():
    """Pinning is the explicit opt-in: conformance of a pinned experimental impl runs its cells (how an
    experimental kernel such as cuda.gluon.flash_attention earns its way out of the gate), it does not
    skip them as 'experimental'."""
    import dataclasses

    from opsadv import KernelImpl
    from opsadv.ops.norm import reference as R
    from opsadv.registry import BackendInfo, ProbeResult, hookimpl, reset_registry
    from opsadv.testing.runner import run_conformance

    class Lab:
        @hookimpl
        def opsadv_backend_info(self):
            return BackendInfo(name="lab", device_types=("cpu",), auto_priority=50)

        @hookimpl
        def opsadv_probe(self, env):
            return ProbeResult(True)

        @hookimpl
        def opsadv_register_kernels(self, registry, env):
            registry.add(KernelImpl(id="lab.rms_norm", op="rms_norm", backend="lab", fn=R.rms_norm_fwd,
                                    backward=R.rms_norm_bwd, device_types=("cpu",),
                                    dtypes=(torch.float32, torch.float16, torch.bfloat16),
                                    features=frozenset({"weight", "residual", "offset"}), experimental=True))

    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    try:
        reg.register_plugin(Lab(), name="lab")
        unpinned = run_conformance("lab", quick=True, device="cpu", ops=["rms_norm"])
        pinned = run_conformance("lab", quick=True, device="cpu", ops=["rms_norm"], impls={"rms_norm": "lab.rms_norm"})
    finally:
        reset_registry()
    cells = [r for r in pinned if r.shape_class not in ("compile", "export")]
    assert cells and all(r.status == "pass" and r.impl == "lab.rms_norm" for r in cells), \
        [(r.status, r.reason) for r in cells]
    assert not any(r.status == "pass" and r.impl == "lab.rms_norm" for r in unpinned)
