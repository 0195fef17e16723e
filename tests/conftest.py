"""Shared test set-up.  The Triton interpreter is switched on for the whole session (before
triton is imported) so the cuda backend's kernels run on CPU tensors; each test gets the
policy it started with restored afterwards."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# conversions in tests must not depend on timing; the floor's own tests switch it on with a fake timer
os.environ.setdefault("OPSADV_CONVERT_FLOOR", "0")
# pytest-xdist (the README's `-n auto`): each worker process gets its own tuning cache directory, so two
# workers never write the same cache file
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
os.environ.setdefault("OPSADV_CACHE_DIR", os.path.join(os.path.dirname(__file__),
                                                       ".cache-opsadv" + (f"-{_WORKER}" if _WORKER else "")))

import pytest  # noqa: E402
import torch  # noqa: E402

import opsadv  # noqa: E402
from opsadv.core import policy as _policy  # noqa: E402

# one intra-op thread pool per worker, sized so the workers together use the machine's cores once
if _WORKER:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sm90_compile_env() -> dict:
    """Environment for a child process that compiles kernels for sm_90 on this (CPU) machine: without
    TRITON_INTERPRET (under it jit functions become interpreter objects that cannot be compiled), with the repo
    on PYTHONPATH.  Skips the calling test where Triton has no ptxas."""
    try:
        from triton import knobs
        ptxas = getattr(knobs.nvidia.ptxas, "path", None)
    except Exception as e:  # no NVIDIA backend in this Triton
        pytest.skip(f"no ptxas: {type(e).__name__}: {e}")
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip(f"ptxas not found ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_sm90_compile(argv: list, timeout: float = 600) -> str:
    """`python *argv` under sm90_compile_env() from the repo root; its stdout (the test fails on a non-zero exit)."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=sm90_compile_env(),
                         cwd=REPO_ROOT, timeout=timeout)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return res.stdout


# The first lines of a child script that compiles Gluon kernels for sm_90 (run_sm90_compile_jobs): no interpreter,
# benchmarks/gluon_fa/compile_sm90.py's helpers importable, the cases as JSON in sys.argv[1].
SM90_SCRIPT_PRELUDE = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks", "gluon_fa"))
import torch
from compile_sm90 import compile_sm90, kernel_report
report = {}
"""


def run_sm90_compile_jobs(script: str, cases: list, jobs: int = 4) -> dict:
    """`python -c script JSON(cases)` in up to `jobs` child processes under sm90_compile_env(), each on a share of
    cases; the JSON dicts their last stdout lines print, merged (a child's non-zero exit fails the test)."""
    import json
    import subprocess
    import sys
    env = sm90_compile_env()
    jobs = max(1, min(jobs, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", script, json.dumps(cases[i::jobs])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT) for i in range(jobs)]
    report = {}
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        report.update(json.loads(out.strip().splitlines()[-1]))
    return report


def assert_sm90_impl_rejections(impl, reasons, spec) -> None:
    """What every measured sm_90-only Gluon impl declares and refuses: not experimental, ranked below the Triton
    impls (an unmeasured bucket keeps the Triton / cuBLAS order), sm_90 only, bf16 / fp16 only, CUDA only.
    reasons(spec, env) -> the impl's rejection reasons; spec(**kw) -> a CallSpec of its op."""
    from opsadv.core.kernel import PRIORITY_TRITON
    env = fake_cuda_env()
    assert not impl.experimental and impl.priority == PRIORITY_TRITON - 5
    assert impl.min_cc == impl.max_cc == (9, 0)
    assert any("dtype float32" in r for r in reasons(spec(torch.float32), env))
    assert any(">= 9.0" in r for r in reasons(spec(), fake_cuda_env((8, 0))))
    assert any("<= 9.0" in r for r in reasons(spec(), fake_cuda_env((10, 0))))
    assert any("device 'cpu'" in r for r in reasons(spec(device="cpu"), env))


SM90_SMEM_LIMIT = 232448      # sm_90 opt-in shared memory per block (227 KB)


def assert_sm90_clean(r: dict, key: str) -> None:
    """A kernel_report of an sm_90 compile: shared memory within the opt-in limit, no spill (STL/LDL, stack), and
    every setmaxnreg region within its budget (ptxas would spill otherwise)."""
    assert r["shared_bytes"] <= SM90_SMEM_LIMIT, r
    assert r["spills"] == 0 and r["stack"] == 0, f"{key}: {r}"
    assert all(top < limit for limit, top in r["regions"]), r["regions"]


@pytest.fixture(autouse=True)
def _restore_policy():
    before = _policy._global
    yield
    _policy._set_global(before)


@pytest.fixture
def reference_backend():
    """Run the test under the reference backend (no interpreter kernels)."""
    with opsadv.use_backend("reference") as b:
        yield b


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def train_step(model, inputs: dict, run=None):
    """One forward + backward of `run` (default: the model) on inputs with labels: (loss, {name: gradient})."""
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(want, got, tol=1e-4, grad_floor=False):
    """train_step results of the original (want) and the converted model (got): loss within tol, the same
    parameters with gradients, each finite and within tol relative; grad_floor: within tol of (its own norm + the
    whole gradient's norm), for gradients zero in exact arithmetic (a key projection's bias under softmax)."""
    (wl, wg), (gl, gg) = want, got
    assert abs(wl.item() - gl.item()) <= tol * abs(wl.item())
    assert wg.keys() == gg.keys()
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in wg.values())).item() if grad_floor else 0.0
    for n in wg:
        assert torch.isfinite(gg[n]).all(), n
        if grad_floor:
            err = (gg[n] - wg[n]).norm().item()
            assert err <= tol * (wg[n].norm().item() + total), (n, err)
        else:
            assert rel_err(gg[n], wg[n]) < tol, (n, rel_err(gg[n], wg[n]))


def attention_impls(t) -> dict:
    """The attention impls an opsadv.trace() saw, with their call counts."""
    return {k: v for k, v in t.counts.items() if "attention" in k}


def registered_impl(op: str, impl_id: str):
    """The KernelImpl `impl_id` of `op` in the live registry (the test fails, listing the ids, if it is missing)."""
    from opsadv.registry import get_registry
    impls = {i.id: i for i in get_registry().impls_by_op[op]}
    assert impl_id in impls, sorted(impls)
    return impls[impl_id]


def assert_gemm_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """A GEMM-family output against its float64 reference: no NaN, relative-norm error below 1e-2 (bf16) / 2e-3."""
    assert not torch.isnan(got).any()
    err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-6)
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err.item()


def load_without_gluon(monkeypatch, module, kernel_module_suffix: str):
    """A fresh copy of `module` (a Gluon impl module) imported while triton.experimental.gluon cannot be
    imported: what a machine without Gluon sees.  The kernel module is dropped from sys.modules so
    the copy's guarded import of it runs again and fails."""
    import importlib.util
    import sys
    for name in list(sys.modules):
        if name.startswith("triton.experimental.gluon") or name.endswith(kernel_module_suffix):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)     # import -> ImportError
    spec = importlib.util.spec_from_file_location(module.__name__ + "_nogluon", module.__file__,
                                                  submodule_search_locations=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = module.__package__
    spec.loader.exec_module(mod)
    return mod


def gluon_marks(module):
    """(needs_gluon, requires_sm90) skip marks for a Gluon impl module's tests: the first when
    triton.experimental.gluon does not import, the second unless an sm_90 GPU, Gluon, and
    TRITON_INTERPRET=0 (this conftest turns the interpreter on by default) are all there."""
    from opsadv.core.envvars import triton_interpret
    has_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    interpret = triton_interpret()
    needs_gluon = pytest.mark.skipif(bool(module.UNAVAILABLE), reason=module.UNAVAILABLE or "")
    requires_sm90 = pytest.mark.skipif(not has_sm90 or bool(module.UNAVAILABLE) or interpret,
                                       reason="needs an sm_90 GPU, Gluon, and TRITON_INTERPRET=0")
    return needs_gluon, requires_sm90


def fake_cuda_env(cc=(9, 0), interpret=False):
    """This machine's EnvInfo dressed as a CUDA device of compute capability `cc`: for support
    declarations and rejection reasons of device-only impls, checked without the device."""
    import dataclasses

    from opsadv.registry import get_registry
    return dataclasses.replace(get_registry().env, device_type="cuda", compute_capability=cc,
                               triton_interpret=interpret)


# (b, hq, hkv, sq, sk, d, causal): the attention shapes the Gluon kernels are checked at on an H100/H200
ATTENTION_GPU_CASES = [
    (1, 2, 2, 1, 1, 64, False),
    (1, 2, 2, 3, 3, 128, True),
    (2, 3, 3, 127, 127, 64, False),
    (2, 3, 3, 127, 127, 128, True),
    (1, 4, 2, 1000, 1000, 128, True),       # GQA, ragged, several tiles
    (1, 4, 1, 1000, 1000, 64, False),       # MQA
    (2, 4, 2, 1, 1000, 128, True),          # decode
    (1, 2, 2, 300, 1000, 128, True),        # s_q < s_k
    (1, 2, 2, 1000, 300, 64, True),         # s_q > s_k: empty rows
]


def assert_attention_matches(dtype, got: dict, ref: dict, lse, ref_lse) -> None:
    """A low-precision attention forward+backward against its float64 reference: rows with no key
    (lse -inf) agree and give out 0, no NaN anywhere, lse within 2e-3, out/dq/dk/dv within 2e-2 (bf16)
    or 4e-3 (fp16) norm-relative.  `got` / `ref`: {"out", "dq", "dk", "dv"} tensors."""
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (got["out"][empty] == 0).all()
    for name, x in (("lse", lse), *got.items()):
        assert not torch.isnan(x).any(), name
    if (~empty).any():
        assert (lse[~empty].double() - ref_lse[~empty]).abs().max().item() < 2e-3
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name in ("out", "dq", "dk", "dv"):
        # s_q = s_k = 1 has dq = dk = 0 exactly: the denominator gets a floor of 1e-3 RMS per element, so
        # rounding noise (~2e-7 RMS in fp16 on the H200) is not divided by ~0 (that case failed there)
        x, r = got[name].double(), ref[name].double()
        err = ((x - r).norm() / r.norm().clamp_min(1e-3 * r.numel() ** 0.5)).item()
        assert err < tol, (name, err)


@pytest.fixture
def dispatch_calls(monkeypatch):
    """[(CallSpec, inference flag)] of every dispatch.call made while the test runs (the op still runs)."""
    from opsadv.core import dispatch
    seen = []
    real = dispatch.call

    def spy(key, make_spec, args, inference=False):
        seen.append((make_spec(), inference))
        return real(key, make_spec, args, inference)
    monkeypatch.setattr(dispatch, "call", spy)
    return seen
