"""One-shot GPU probe for the cuda backend's gemm / swiglu_gemm / layer_norm / rms_norm kernels:
correctness on the device (bf16 and fp16, odd shapes, backward) and timings of the library's own
kernels against cuBLAS (mm, addmm + activation, _addmm_activation), F.layer_norm / F.rms_norm and
torch.compile on the BENCHMARKS.md shapes.  Writes $OUT/gemm_norm_probe.json after every section,
so a run cut short still reports what it measured.

  PYTHONPATH=. python3 benchmarks/gemm_norm_probe.py [--budget SECONDS]      # on a GPU
  TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/gemm_norm_probe.py --tiny   # CPU smoke test"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

ap = argparse.ArgumentParser()
ap.add_argument("--tiny", action="store_true", help="tiny shapes under the interpreter (CPU smoke test)")
ap.add_argument("--budget", type=float, default=200.0, help="seconds; optional sections are skipped after it")
ARGS = ap.parse_args()
if ARGS.tiny:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import opsadv  # noqa: E402
from opsadv.core import dispatch  # noqa: E402
from opsadv.core.ops.gemm import _gemm_spec, _swiglu_spec  # noqa: E402
from opsadv.registry import get_registry  # noqa: E402

T0 = time.time()
DEV = "cpu" if ARGS.tiny else "cuda"
OUT = os.environ.get("OUT", "/tmp")
RESULT: dict = {"sections": {}, "errors": []}


def elapsed() -> float:
    return time.time() - T0


def save() -> None:
    RESULT["elapsed_s"] = round(elapsed(), 1)
    with open(os.path.join(OUT, "gemm_norm_probe.json"), "w") as f:
        json.dump(RESULT, f, indent=1)


def section(name):
    def deco(fn):
        def run():
            print(f"== {name} (t={elapsed():.0f}s)", flush=True)
            try:
                RESULT["sections"][name] = fn()
            except Exception as e:
                RESULT["errors"].append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
                print(RESULT["errors"][-1], flush=True)
            save()
        return run
    return deco


def bench(fn) -> float:
    if DEV == "cpu":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def impl(impl_id):
    return next(i for op in ("gemm", "swiglu_gemm", "layer_norm", "rms_norm")
                for i in get_registry().impls_by_op[op] if i.id == impl_id)


def ctx_for(spec, fixed=False):
    """The cuda backend's context; fixed=True: the profile's first config, no Triton autotune
    (correctness checks compile one config per variant instead of the whole space)."""
    with opsadv.use_backend("cuda", precision="tf32"):
        exp, r = dispatch.explain_spec(spec)
    prof = dataclasses.replace(r.ctx.profile, autotune=False) if fixed and r.ctx.profile else r.ctx.profile
    return dataclasses.replace(r.ctx, spec=spec, profile=prof)


def ref_gemm(a, b, bias, act, res, alpha):
    z = alpha * (a.double() @ b.double()) + (bias.double() if bias is not None else 0)
    y = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
         "silu": F.silu}[act](z)
    return y + (res.double() if res is not None else 0)


GEMM_IMPLS = ["cuda.triton.gemm", "cuda.triton.gemm_tma", "cuda.cublas.gemm_epilogue"]
SWIGLU_IMPLS = ["cuda.triton.swiglu_gemm", "cuda.triton.swiglu_gemm_tma", "cuda.cublas.swiglu_gemm"]


@section("env")
def env():
    import triton
    d = {"torch": torch.__version__, "triton": triton.__version__, "device": DEV}
    if DEV == "cuda":
        d.update(name=torch.cuda.get_device_name(), cc=torch.cuda.get_device_capability())
    with opsadv.use_backend("cuda"):
        d["profile"] = str(opsadv.explain("gemm", torch.randn(4, 8, device=DEV, dtype=torch.float16),
                                           torch.randn(8, 8, device=DEV, dtype=torch.float16)))
    return d


@section("correctness")
def correctness():
    out = {}
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
    all_acts = ("none", "relu", "gelu", "gelu_tanh", "silu")
    bf, hf = torch.bfloat16, torch.float16
    # (dtype, (m, k, n), activations, with backward, with swiglu): few combos, each a compile per impl
    combos = [(hf, (1, 40, 24), all_acts, True, True), (hf, (17, 70, 33), ("gelu_tanh",), True, True)] if ARGS.tiny \
        else [(bf, (1, 4096, 4096), ("none", "silu"), False, True), (bf, (7, 1024, 3000), ("gelu_tanh",), True, False),
              (bf, (300, 520, 264), all_acts, True, True), (bf, (1000, 2048, 1536), ("none", "gelu_tanh"), False, False),
              (hf, (300, 520, 264), ("silu",), True, False)]
    torch.manual_seed(0)
    for dt, (m, k, n), acts, do_bwd, do_swiglu in combos:
        a = torch.randn(2, m, k, device=DEV, dtype=dt)
        b = (torch.randn(n, k, device=DEV, dtype=dt) * k ** -0.5).t()
        bias = torch.randn(n, device=DEV, dtype=dt)
        res = torch.randn(2, m, n, device=DEV, dtype=dt)
        for iid in GEMM_IMPLS:
            kim = impl(iid)
            for act in acts:
                spec = _gemm_spec(a, b, bias, act, res, 0.5, False)
                if kim.rejection_reasons(spec, get_registry().env, experimental_ok=False, deterministic=False):
                    continue
                c = ctx_for(spec, fixed=True)
                e_f = rel(kim.fn(c, a, b, bias, act, res, 0.5), ref_gemm(a, b, bias, act, res, 0.5))
                e_b = 0.0
                if do_bwd:
                    da, db, dbias = kim.backward(c, res, a, b, bias, act, 0.5)
                    ad, bd, biasd = (t.double().requires_grad_() for t in (a, b, bias))
                    rg = torch.autograd.grad(ref_gemm(ad, bd, biasd, act, None, 0.5), (ad, bd, biasd), res.double())
                    e_b = max(rel(g, r) for g, r in zip((da, db, dbias), rg))
                key = f"{iid} {str(dt)[6:]} m{m} k{k} n{n} {act}"
                out[key] = {"fwd": e_f, "bwd": e_b, "ok": e_f < tol[dt] and e_b < 2 * tol[dt]}
        if not do_swiglu:
            continue
        w = (torch.randn(k, 2 * n, device=DEV, dtype=dt) * k ** -0.5)
        wb = torch.randn(2 * n, device=DEV, dtype=dt)
        go = torch.randn(2, m, n, device=DEV, dtype=dt)
        for iid in SWIGLU_IMPLS:
            kim = impl(iid)
            spec = _swiglu_spec(a, w, wb, False)
            if kim.rejection_reasons(spec, get_registry().env, experimental_ok=False, deterministic=False):
                continue
            c = ctx_for(spec, fixed=True)
            xd, wd, bd = (t.double().requires_grad_() for t in (a, w, wb))
            g_, u_ = (xd @ wd + bd).chunk(2, -1)
            ref = F.silu(g_) * u_
            rg = torch.autograd.grad(ref, (xd, wd, bd), go.double())
            e_f = rel(kim.fn(c, a, w, wb), ref)
            e_b = max(rel(g, r) for g, r in zip(kim.backward(c, go, a, w, wb), rg))
            out[f"{iid} {str(dt)[6:]} m{m} k{k} n{n}"] = {"fwd": e_f, "bwd": e_b,
                                                          "ok": e_f < tol[dt] and e_b < 2 * tol[dt]}
    # norms through the dispatcher (forward + backward, residual, offset, non-contiguous)
    hs = [64, 100] if ARGS.tiny else [64, 1000, 4096, 12288, 65536]
    for dt, h in [(hf, hh) for hh in hs] if ARGS.tiny else [(bf, hh) for hh in hs] + [(hf, 4096)]:
        for op in ("layer_norm", "rms_norm"):
            for resid in (False, True):
                rows = 3 if h >= 65536 else 129
                x = torch.randn(rows, 2 * h, device=DEV, dtype=dt)[:, ::2].requires_grad_() if not resid else \
                    torch.randn(rows, h, device=DEV, dtype=dt).requires_grad_()
                r = torch.randn(rows, h, device=DEV, dtype=dt).requires_grad_() if resid else None
                w = (1 + 0.1 * torch.randn(h, device=DEV, dtype=dt)).requires_grad_()
                b = torch.randn(h, device=DEV, dtype=dt).requires_grad_() if op == "layer_norm" else None
                gy = torch.randn(rows, h, device=DEV, dtype=dt)

                def f(x, r, w, b, be, op=op, resid=resid):
                    with opsadv.use_backend(be):
                        if op == "layer_norm":
                            o = opsadv.ops.layer_norm(x, w, b, residual=r)
                        else:
                            o = opsadv.ops.rms_norm(x, w, residual=r, offset=1.0)
                    y = o[0] if resid else o
                    ins = [t for t in (x, r, w, b) if t is not None]
                    loss = (y * gy.to(y.dtype)).sum() + ((o[1] * gy.to(y.dtype)).sum() if resid else 0)
                    return y, torch.autograd.grad(loss, ins)
                y, g = f(x, r, w, b, "cuda")
                dd = [t.detach().double().requires_grad_() if t is not None else None for t in (x, r, w, b)]
                yr, gr = f(*dd, "reference")
                e_f, e_b = rel(y, yr), max(rel(u, v) for u, v in zip(g, gr))
                out[f"{op} {str(dt)[6:]} h{h} {'residual' if resid else 'noncontig'}"] = {
                    "fwd": e_f, "bwd": e_b, "ok": e_f < tol[dt] and e_b < 3 * tol[dt]}
    bad = [k for k, v in out.items() if not v["ok"]]
    print(f"correctness: {len(out)} checks, {len(bad)} bad: {bad[:10]}", flush=True)
    return {"checks": out, "bad": bad}


NORM_SHAPES = [(64, 256), (33, 100)] if ARGS.tiny else [(32768, 4096), (16384, 8192), (65536, 1024)]


@section("norm_timing")
def norm_timing():
    from opsadv.backends.cuda import norm as N
    from opsadv.bench.suite_norm import bytes_moved
    res = {}
    dt = torch.float16 if ARGS.tiny else torch.bfloat16
    for t, h in NORM_SHAPES:
        x = torch.randn(t, h, device=DEV, dtype=dt)
        r = torch.randn(t, h, device=DEV, dtype=dt)
        w = 1 + 0.1 * torch.randn(h, device=DEV, dtype=dt)
        b = 0.1 * torch.randn(h, device=DEV, dtype=dt)
        gy = torch.randn(t, h, device=DEV, dtype=dt)
        for op in ("layer_norm", "rms_norm"):
            ln = op == "layer_norm"
            for resid in (False, True):
                row = {}
                rr = r if resid else None

                def mine():
                    with torch.no_grad():
                        return (opsadv.ops.layer_norm(x, w, b, residual=rr) if ln else opsadv.ops.rms_norm(x, w, residual=rr))

                def eager():
                    s = x + r if resid else x
                    return F.layer_norm(s, (h,), w, b, 1e-5) if ln else F.rms_norm(s, (h,), w, 1e-6)
                with opsadv.use_backend("cuda"):
                    row["own_ms"] = bench(mine)
                row["eager_ms"] = bench(eager)
                nb = bytes_moved(op, t, h, resid, False)
                row["own_TBs"] = nb / row["own_ms"] / 1e9
                row["speedup_eager"] = row["eager_ms"] / row["own_ms"]
                # forward + backward
                xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                bg = b.clone().requires_grad_() if ln else None
                rg = r.clone().requires_grad_() if resid else None
                ins = [q for q in (xg, rg, wg, bg) if q is not None]

                def fb(use_mine):
                    if use_mine:
                        o = opsadv.ops.layer_norm(xg, wg, bg, residual=rg) if ln else opsadv.ops.rms_norm(xg, wg, residual=rg)
                    else:
                        s = xg + rg if resid else xg
                        o = F.layer_norm(s, (h,), wg, bg, 1e-5) if ln else F.rms_norm(s, (h,), wg, 1e-6)
                        o = (o, s) if resid else o
                    outs = (o[0], o[1]) if resid else (o,)
                    return torch.autograd.grad(outs, ins, (gy,) * len(outs))
                with opsadv.use_backend("cuda"):
                    row["own_fb_ms"] = bench(lambda: fb(True))
                    got = fb(True)
                row["eager_fb_ms"] = bench(lambda: fb(False))
                want = fb(False)
                row["fb_rel_err"] = max(rel(u, v) for u, v in zip(got, want))
                row["speedup_fb_eager"] = row["eager_fb_ms"] / row["own_fb_ms"]
                row["own_fb_TBs"] = bytes_moved(op, t, h, resid, True) / row["own_fb_ms"] / 1e9
                res[f"{op} t{t} h{h}{' residual' if resid else ''}"] = row
                print(op, t, h, resid, {k: round(v, 4) for k, v in row.items()}, flush=True)
    # forward config sweep at the first shape (rows per program x warps), to tune fwd_config
    t, h = NORM_SHAPES[0]
    x = torch.randn(t, h, device=DEV, dtype=dt)
    w = torch.randn(h, device=DEV, dtype=dt)
    sweep = {}
    orig = N.fwd_candidates      # the forward tunes among fwd_candidates(n): one candidate pins the tile
    block = N._next_pow2(h)
    for rows in (1, 2, 4):
        for warps in ((2, 4) if ARGS.tiny else (4, 8, 16, 32)):
            N.fwd_candidates = lambda n, rows=rows, warps=warps: ((rows, warps, False, 0),)
            try:
                with opsadv.use_backend("cuda"), torch.no_grad():
                    ms = bench(lambda: opsadv.ops.rms_norm(x, w))
                sweep[f"rows{rows} warps{warps}"] = bytes_moved("rms_norm", t, h, False, False) / ms / 1e9
            except Exception as e:
                sweep[f"rows{rows} warps{warps}"] = f"{type(e).__name__}"
    N.fwd_candidates = orig
    res["rms_fwd_config_sweep_TBs"] = {"block": block, **sweep}
    print("sweep", sweep, flush=True)
    return res


GEMM_SHAPES = [(64, 48, 40), (3, 40, 24)] if ARGS.tiny else \
    [(8192, 8192, 8192), (16384, 12288, 4096), (16384, 11008, 4096), (16384, 4096, 11008), (8, 4096, 4096)]


@section("gemm_timing")
def gemm_timing():
    res = {}
    dt = torch.float16 if ARGS.tiny else torch.bfloat16
    for m, n, k in GEMM_SHAPES:
        if elapsed() > ARGS.budget * 0.8:
            res["skipped_after"] = f"{m}x{n}x{k}"
            break
        a = torch.randn(m, k, device=DEV, dtype=dt)
        wt = (torch.randn(n, k, device=DEV, dtype=dt) * k ** -0.5).t()
        bias = torch.randn(n, device=DEV, dtype=dt)
        w2 = (torch.randn(2 * n, k, device=DEV, dtype=dt) * k ** -0.5).t()
        for ep in ("none", "gelu_tanh", "silu", "swiglu"):
            row = {}
            fl = 2.0 * m * n * k * (2 if ep == "swiglu" else 1)
            bb = None if ep in ("none", "swiglu") else bias
            act = "none" if ep == "swiglu" else ep
            with torch.no_grad():
                if ep == "swiglu":
                    def eager():
                        g, u = (a @ w2).chunk(2, -1)
                        return F.silu(g) * u
                    row["cublas_mm_only_ms"] = bench(lambda: a @ w2)
                elif ep == "none":
                    eager = lambda: a @ wt  # noqa: E731
                else:
                    eager = (lambda: F.gelu(torch.addmm(bias, a, wt), approximate="tanh")) if ep == "gelu_tanh" else \
                        (lambda: F.silu(torch.addmm(bias, a, wt)))
                    row["cublas_mm_only_ms"] = bench(lambda: torch.addmm(bias, a, wt))
                row["eager_ms"] = bench(eager)
                if ep == "gelu_tanh":
                    row["addmm_activation_ms"] = bench(lambda: torch._addmm_activation(bias, a, wt, use_gelu=True))
                want = eager()
                for iid in (SWIGLU_IMPLS[:2] if ep == "swiglu" else GEMM_IMPLS[:2]):
                    kim = impl(iid)
                    spec = _swiglu_spec(a, w2, None, False) if ep == "swiglu" else _gemm_spec(a, wt, bb, act, None, 1.0, False)
                    why = kim.rejection_reasons(spec, get_registry().env, experimental_ok=False, deterministic=False)
                    if why:
                        row[iid] = "rejected: " + "; ".join(why)
                        continue
                    c = ctx_for(spec)
                    fn = (lambda: kim.fn(c, a, w2, None)) if ep == "swiglu" else (lambda: kim.fn(c, a, wt, bb, act, None, 1.0))
                    got = fn()                        # first call autotunes
                    row[iid + "_rel_err"] = rel(got, want)
                    row[iid + "_ms"] = bench(fn)
                    row[iid + "_TFLOPs"] = fl / row[iid + "_ms"] / 1e9
                    if DEV == "cuda" and not ARGS.tiny:
                        try:
                            kern = _best_config(iid, m, ep)
                            if kern:
                                row[iid + "_config"] = kern
                        except Exception as e:  # informational only
                            row[iid + "_config"] = f"{type(e).__name__}"
            own = [v for kk, v in row.items() if kk.startswith("cuda.triton") and kk.endswith("_ms")]
            peers = [row["eager_ms"]] + ([row["addmm_activation_ms"]] if "addmm_activation_ms" in row else [])
            if own:
                row["best_own_ms"] = min(own)
                row["speedup_vs_best_peer"] = min(peers) / min(own)
            res[f"m{m} n{n} k{k} {ep}"] = row
            print(m, n, k, ep, {kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
            save_partial("gemm_timing", res)
    return res


def _best_config(iid, m, ep):
    from opsadv.backends.cuda import gemm as G
    tma = iid.endswith("_tma")
    kind = "small" if m <= 64 else ("swiglu" if ep == "swiglu" else "gemm")
    tuner = G._autotuned("tma" if tma else "ptr", "h100", kind)
    return {str(k): str(v) for k, v in tuner.cache.items()}


def save_partial(name, res):
    RESULT["sections"][name] = res
    save()


@section("gemm_backward_timing")
def gemm_backward_timing():
    res = {}
    dt = torch.float16 if ARGS.tiny else torch.bfloat16
    m, n, k = (64, 48, 40) if ARGS.tiny else (16384, 12288, 4096)
    a = torch.randn(m, k, device=DEV, dtype=dt, requires_grad=True)
    wt = (torch.randn(n, k, device=DEV, dtype=dt) * k ** -0.5).t().detach().requires_grad_()
    bias = torch.randn(n, device=DEV, dtype=dt, requires_grad=True)
    go = torch.randn(m, n, device=DEV, dtype=dt)
    eager = lambda: torch.autograd.grad(F.gelu(torch.addmm(bias, a, wt), approximate="tanh"), (a, wt, bias), go)  # noqa: E731
    res["eager_ms"] = bench(eager)
    for iid in ("cuda.triton.gemm", "cuda.triton.gemm_tma", "cuda.cublas.gemm_epilogue"):
        kim = impl(iid)
        spec = _gemm_spec(a, wt, bias, "gelu_tanh", None, 1.0, True)
        c = ctx_for(spec)
        fn = lambda: kim.backward(c, go, a.detach(), wt.detach(), bias.detach(), "gelu_tanh", 1.0)  # noqa: E731
        got, want = fn(), eager()
        res[iid + "_bwd_ms"] = bench(fn)
        res[iid + "_rel_err"] = max(rel(u, v) for u, v in zip(got, want))
    print(res, flush=True)
    return res


@section("dispatch_autotune")
def dispatch_autotune():
    """The dispatcher's measured choice per bucket (use_backend(..., autotune=True))."""
    res = {}
    dt = torch.float16 if ARGS.tiny else torch.bfloat16
    m, n, k = (64, 48, 40) if ARGS.tiny else (16384, 12288, 4096)
    a = torch.randn(m, k, device=DEV, dtype=dt)
    wt = (torch.randn(n, k, device=DEV, dtype=dt) * k ** -0.5).t()
    bias = torch.randn(n, device=DEV, dtype=dt)
    with opsadv.use_backend("cuda", autotune=True), torch.no_grad():
        for act, bb in (("none", None), ("gelu_tanh", bias), ("silu", bias)):
            opsadv.ops.gemm(a, wt, bias=bb, activation=act)
            res[act] = opsadv.explain("gemm", a, wt, bias=bb, activation=act).why
    print(res, flush=True)
    return res


@section("torch_compile_peers")
def torch_compile_peers():
    if ARGS.tiny or elapsed() > ARGS.budget * 0.85:
        return {"skipped": "tiny mode" if ARGS.tiny else f"out of time at {elapsed():.0f}s"}
    res = {}
    dt = torch.bfloat16
    m, n, k = 16384, 12288, 4096
    a = torch.randn(m, k, device=DEV, dtype=dt)
    wt = (torch.randn(n, k, device=DEV, dtype=dt) * k ** -0.5).t()
    bias = torch.randn(n, device=DEV, dtype=dt)
    with torch.no_grad():
        f = torch.compile(lambda a, w, b: F.gelu(torch.addmm(b, a, w), approximate="tanh"), dynamic=False)
        f(a, wt, bias)
        res[f"gemm m{m} n{n} k{k} gelu_tanh"] = bench(lambda: f(a, wt, bias))
        print(res, flush=True)
        save_partial("torch_compile_peers", res)
        for h, t in ((4096, 32768),):
            if elapsed() > ARGS.budget:
                break
            x = torch.randn(t, h, device=DEV, dtype=dt)
            r = torch.randn(t, h, device=DEV, dtype=dt)
            w = torch.randn(h, device=DEV, dtype=dt)
            g = torch.compile(lambda x, r, w: F.rms_norm(x + r, (x.shape[-1],), w, 1e-6), dynamic=False)
            g(x, r, w)
            res[f"rms_norm t{t} h{h} residual"] = bench(lambda: g(x, r, w))
            save_partial("torch_compile_peers", res)
            if elapsed() > ARGS.budget:
                break
            lnc = torch.compile(lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None, 1e-5), dynamic=False)
            lnc(x, w)
            res[f"layer_norm t{t} h{h}"] = bench(lambda: lnc(x, w))
            if elapsed() > ARGS.budget:
                break
            w2 = (torch.randn(2 * 11008, 4096, device=DEV, dtype=dt) * 0.015).t()
            a2 = torch.randn(16384, 4096, device=DEV, dtype=dt)

            def sw(a, w):
                gg, uu = (a @ w).chunk(2, -1)
                return F.silu(gg) * uu
            swc = torch.compile(sw, dynamic=False)
            swc(a2, w2)
            res["swiglu m16384 n11008 k4096"] = bench(lambda: swc(a2, w2))
    print(res, flush=True)
    return res


if __name__ == "__main__":
    for s in (env, correctness, norm_timing, gemm_timing, gemm_backward_timing, dispatch_autotune,
              torch_compile_peers):
        s()
    print(f"done in {elapsed():.0f}s; wrote {os.path.join(OUT, 'gemm_norm_probe.json')}", flush=True)
    sys.exit(0)
