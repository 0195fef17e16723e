"""The conformance kit itself: the reference backend passes its full catalogue, the CLI writes
the matrix, the pytest plugin works, and a wrong impl is caught (the kit can fail)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opsadv
from opsadv import KernelImpl
from opsadv.registry import BackendInfo, ProbeResult, hookimpl, reset_registry
from opsadv.testing import CATALOGUE, run_case, run_conformance
from opsadv.testing.report import summary, to_markdown

ROOT = Path(__file__).parent.parent


def test_reference_passes_full_catalogue():
    results = run_conformance("reference", quick=False)
    s = summary(results)
    assert s["fail"] == 0 and s["skip"] == 0, [r for r in results if r.status != "pass"][:3]
    assert {r.op for r in results} == {c.op for c in CATALOGUE}
    assert any(r.shape_class == "export" and r.status == "pass" for r in results)
    md = to_markdown(results, backend="reference", device="cpu", quick=False)
    assert "## flash_attention" in md and "| cross_causal |" in md


def test_cli_writes_matrix(tmp_path):
    j, m = tmp_path / "r.json", tmp_path / "r.md"
    p = subprocess.run([sys.executable, "-m", "opsadv", "conformance", "--backend", "reference", "--quick",
                        "--ops", "rms_norm,gemm", "--json", str(j), "--markdown", str(m)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "0 failed" in p.stdout
    data = json.loads(j.read_text())
    assert data["backend"] == "reference" and data["summary"]["fail"] == 0
    assert "# Conformance: backend `reference`" in m.read_text()


def test_pytest_plugin(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "opsadv.testing", "--opsadv-backend", "reference",
                        "--opsadv-quick", "-k", "rms_norm", "-p", "no:cacheprovider", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "conformance" not in p.stdout.split("passed")[0][-3:]


class _CpuToyBackend:
    """A CPU backend named `name`, always available; subclasses register its kernels."""
    name = ""

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name=self.name, device_types=("cpu",))

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)


def _rms_norm_without_weight(ctx, x, weight, eps, residual, offset):
    """The reference rms_norm forward that forgets the weight: the toy backends' planted bug."""
    from opsadv.ops.norm.reference import rms_norm_fwd
    return rms_norm_fwd(ctx, x, None, eps, residual, offset)


class Wrong(_CpuToyBackend):
    """A backend whose rms_norm forgets the weight: the kit must flag it."""
    name = "wrong"

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        registry.add(KernelImpl(id="wrong.rms_norm", op="rms_norm", backend="wrong", fn=_rms_norm_without_weight,
                                device_types=("cpu",), dtypes=(torch.float32,), features=frozenset({"weight"})))


def test_kit_catches_a_wrong_kernel():
    reg = reset_registry()
    reg.register_plugin(Wrong(), name="wrong")
    try:
        case = next(c for c in CATALOGUE if c.op == "rms_norm" and c.shape_class == "odd")
        r = run_case(case, "wrong", torch.float32, "cpu")
        assert r.status == "fail" and r.reason.startswith("forward output 0: rel err") and r.impl == "wrong.rms_norm"
        r = run_case(case, "wrong", torch.float16, "cpu")
        assert r.status == "skip" and "dtype float16 not in ['float32']" in r.reason
    finally:
        reset_registry()


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_cuda_backend_real_kernels_in_interpreter(tmp_path, precision):
    """`TRITON_INTERPRET=1 opsadv conformance --backend cuda --quick`: the Triton kernels on CPU (one run per
    precision policy, so pytest-xdist can run the two on different workers; the policy run takes only the float32
    cells -- the policy changes nothing else, and the default run has the fp16 ones)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    j = tmp_path / f"cuda-{precision}.json"
    cmd = [sys.executable, "-m", "opsadv", "conformance", "--backend", "cuda", "--quick", "--json", str(j)]
    if precision:
        # (float32 GEMMs need the tf32 policy, not this one: they skip here, and their fp16 cells are the default run's)
        cmd += ["--precision", precision, "--ops", "flash_attention,sparse_attention", "--dtypes", "float32"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(j.read_text())
    passed = [r for r in data["results"] if r["status"] == "pass"]
    assert data["summary"]["fail"] == 0
    # every op ran through a cuda Triton impl, forward and backward, somewhere in the matrix
    for op in ("flash_attention", "sparse_attention") + (
            () if precision else ("gemm", "swiglu_gemm", "swiglu", "layer_norm", "rms_norm")):
        assert any(r["op"] == op and r["impl"].startswith("cuda.triton") and "backward" in r["checks"]
                   for r in passed), op
    if precision:   # float32 inputs now served through the policy
        assert any(r["dtype"] == "float32" and r["op"] == "flash_attention" for r in passed)
        assert {r["dtype"] for r in data["results"] if r["shape_class"] not in ("compile", "export")} == {"float32"}


def test_cli_dtypes_selects_cells_and_rejects_unknown_names(tmp_path, capsys):
    from opsadv.cli import main
    j = tmp_path / "m.json"
    assert main(["conformance", "--backend", "reference", "--quick", "--ops", "rms_norm", "--dtypes", "fp32,float16",
                 "--json", str(j)]) == 0
    cells = [r for r in json.loads(j.read_text())["results"] if r["shape_class"] not in ("compile", "export")]
    assert {r["dtype"] for r in cells} == {"float32", "float16"} and all(r["status"] == "pass" for r in cells)
    assert main(["conformance", "--backend", "reference", "--ops", "rms_norm", "--dtypes", "float8"]) == 2
    err = capsys.readouterr().err
    assert "--dtypes" in err and "float8" in err and "float32" in err


class WrongInference(_CpuToyBackend):
    """A backend whose rms_norm is right, but whose `inference` forward (no-grad calls) forgets the weight."""
    name = "wronginf"

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        from opsadv.ops.norm.reference import rms_norm_bwd, rms_norm_fwd
        registry.add(KernelImpl(id="wronginf.rms_norm", op="rms_norm", backend="wronginf", fn=rms_norm_fwd,
                                backward=rms_norm_bwd, inference=_rms_norm_without_weight, device_types=("cpu",),
                                dtypes=(torch.float32,), features=frozenset({"weight"})))


def test_kit_checks_the_no_grad_forward_too():
    """Conformance also runs each case without autograd, where an impl's `inference` forward serves."""
    reg = reset_registry()
    reg.register_plugin(WrongInference(), name="wronginf")
    try:
        case = next(c for c in CATALOGUE if c.op == "rms_norm" and c.shape_class == "odd")
        r = run_case(case, "wronginf", torch.float32, "cpu")
        assert r.status == "fail" and r.reason.startswith("no-grad forward (wronginf.rms_norm) output 0: rel err"), r
        assert r.checks == ["forward"]
    finally:
        reset_registry()
