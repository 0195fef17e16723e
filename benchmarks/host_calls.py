"""CPU micro-benchmark of the host path of opsadv's public ops at decode-like shapes, with the GPU work
stubbed out: how many Python function calls and torch C calls one op call makes, and its Python time.
Runs on any machine (no GPU): Triton norm launches are replaced by no-ops, the vendor attention kernel
by a stand-in doing what cudnn_fwd does around it, and the cuBLAS impls run their torch code on tiny CPU
tensors (so their aten calls are real but cheap).  The call path is the one a CUDA call takes: public
op -> validate -> eager mode -> dispatch (memoized) -> the cuda impl's host code.  Absolute times are
this CPU's (the GPU host's is ~3-5x slower per torch call); the counts are what transfers.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/host_calls.py [--out PATH]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import time

os.environ.setdefault("TRITON_INTERPRET", "1")      # the cuda backend's Triton impls accept CPU tensors

import torch  # noqa: E402

import opsadv  # noqa: E402
from opsadv.core import dispatch  # noqa: E402
from opsadv.core.dispatch import Resolved  # noqa: E402

N_CALLS = 2000


class _NoLaunch:
    """Stands in for a FastLaunch'd Triton kernel: `k[grid](*args, **kw)` does nothing."""

    def __getitem__(self, grid):
        return _noop


def _noop(*a, **k):
    return None


def _stub_norm_kernels():
    from opsadv.backends.cuda import norm as N
    N._kernels()
    N._K.update({k: _NoLaunch() for k in ("fwd", "bwd", "reduce")})      # not the config tuner


def _has(impl_id) -> bool:
    from opsadv.registry import get_registry
    return any(i.id == impl_id for ops in get_registry().impls_by_op.values() for i in ops)


def _impl(impl_id):
    from opsadv.registry import get_registry
    return next(i for ops in get_registry().impls_by_op.values() for i in ops if i.id == impl_id)


def _serve(op: str, impl_id: str, run=None, hidden=None):
    """Every memoized resolution of `op` (forward and backward; of one hidden size for the norms) is
    served by `impl_id`'s host code (or `run`): the CPU stand-in for what a CUDA call resolves to."""
    impl = _impl(impl_id)
    for k, r in list(dispatch._memo.items()):
        if k[1][0] == op and (hidden is None or k[1][4] == hidden):
            fn = run or (impl.backward if r.ctx.spec.backward else impl.fn)
            dispatch._memo[k] = Resolved(impl, r.ctx, fn)


def _cudnn_like(ctx, q, k, v, attn_mask, causal, scale):
    """cudnn_fwd's host code around the aten kernel: the kernel's (out, lse (b, h, s_q, 1)) are
    preallocated; the reshape is what cudnn_fwd adds per call."""
    b, h, sq, _ = q.shape
    return _ATT_OUT[0], _ATT_OUT[1].reshape(b, h, sq)


_ATT_OUT: list = []


def cases():
    dt = torch.float16   # (the interpreter refuses bf16 for Triton dots; resolution only)
    b, hid, nh, hkv, d, ctx_len, inter = 8, 2048, 32, 4, 64, 128, 96
    x = torch.randn(b, 1, hid, dtype=dt)
    r = torch.randn(b, 1, hid, dtype=dt)
    wn = torch.ones(hid, dtype=dt)
    bn = torch.zeros(hid, dtype=dt)
    xa, wa = torch.randn(b, 1, 1024, dtype=dt), torch.ones(1024, dtype=dt)   # (its own bucket: the aten case)
    xs = torch.randn(b, 1, 64, dtype=dt)               # GEMMs run for real on CPU: keep them tiny
    wq = torch.randn(96, 64, dtype=dt)                  # an nn.Linear weight (N, K), passed as .t()
    wgu = torch.randn(2 * inter, 64, dtype=dt)
    q = torch.randn(b, nh, 1, d, dtype=dt)
    k, v = (torch.randn(b, hkv, ctx_len, d, dtype=dt) for _ in range(2))
    _ATT_OUT[:] = [torch.empty_like(q), torch.empty(b, nh, 1, 1)]
    xg = x.clone().requires_grad_()
    wg = wn.clone().requires_grad_()
    bg = bn.clone().requires_grad_()
    gy = torch.randn_like(x)
    ops = opsadv.ops

    def ng(fn):
        def go():
            with torch.no_grad():
                return fn()
        return go

    return {
        "rms_norm no-grad (8x2048)": ng(lambda: ops.rms_norm(x, wn, 1e-6)),
        "rms_norm+residual no-grad": ng(lambda: ops.rms_norm(x, wn, 1e-6, residual=r)),
        "rms_norm no-grad, aten impl (8x1024, real kernel)": ng(lambda: ops.rms_norm(xa, wa, 1e-6)),
        "layer_norm no-grad": ng(lambda: ops.layer_norm(x, wn, bn, 1e-5)),
        "rms_norm fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(ops.rms_norm(xg, wg, 1e-6), (xg, wg), gy),
        "layer_norm fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(ops.layer_norm(xg, wg, bg, 1e-5),
                                                                          (xg, wg, bg), gy),
        "gemm no-grad (cublas impl, tiny)": ng(lambda: ops.gemm(xs, wq.t())),
        "swiglu_gemm no-grad (cublas small_m, tiny)": ng(lambda: ops.swiglu_gemm(xs, wgu.t())),
        "flash_attention no-grad decode (cudnn stand-in)": ng(lambda: ops.flash_attention(q, k, v)),
    }


def _torch_call(func: tuple) -> bool:
    name = func[2]
    return func[0] == "~" and ("torch" in name or "TensorBase" in name)


def _profile(fn, n: int) -> dict:
    """cProfile's raw stats over n calls of fn."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    return pstats.Stats(pr).stats


def count_calls(fn, n: int = 200) -> tuple[float, float]:
    """(Python function calls, torch C calls) per call of fn, from cProfile."""
    st = _profile(fn, n)
    total = sum(v[1] for v in st.values()) - 1        # primitive+recursive calls; minus the disable call
    torch_calls = sum(v[1] for f, v in st.items() if _torch_call(f))
    return total / n, torch_calls / n


def torch_call_names(fn, n: int = 50) -> str:
    st = _profile(fn, n)
    rows = sorted(((v[1] / n, f[2]) for f, v in st.items() if _torch_call(f)), reverse=True)
    return ", ".join(f"{name.replace('built-in method ', '').replace(' of torch._C.TensorBase objects', '')}"
                     f" x{c:g}" for c, name in rows)


def py_us(fn, n: int = N_CALLS) -> float:
    """Median over 5 rounds of the wall time per call (µs) on this CPU."""
    for _ in range(50):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(rounds)[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--names", action="store_true", help="list the torch C calls of each case")
    args = ap.parse_args()
    torch.set_num_threads(1)
    table = cases()
    _stub_norm_kernels()
    lines = []
    with opsadv.use_backend("cuda", impls={"gemm": "cuda.triton.gemm", "swiglu_gemm": "cuda.triton.swiglu_gemm",
                                           "flash_attention": "cuda.triton.flash_attention"}):
        # resolve every bucket once (GEMM / attention resolutions are then re-pointed at the cuda
        # vendor impls' host code, which CPU tensors cannot reach through resolution)
        import importlib
        G, A = (importlib.import_module(f"opsadv.core.ops.{m}") for m in ("gemm", "attention"))
        for name in ("rms_norm no-grad (8x2048)", "rms_norm+residual no-grad", "layer_norm no-grad",
                     "rms_norm no-grad, aten impl (8x1024, real kernel)",
                     "rms_norm fwd+bwd (autograd.grad)", "layer_norm fwd+bwd (autograd.grad)"):
            table[name]()
        _resolve_only(G, A)
        if _has("cuda.aten.rms_norm_small_rows"):
            _serve("rms_norm", "cuda.aten.rms_norm_small_rows", hidden=1024)   # what a GPU decode call resolves to
        _serve("gemm", "cuda.cublas.gemm")
        _serve("swiglu_gemm", "cuda.cublas.swiglu_gemm_small_m")
        _serve("flash_attention", "cuda.sdpa.cudnn", run=_cudnn_like)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "opsadv"], capture_output=True,
                               text=True).stdout.strip()
        lines.append(f"# host_calls.py at {commit}{' (+uncommitted opsadv changes)' if dirty else ''}; "
                     f"torch {torch.__version__}; CPU, kernels stubbed; 1 thread")
        lines.append(f"{'case':48s} {'py calls':>9s} {'torch C':>8s} {'us/call':>8s}")
        for name, fn in table.items():
            calls, tcalls = count_calls(fn)
            us = py_us(fn)
            lines.append(f"{name:48s} {calls:9.0f} {tcalls:8.1f} {us:8.1f}")
            print(lines[-1], flush=True)
            if args.names:
                lines.append("    " + torch_call_names(fn))
                print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def _resolve_only(G, A):
    """Memoize the GEMM / attention buckets of the cases without running a kernel."""
    dt = torch.float16   # (the interpreter refuses bf16 for Triton dots; resolution only)
    xs, wq, wgu = torch.empty(8, 1, 64, dtype=dt), torch.empty(96, 64, dtype=dt).t(), torch.empty(192, 64, dtype=dt).t()
    q, k = torch.empty(8, 32, 1, 64, dtype=dt), torch.empty(8, 4, 128, 64, dtype=dt)
    dispatch.resolve(G._gemm_key(xs, wq, None, "none", None, 1.0, False),
                     lambda: G._gemm_spec(xs, wq, None, "none", None, 1.0, False))
    dispatch.resolve(G._swiglu_key(xs, wgu, None, False), lambda: G._swiglu_spec(xs, wgu, None, False))
    dispatch.resolve(A._key(q, k, None, False, False), lambda: A._spec(q, k, None, False, False))


if __name__ == "__main__":
    main()
