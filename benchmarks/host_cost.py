"""Host (CPU) cost per call of opsadv ops vs their eager equivalents, on the GPU host: how long the
Python side takes to enqueue one call while the GPU is kept busy (a long `torch.cuda._sleep` is queued
first, so the host never waits on the GPU and the launch queue never fills).  Also the cost of a bare
Triton launch, and a cProfile of the norm fwd+bwd path (the cases the norm bench found host-bound).

    PYTHONPATH=. python3 benchmarks/host_cost.py [--json PATH] [--profile PATH]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time

import torch
import torch.nn.functional as F

import opsadv

DEV = "cuda"
N_CALLS = 40


def doubling_function(in_backward=None):
    """A trivial autograd.Function (y = 2a), whose backward first runs `in_backward()`: the baseline
    that isolates autograd's own cost, and the pieces of ours added to it one at a time."""
    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(c, a):
            return a * 2

        @staticmethod
        def backward(c, g):
            if in_backward is not None:
                in_backward()
            return g * 2
    return Doubling


def profile_text(fn, n: int, top: int, sort: str = "tottime", busy_gpu: bool = False) -> str:
    """cProfile of n calls of fn (optionally with the GPU kept busy ahead), the top rows sorted by `sort`."""
    pr = cProfile.Profile()
    if busy_gpu:
        torch.cuda._sleep(int(5e8))
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats(sort).print_stats(top)
    return sio.getvalue()


def host_us(fn, n=N_CALLS) -> float:
    """Median over 5 rounds of the host time per call with the GPU busy ahead of the calls."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        torch.cuda._sleep(int(2e8))              # ~0.1 s of GPU spin: the calls below only enqueue
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def cases():
    dt = torch.bfloat16
    t, h = 4096, 4096
    x, r = (torch.randn(t, h, device=DEV, dtype=dt).requires_grad_() for _ in range(2))
    w = torch.ones(h, device=DEV, dtype=dt).requires_grad_()
    b = torch.zeros(h, device=DEV, dtype=dt).requires_grad_()
    gy = torch.randn(t, h, device=DEV, dtype=dt)

    def ln_ours():
        y = opsadv.ops.layer_norm(x, w, b, 1e-5)
        return torch.autograd.grad(y, (x, w, b), gy)

    def ln_eager():
        y = F.layer_norm(x, (h,), w, b, 1e-5)
        return torch.autograd.grad(y, (x, w, b), gy)

    def rms_res_ours():
        y, s = opsadv.ops.rms_norm(x, w, 1e-6, residual=r)
        return torch.autograd.grad((y, s), (x, r, w), (gy, gy))

    def rms_res_eager():
        s = x + r
        y = F.rms_norm(s, (h,), w, 1e-6)
        return torch.autograd.grad((y, s), (x, r, w), (gy, gy))

    xn = x.detach()
    wn, bn = w.detach(), b.detach()

    def ln_fwd_ours():
        with torch.no_grad():
            return opsadv.ops.layer_norm(xn, wn, bn, 1e-5)

    def ln_fwd_eager():
        with torch.no_grad():
            return F.layer_norm(xn, (h,), wn, bn, 1e-5)

    a = torch.randn(256, 1024, device=DEV, dtype=dt)
    wt = torch.randn(1024, 1024, device=DEV, dtype=dt)
    bias = torch.randn(1024, device=DEV, dtype=dt)

    def gemm_ours():
        with torch.no_grad():
            return opsadv.ops.gemm(a, wt, bias=bias, activation="gelu_tanh")

    def gemm_eager():
        with torch.no_grad():
            return F.gelu(torch.addmm(bias, a, wt), approximate="tanh")

    q, k, v = (torch.randn(1, 8, 256, 64, device=DEV, dtype=dt) for _ in range(3))

    def attn_ours():
        with torch.no_grad():
            return opsadv.ops.flash_attention(q, k, v, causal=True)

    def attn_eager():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {"layer_norm fwd+bwd t4096 h4096": (ln_ours, ln_eager),
            "rms_norm+residual fwd+bwd t4096 h4096": (rms_res_ours, rms_res_eager),
            "layer_norm fwd (no grad)": (ln_fwd_ours, ln_fwd_eager),
            "gemm bias+gelu_tanh 256x1024x1024": (gemm_ours, gemm_eager),
            "flash_attention causal b1 h8 s256 d64": (attn_ours, attn_eager)}, ln_ours


def triton_launch_us() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    buf = torch.zeros(1024, device=DEV)
    return {"triton_noop_launch_us": host_us(lambda: _noop[(1,)](buf, 1024, BLOCK=1024), n=200),
            "torch_empty_us": host_us(lambda: torch.empty(1024, device=DEV), n=200),
            "torch_add_us": host_us(lambda: buf.add(1.0), n=200)}


def detail() -> list[str]:
    """Where the host time of one LayerNorm fwd / fwd+bwd goes: each layer of the call timed alone."""
    from opsadv.backends.cuda import norm as N
    from opsadv.core import dispatch
    from opsadv.core.ops import norm as ON
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    t, h = (4096, 4096) if DEV == "cuda" else (8, 64)
    x = torch.randn(t, h, device=DEV, dtype=dt)
    w, b = torch.ones(h, device=DEV, dtype=dt), torch.zeros(h, device=DEV, dtype=dt)
    xg, wg, bg = (v.clone().requires_grad_() for v in (x, w, b))
    gy = torch.randn_like(x)
    lines = []
    with opsadv.use_backend("cuda"):
        y, _, mean, rstd = ON._layer_norm_route(x, w, b, 1e-5, None)
        ctx = dispatch._memo[next(k for k in dispatch._memo if k[1][:2] == ("layer_norm", False))].ctx
        kern = N._kernels()["fwd"]
        block, rows, warps = N.fwd_config(h)
        yb, sb = torch.empty_like(x), torch.empty_like(x)
        mb, rb = torch.empty(t, device=DEV), torch.empty(t, device=DEV)

        def launcher(k):
            def go():
                k[(N.triton_cdiv(t, rows),)](x, x, w, b, yb, yb, mb, rb, t, h, h, h, h, h, 1e-5, 0.0, RMS=False,
                                            HAS_RES=False, HAS_W=True, HAS_B=True, ROWS=rows, BLOCK_N=block,
                                            num_warps=warps)
            return go

        _F = doubling_function()
        dsum = x.new_empty((0,))
        rows_ = {
            "raw Triton launch of _norm_fwd_kernel": launcher(getattr(kern, "fn", kern)),
            "FastLaunch of _norm_fwd_kernel": launcher(kern),
            "impl _ln_fwd (3 empties + launch)": lambda: N._ln_fwd(ctx, x, w, b, 1e-5, None),
            "impl _ln_infer (no stats: 1 empty + launch)": lambda: N._ln_infer(ctx, x, w, b, 1e-5, None),
            "route (dispatch.call + impl)": lambda: ON._layer_norm_route(x, w, b, 1e-5, None),
            "public no-grad": lambda: opsadv.ops.layer_norm(x, w, b, 1e-5) if not torch.is_grad_enabled() else None,
            "validate only": lambda: ON.validate("layer_norm", x, w, b, 1e-5, None),
            "backward route alone": lambda: ON._layer_norm_backward_route(gy, dsum, x, w, b, mean, rstd),
            "impl _ln_bwd alone": lambda: N._ln_bwd(ctx, gy, dsum, x, w, b, mean, rstd),
            "public fwd with grad (no backward)": lambda: opsadv.ops.layer_norm(xg, wg, bg, 1e-5),
            "public fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(opsadv.ops.layer_norm(xg, wg, bg, 1e-5),
                                                                          (xg, wg, bg), gy),
            "trivial autograd.Function fwd+bwd": lambda: torch.autograd.grad(_F.apply(xg), (xg,), gy),
            "eager F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(xg, (h,), wg, bg, 1e-5),
                                                                      (xg, wg, bg), gy),
        }
        for name, fn in rows_.items():
            if name == "public no-grad":
                with torch.no_grad():
                    us = host_us(fn)
            else:
                us = host_us(fn)
            lines.append(f"{name:45s} {us:8.1f} us")
            print(lines[-1], flush=True)
    return lines


def autograd_split() -> list[str]:
    """Where the host time of a LayerNorm fwd+bwd goes between the caller's thread and autograd's
    CUDA device thread: timestamps at the call, backward entry/exit (worker thread) and the return,
    for opsadv's op, a hand-made autograd.Function over the same routes, and a trivial Function."""
    import threading
    from opsadv.core.ops import norm as ON
    t, h = 4096, 4096
    xg = torch.randn(t, h, device=DEV, dtype=torch.bfloat16).requires_grad_()
    wg = torch.ones(h, device=DEV, dtype=torch.bfloat16).requires_grad_()
    bg = torch.zeros(h, device=DEV, dtype=torch.bfloat16).requires_grad_()
    gy = torch.randn_like(xg)
    stamps: dict = {}
    clock = time.perf_counter

    class Routes(torch.autograd.Function):
        @staticmethod
        def forward(c, x, w, b):
            y, _, mean, rstd = ON._layer_norm_route(x, w, b, 1e-5, None)
            c.save_for_backward(x, w, b, mean, rstd)
            return y

        @staticmethod
        def backward(c, dy):
            stamps["b0"] = clock()
            x, w, b, mean, rstd = c.saved_tensors
            dx, dw, db = ON._layer_norm_backward_route(dy, x.new_empty((0,)), x, w, b, mean, rstd)
            stamps["b1"] = clock()
            return dx, dw, db

    def _stamp():
        stamps["b0"] = stamps["b1"] = clock()

    Trivial = doubling_function(_stamp)

    def run(fwd, inputs):
        for _ in range(10):
            torch.autograd.grad(fwd(), inputs, gy)
        torch.cuda.synchronize()
        split = []
        torch.cuda._sleep(int(2e8))
        for _ in range(N_CALLS):
            t0 = clock()
            y = fwd()
            t1 = clock()
            torch.autograd.grad(y, inputs, gy)
            t2 = clock()
            split.append((t1 - t0, stamps.get("b0", t1) - t1, stamps.get("b1", t1) - stamps.get("b0", t1),
                          t2 - stamps.get("b1", t2)))
            stamps.clear()
        torch.cuda.synchronize()
        med = [sorted(c)[len(c) // 2] * 1e6 for c in zip(*split)]
        return "fwd {:7.1f} | call->bwd entry {:7.1f} | bwd body {:7.1f} | bwd exit->return {:7.1f} us".format(*med)

    lines = [f"python threads alive: {threading.active_count()} ({[th.name for th in threading.enumerate()]})"]
    with opsadv.use_backend("cuda"):
        lines.append("opsadv.ops.layer_norm  " + run(lambda: opsadv.ops.layer_norm(xg, wg, bg, 1e-5), (xg, wg, bg)))
        lines.append("Routes Function        " + run(lambda: Routes.apply(xg, wg, bg), (xg, wg, bg)))
        lines.append("trivial Function       " + run(lambda: Trivial.apply(xg), (xg,)))
        lines.append("eager F.layer_norm     " + run(lambda: F.layer_norm(xg, (h,), wg, bg, 1e-5), (xg, wg, bg)))
    for ln in lines:
        print(ln, flush=True)
    return lines


def autograd_experiments() -> list[str]:
    """Why a LayerNorm fwd+bwd costs ~4x eager's host time: the same call with autograd's
    multithreading off (the backward on the caller's thread), and trivial Functions whose backward
    adds one piece of ours at a time (a Triton launch; our backward's Python and allocations with
    the kernels stubbed out)."""
    import triton
    import triton.language as tl
    from opsadv.backends.cuda import norm as N
    from opsadv.core.ops import norm as ON

    @triton.jit
    def _noop(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    t, h = (4096, 4096) if DEV == "cuda" else (8, 64)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    xg = torch.randn(t, h, device=DEV, dtype=dt).requires_grad_()
    wg = torch.ones(h, device=DEV, dtype=dt).requires_grad_()
    bg = torch.zeros(h, device=DEV, dtype=dt).requires_grad_()
    gy = torch.randn_like(xg)
    buf = torch.zeros(1024, device=DEV)
    from opsadv.backends.cuda._triton_utils import FastLaunch
    noop = FastLaunch(_noop)

    OneLaunch = doubling_function(lambda: noop[(1,)](buf, 1024, BLOCK=1024))

    class Dummy:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    with opsadv.use_backend("cuda"):
        _, _, mean, rstd = ON._layer_norm_route(xg.detach(), wg.detach(), bg.detach(), 1e-5, None)
        ctx = next(r for k, r in __import__("opsadv.core.dispatch", fromlist=["_memo"])._memo.items()
                   if k[1][:2] == ("layer_norm", False)).ctx

    def _stubbed_backward():
        real = dict(N._K)
        N._K.update(bwd=Dummy(), reduce=Dummy())
        try:
            N._ln_bwd(ctx, gy, gy.new_empty((0,)), xg.detach(), wg.detach(), bg.detach(), mean, rstd)
        finally:
            N._K.update(real)

    StubbedBackward = doubling_function(_stubbed_backward)

    rows = {
        "opsadv layer_norm fwd+bwd": lambda: torch.autograd.grad(opsadv.ops.layer_norm(xg, wg, bg, 1e-5), (xg, wg, bg), gy),
        "eager F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(xg, (h,), wg, bg, 1e-5), (xg, wg, bg), gy),
        "trivial Function + 1 Triton launch in bwd": lambda: torch.autograd.grad(OneLaunch.apply(xg), (xg,), gy),
        "trivial Function + our bwd Python/allocs (kernels stubbed)": lambda: torch.autograd.grad(
            StubbedBackward.apply(xg), (xg,), gy),
    }
    lines = []
    with opsadv.use_backend("cuda"):
        for name, fn in rows.items():
            for mt in (True, False):
                with torch.autograd.set_multithreading_enabled(mt):
                    us = host_us(fn)
                lines.append(f"{name:60s} multithreading={'on ' if mt else 'off'} {us:8.1f} us")
                print(lines[-1], flush=True)
    return lines


def decode_profile() -> list[str]:
    """cProfile of Llama-1.1B decode steps (b8, 2047 cached tokens; the e2e case), converted and
    transformers sdpa, plus the host time per step with the GPU kept busy."""
    from opsadv.bench import suite_e2e as E
    case = E._llama_decode(False, DEV)
    case.setup()
    st = E._live["llama_decode"]
    lines = []
    for name in ("conv", "base"):
        step = (case.opsadv if name == "conv" else case.peers["hf_sdpa"])
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        lines.append(f"{name}: {(time.perf_counter() - t0) / 10 * 1e3:.2f} ms per decode step (host-bound)")
        lines.append(profile_text(step, 10, 45 if name == "conv" else 20))
        if name == "conv":
            lines.append(profile_text(step, 10, 50, sort="cumulative"))
    del st
    print(lines[0], lines[3] if len(lines) > 3 else "", flush=True)
    return lines


def b2b(fn, n=200) -> float:
    """Back-to-back wall µs per call: n calls, one sync (what a host-bound step pays per call)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def decode_impls() -> list[str]:
    """Each impl of the ops in a Llama-1.1B decode step (b8, one new token, 2048 cached; pinned one
    at a time): host µs per call (GPU kept busy), GPU ms (do_bench), and back-to-back wall µs per
    call (200 calls, one sync): in a host-bound decode step the last one is what counts."""
    from triton.testing import do_bench
    dt = torch.bfloat16
    b, h, hkv, d, ctx_len, hid, inter = 8, 32, 4, 64, 2048, 2048, 5632
    q = torch.randn(b, h, 1, d, device=DEV, dtype=dt)
    k, v = (torch.randn(b, hkv, ctx_len, d, device=DEV, dtype=dt) for _ in range(2))
    x = torch.randn(b, 1, hid, device=DEV, dtype=dt)
    wqkv = torch.randn(hid, hid + 2 * hkv * d, device=DEV, dtype=dt)
    wgu = torch.randn(hid, 2 * inter, device=DEV, dtype=dt)
    wn = torch.ones(hid, device=DEV, dtype=dt)
    table = {
        "flash_attention": (lambda: opsadv.ops.flash_attention(q, k, v),
                            ["cuda.sdpa.cudnn", "cuda.sdpa.flash", "cuda.sdpa.efficient", "cuda.triton.flash_attention"],
                            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        "gemm": (lambda: opsadv.ops.gemm(x, wqkv), ["cuda.cublas.gemm_small_m", "cuda.cublas.gemm",
                                                     "cuda.triton.gemm", "cuda.triton.gemm_tma"],
                 lambda: torch.matmul(x, wqkv)),
        "swiglu_gemm": (lambda: opsadv.ops.swiglu_gemm(x, wgu), ["cuda.cublas.swiglu_gemm_small_m",
                                                                 "cuda.cublas.swiglu_gemm", "cuda.triton.swiglu_gemm",
                                                                 "cuda.triton.swiglu_gemm_tma"],
                        lambda: (lambda gu: F.silu(gu[..., :inter]) * gu[..., inter:])(x @ wgu)),
        "rms_norm": (lambda: opsadv.ops.rms_norm(x, wn, 1e-6), ["cuda.triton.rms_norm", "cuda.aten.rms_norm"],
                     lambda: F.rms_norm(x, (hid,), wn, 1e-6)),
    }

    lines = []
    with torch.no_grad():
        for op, (call, impls, eager) in table.items():
            for impl in impls + ["(auto)", "(eager torch)"]:
                try:
                    if impl == "(eager torch)":
                        fn = eager
                        row = (host_us(fn), do_bench(fn, return_mode="median"), b2b(fn))
                    else:
                        pins = {} if impl == "(auto)" else {"impls": {op: impl}}
                        with opsadv.use_backend("cuda", **pins):
                            call()
                            row = (host_us(call), do_bench(call, return_mode="median"), b2b(call))
                    lines.append(f"{op:16s} {impl:34s} host {row[0]:7.1f} us  gpu {row[1] * 1e3:7.1f} us  "
                                 f"back-to-back {row[2]:7.1f} us")
                except Exception as e:  # noqa: BLE001 - an impl that refuses this shape says why
                    lines.append(f"{op:16s} {impl:34s} n/a: {type(e).__name__}: {str(e)[:150]}")
                print(lines[-1], flush=True)
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--profile")
    ap.add_argument("--split", action="store_true", help="fwd+bwd host time split across autograd's threads")
    ap.add_argument("--decode", action="store_true", help="cProfile of Llama-1.1B decode steps")
    ap.add_argument("--experiments", action="store_true", help="fwd+bwd host cost: multithreading off, stubbed variants")
    ap.add_argument("--decode-impls", action="store_true", help="host/GPU/back-to-back cost of each impl at decode shapes")
    ap.add_argument("--detail", action="store_true", help="only the per-layer partition of a LayerNorm call")
    args = ap.parse_args()
    if args.split or args.decode or args.decode_impls or args.detail or args.experiments:
        lines = ((autograd_experiments() if args.experiments else []) + (detail() if args.detail else []) + (autograd_split() if args.split else [])
                 + (decode_impls() if args.decode_impls else []) + (decode_profile() if args.decode else []))
        if args.profile:
            open(args.profile, "w").write("\n".join(lines) + "\n")
        return
    res = {"meta": {"torch": torch.__version__, "python": platform.python_version(),
                    "cpu": platform.processor() or platform.machine(), "gpu": torch.cuda.get_device_name()},
           "rows": {}}
    res["rows"].update(triton_launch_us())
    table, prof_fn = cases()
    with opsadv.use_backend("cuda"):
        for name, (ours, eager) in table.items():
            o, e = host_us(ours), host_us(eager)
            res["rows"][name] = {"opsadv_host_us": round(o, 1), "eager_host_us": round(e, 1)}
            print(f"{name:42s} opsadv {o:7.1f} us   eager {e:7.1f} us", flush=True)
        tottime = profile_text(prof_fn, 100, 35, busy_gpu=True)
        cumulative = profile_text(prof_fn, 100, 40, sort="cumulative", busy_gpu=True)
    print({k: v for k, v in res["rows"].items() if k.endswith("_us")})
    if args.profile:
        open(args.profile, "w").write(tottime + "\n\n" + cumulative)
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
