"""The persistent TMA GEMM (cuda.triton.gemm_persistent) against cuBLAS and the non-persistent TMA
kernel, in one process: BERT-base shapes (M = 12288 packed tokens: QKV, attention out, FFN1 with
exact-erf GELU, FFN2, all with bias), 8192^3 plain and the gemm suite's bias+gelu_tanh / bias+silu.

Sections, each recorded as it finishes (benchmarks/_probe_log.py: a killed run keeps what it had):
  precompile   every Triton kernel the run launches, compiled in parallel worker processes into
               Triton's disk cache (the main process then loads them; a failure there only costs time)
  timing       per shape: fp32 torch reference; each variant poisoned (NaN), run, rel err checked,
               then timed with do_bench (median; do_bench clears the L2 before every call, so inputs
               that would fit in L2 are not measured warm)
  odd          correctness only: M 1 / 127 / 1000, K and N = 8 mod 16, every epilogue, SwiGLU, backward
  impl         the registered impls as the dispatcher runs them (autotune over the profile's configs)
  dispatch     use_backend("cuda", autotune=True) at the FFN1 shape: which impl the measured choice takes
  repeat       the FFN1 best variants timed a second time (the run's noise)

    PYTHONPATH=. python benchmarks/gemm_persistent_probe.py [OUT.json] [budget_s]
PROBE_SECTIONS=odd,impl,... runs only those sections (precompile always); PROBE_SHAPES=bert_ffn1,... only
those timing shapes; PROBE_CONFIGS=table times the profile's persistent table instead of the sweep.
CPU dry run: PROBE_TINY=1 TRITON_INTERPRET=1 (tiny shapes, fp16)."""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe_log import ProbeLog, probe_setup  # noqa: E402

T0 = time.time()
EPILOGUES = {"none": (False, "none"), "bias": (True, "none"), "bias_gelu": (True, "gelu"),
             "bias_gelu_tanh": (True, "gelu_tanh"), "bias_silu": (True, "silu")}
SHAPES = [  # (name, M, N, K, epilogue); FFN1 first: the kernel this probe is for
    ("bert_ffn1", 12288, 3072, 768, "bias_gelu"),
    ("bert_qkv", 12288, 2304, 768, "bias"),
    ("bert_attn_out", 12288, 768, 768, "bias"),
    ("bert_ffn2", 12288, 768, 3072, "bias"),
    ("square", 8192, 8192, 8192, "none"),
    ("suite_gelu_tanh", 16384, 12288, 4096, "bias_gelu_tanh"),
    ("suite_silu", 16384, 11008, 4096, "bias_silu"),
]
# persistent: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per SM, EPI_SPLIT); tma: the first five
PERSISTENT = [(128, 256, 64, 8, 3, 1, True), (128, 256, 64, 8, 4, 1, True), (128, 128, 64, 8, 3, 2, True),
              (128, 128, 64, 4, 3, 2, True), (256, 128, 64, 8, 3, 1, True), (128, 128, 64, 8, 4, 1, False),
              (128, 256, 128, 8, 2, 1, True)]
TMA = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4)]
TINY = os.environ.get("PROBE_TINY") == "1"
if TINY:
    SHAPES = [("tiny_ffn1", 67, 96, 64, "bias_gelu"), ("tiny_plain", 40, 48, 40, "none")]
    PERSISTENT = [(32, 32, 32, 4, 1, 1, True), (32, 32, 32, 4, 1, 2, False)]
    TMA = [(32, 32, 32, 4, 1)]
ODD = [(1, 264, 200), (127, 200, 264), (1000, 776, 1544)]      # K, N = 8 mod 16 (TMA rows still 16-byte)
if TINY:
    ODD = [(1, 24, 40), (37, 40, 56)]
FFN1 = SHAPES[0]
if os.environ.get("PROBE_SHAPES"):
    SHAPES = [s for s in SHAPES if s[0] in os.environ["PROBE_SHAPES"].split(",")]
if os.environ.get("PROBE_CONFIGS") == "table" and not TINY:
    from opsadv.backends.cuda.gemm import CONFIGS as _C
    PERSISTENT = list(_C["h100"]["persistent"])
SECTIONS = os.environ.get("PROBE_SECTIONS", "timing,odd,impl,dispatch,repeat").split(",")
TOL = 1e-2                                                       # bf16 output vs fp32 reference


def _ctx():
    return SimpleNamespace(profile=None, options={})             # explicit configs: no profile needed


def inputs(m, n, k, ep, dev, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(m, k, device=dev, generator=g).to(dtype)
    wt = (torch.randn(n, k, device=dev, generator=g) * k ** -0.5).to(dtype).t()     # nn.Linear weight.t()
    bias = torch.randn(n, device=dev, generator=g).to(dtype) if EPILOGUES[ep][0] else None
    return a, wt, bias


def triton_fn(kernel, config, a, wt, bias, act, out):
    from opsadv.backends.cuda import gemm as G
    return lambda: G._launch(_ctx(), a, wt, out, bias, None, None, act, 1.0, False, False, kernel, config=config)


def peers(ep, a, wt, bias):
    from opsadv.backends.cuda import gemm as G
    act = EPILOGUES[ep][1]
    p = {}
    if ep == "none":
        p["torch_matmul"] = lambda: torch.matmul(a, wt)
    elif act == "none":
        p["addmm"] = lambda: torch.addmm(bias, a, wt)
    else:
        f = {"gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "silu": F.silu}[act]
        p["addmm+" + act] = lambda: f(torch.addmm(bias, a, wt))
        p["cublas_epilogue_impl"] = lambda: G._cublas_gemm(_ctx(), a, wt, bias, act, None, 1.0)
        if act.startswith("gelu") and a.is_cuda:   # cuBLASLt's fused GELU is the tanh approximation
            p["addmm_activation" + ("_tanh_approx" if act == "gelu" else "")] = \
                lambda: torch._addmm_activation(bias, a, wt, use_gelu=True)
    return p


def variants(ep, a, wt, bias, out):
    act = EPILOGUES[ep][1]
    v = {f"persistent {c}": triton_fn("persistent", c, a, wt, bias, act, out) for c in PERSISTENT}
    v.update({f"tma {c}": triton_fn("tma", c, a, wt, bias, act, out) for c in TMA})
    return v


def activate(y, act):
    return {"none": y, "relu": y.relu(), "gelu": F.gelu(y), "gelu_tanh": F.gelu(y, approximate="tanh"),
            "silu": F.silu(y)}[act]


def reference(a, wt, bias, act, alpha=1.0, res=None):
    """act(alpha a @ b + bias) + res in float32."""
    y = (a.float() @ wt.float()) * alpha
    if bias is not None:
        y += bias.float()
    y = activate(y, act)
    return y + res.float() if res is not None else y


def rel(x, ref):
    x = x.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm()).item()


def bench(fn, dev):
    if dev == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


# ---- precompile: worker processes fill Triton's disk cache ----------------------------------------
def _compile_jobs():
    """(M, N, K, epilogue, kernel, config) of every explicit-config launch in the run."""
    from opsadv.backends.cuda.gemm import CONFIGS
    shapes = SHAPES if "timing" in SECTIONS else []
    jobs = [(m, n, k, ep, "persistent", c) for _, m, n, k, ep in shapes for c in PERSISTENT]
    jobs += [(m, n, k, ep, "tma", c) for _, m, n, k, ep in shapes for c in TMA]
    # the dispatcher's autotune at FFN1 tries the profile's tables of all three Triton kernels
    m, n, k, ep = FFN1[1:]
    for kern, table in (("ptr", "gemm"), ("tma", "gemm"), ("persistent", "persistent")):
        jobs += [(m, n, k, ep, kern, c) for c in CONFIGS["h100"][table]]
    seen, out = set(), []
    for j in jobs:       # one job per compiled kernel: the first of each shape's divisibility class
        key = (j[0] % 16 == 0, j[1] % 16 == 0, j[2] % 16 == 0, j[3], j[4], j[5])
        if key not in seen:
            seen.add(key)
            out.append(j)
    return out


def _compile_one(job):
    t = time.time()
    dev, dtype = ("cpu", torch.float16) if TINY else ("cuda", torch.bfloat16)
    try:
        if job[0] == "odd":
            odd_case(job[1], dev, dtype, only=job[2])
            return job, round(time.time() - t, 1), None
        m, n, k, ep, kernel, config = job
        a, wt, bias = inputs(m, n, k, ep, dev, dtype)
        out = torch.empty(m, n, device=dev, dtype=dtype)
        triton_fn(kernel, config, a, wt, bias, EPILOGUES[ep][1], out)()
        if dev == "cuda":
            torch.cuda.synchronize()
        return job, round(time.time() - t, 1), None
    except Exception as e:  # noqa: BLE001 - the main process compiles (and reports) it again
        return job, round(time.time() - t, 1), f"{type(e).__name__}: {str(e)[:200]}"


def precompile(log: ProbeLog, timeout_s: float = float(os.environ.get("PROBE_PRECOMPILE_S", 150))):
    """A worker that dies raises BrokenProcessPool (no hang); jobs left after timeout_s are dropped
    (the main process compiles what it still needs)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    odd_jobs = [("odd", i, c) for i in range(len(ODD)) for c in range(len(odd_configs()))] if "odd" in SECTIONS else []
    jobs = odd_jobs + _compile_jobs()     # the long odd jobs first
    t = time.time()
    res, note = [], None
    ex = ProcessPoolExecutor(min(12, os.cpu_count() or 4, len(jobs)), mp_context=mp.get_context("spawn"))
    try:
        for fut in as_completed([ex.submit(_compile_one, j) for j in jobs], timeout=timeout_s):
            res.append(fut.result())
    except Exception as e:  # noqa: BLE001 - timeout or a dead worker: record and go on
        note = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        ex.shutdown(wait=note is None, cancel_futures=True)
    log.save({"section": "precompile", "jobs": len(jobs), "done": len(res), "wall_s": round(time.time() - t, 1),
              "max_job_s": max((s for _, s, _ in res), default=0), "note": note,
              "errors": {str(j): e for j, _, e in res if e}})


# ---- sections -----------------------------------------------------------------------------------
def timing(log, dev, dtype, name, m, n, k, ep, table):
    a, wt, bias = inputs(m, n, k, ep, dev, dtype)
    act = EPILOGUES[ep][1]
    ref = reference(a, wt, bias, act)
    out = torch.empty(m, n, device=dev, dtype=dtype)
    rec = {"section": "timing", "case": name, "m": m, "n": n, "k": k, "epilogue": ep, "ms": {}, "rel_err": {}}
    fl = 2.0 * m * n * k
    for vname, fn in {**peers(ep, a, wt, bias), **variants(ep, a, wt, bias, out)}.items():
        try:
            out.fill_(float("nan"))
            y = fn()
            y = out if y is None or y is out else y
            if dev == "cuda":
                torch.cuda.synchronize()
            rec["rel_err"][vname] = rel(y, ref)
            rec["ms"][vname] = bench(fn, dev)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for one config
            rec.setdefault("errors", {})[vname] = f"{type(e).__name__}: {str(e)[:160]}"
    # the best exact peer (cuBLASLt's tanh-approximated GELU computes another function at FFN1: apart)
    ok = {v: t for v, t in rec["ms"].items() if rec["rel_err"][v] < TOL}
    cub = [v for v in ok if not v.startswith(("persistent", "tma", "addmm_activation_tanh"))]
    own = [v for v in ok if v.startswith("persistent")]
    if cub and own:
        bc, bo = min(cub, key=ok.get), min(own, key=ok.get)
        rec.update(best_peer=bc, best_persistent=bo, speedup_vs_best_peer=round(ok[bc] / ok[bo], 3),
                   persistent_tflops=round(fl / ok[bo] / 1e9, 1), peer_tflops=round(fl / ok[bc] / 1e9, 1))
        tma = [v for v in ok if v.startswith("tma")]
        if tma:
            rec["speedup_vs_best_tma"] = round(min(ok[v] for v in tma) / ok[bo], 3)
    rec["failed_rel_err"] = [v for v, e in rec["rel_err"].items() if not e < TOL and "tanh_approx" not in v]
    if (name, m, n, k, ep) == FFN1 and act != "none":
        # ablation: the same GEMM with the bias epilogue only (what the activation costs each kernel)
        no_act = {"addmm (bias only)": lambda: torch.addmm(bias, a, wt)}
        no_act.update({f"{kern} {c} (bias only)": triton_fn(kern, c, a, wt, bias, "none", out)
                       for kern, c in [("persistent", c) for c in PERSISTENT[:3]] + [("tma", TMA[-1])]})
        rec["no_act_ms"] = {v: bench(f, dev) for v, f in no_act.items()}
    table.append(rec)
    log.save(rec)


def odd_configs():
    """The profile's persistent table (both store widths, whole-tile and half-tile stores)."""
    from opsadv.backends.cuda.gemm import CONFIGS
    return CONFIGS["h100"]["persistent"][:3] if not TINY else PERSISTENT


def odd_case(i, dev, dtype, only: int | None = None) -> dict:
    """ODD[i]: every epilogue through the persistent kernel (odd_configs(), or only the one numbered
    `only`), then (only in None or 0) SwiGLU and the gelu backward through the impls' functions;
    NaN-poisoned outputs."""
    from opsadv.backends.cuda import gemm as G
    cfgs = odd_configs() if only is None else [odd_configs()[only]]
    errs = {}
    m, k, n = ODD[i]
    g = torch.Generator(device=dev).manual_seed(100 + i)
    a = torch.randn(m, k, device=dev, generator=g).to(dtype)
    wt = torch.randn(n, k, device=dev, generator=g).to(dtype).t() if i % 2 == 0 else \
        torch.randn(k, n, device=dev, generator=g).to(dtype)                     # (N, K) rows and (K, N)
    bias = torch.randn(n, device=dev, generator=g).to(dtype)
    res = torch.randn(m, n, device=dev, generator=g).to(dtype)
    for j, act in enumerate(("none", "relu", "gelu", "gelu_tanh", "silu")):
        bb, rr, alpha = (bias if j != 1 else None), (res if j % 2 == 0 else None), (0.5 if j == 3 else 1.0)
        ref = reference(a, wt, bb, act, alpha, rr)
        for c in cfgs:
            key = f"m{m} k{k} n{n} {act} bias={bb is not None} res={rr is not None} alpha={alpha} {c}"
            out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
            try:       # a config can exceed shared memory for one epilogue (the autotuner drops those)
                G._launch(_ctx(), a, wt, out, bb, rr, None, act, alpha, False, False, "persistent", config=c)
                errs[key] = rel(out, ref)
            except Exception as e:  # noqa: BLE001 - recorded; the other cases still run
                errs[key] = f"{type(e).__name__}: {str(e)[:100]}"
    if only not in (None, 0):
        return errs
    w = torch.randn(k, 2 * n, device=dev, generator=g).to(dtype)
    sb = torch.randn(2 * n, device=dev, generator=g).to(dtype)
    gu = a.float() @ w.float() + sb.float()
    errs[f"swiglu m{m} k{k} n{n}"] = rel(G._triton_swiglu(_ctx(), a, w, sb, kernel="persistent"),
                                         F.silu(gu[:, :n]) * gu[:, n:])
    go = torch.randn(m, n, device=dev, generator=g).to(dtype)
    da, db, dbias = G._triton_gemm_bwd(_ctx(), go, a, wt, bias, "gelu", 1.0, kernel=G.BACKWARD_KERNEL["persistent"])
    af, wf = a.float().requires_grad_(), wt.float().requires_grad_()
    gra, grw = torch.autograd.grad(F.gelu(af @ wf + bias.float()), (af, wf), go.float())
    errs[f"bwd gelu m{m} k{k} n{n} da"] = rel(da, gra)
    errs[f"bwd gelu m{m} k{k} n{n} db"] = rel(db, grw)
    return errs


def odd(log, dev, dtype):
    os.environ["OPSADV_POISON_OUTPUTS"] = "1"          # the impls' own output buffers start as NaN
    try:
        errs = {kk: e for i in range(len(ODD)) for kk, e in odd_case(i, dev, dtype).items()}
    finally:
        os.environ.pop("OPSADV_POISON_OUTPUTS", None)
    nums = [e for e in errs.values() if isinstance(e, float)]
    log.save({"section": "odd", "rel_err": errs, "max_rel_err": max(nums, default=None),
              "failed": [kk for kk, e in errs.items() if isinstance(e, float) and not e < TOL],
              "launch_errors": [kk for kk, e in errs.items() if isinstance(e, str)]})


def impl_timing(log, dev, dtype):
    """The registered impls at FFN1 as the dispatcher runs them (profile h100: Triton autotune over the
    profile's table; host work per call included)."""
    import opsadv
    from opsadv.core import dispatch
    from opsadv.core.ops.gemm import _gemm_spec
    from opsadv.registry import get_registry
    name, m, n, k, ep = FFN1
    a, wt, bias = inputs(m, n, k, ep, dev, dtype)
    act = EPILOGUES[ep][1]
    ref = reference(a, wt, bias, act)
    spec = _gemm_spec(a, wt, bias, act, None, 1.0, False)
    with opsadv.use_backend("cuda"):
        exp, r = dispatch.explain_spec(spec)
    rec = {"section": "impl", "case": name, "default_choice": exp.chosen, "default_why": exp.why, "ms": {},
           "rel_err": {}, "accepted": [c.impl.id for c in exp.candidates if c.accepted]}
    for impl in get_registry().impls_by_op["gemm"]:
        if impl.id not in rec["accepted"]:
            continue
        fn = lambda impl=impl: impl.fn(r.ctx, a, wt, bias, act, None, 1.0)  # noqa: E731
        try:
            rec["rel_err"][impl.id] = rel(fn(), ref)
            rec["ms"][impl.id] = bench(fn, dev)
        except Exception as e:  # noqa: BLE001
            rec.setdefault("errors", {})[impl.id] = f"{type(e).__name__}: {str(e)[:160]}"
    if dev == "cuda" and r.ctx.profile is not None:      # the config Triton's autotuner took per key
        from opsadv.backends.cuda import gemm as G
        at = G._autotuned("persistent", r.ctx.profile.name, "persistent", G._tile_cap(r.ctx))
        rec["persistent_autotune"] = {str(kk): str(v) for kk, v in at.cache.items()}
        rec["persistent_autotune_ms"] = {str(c): v for c, v in getattr(at, "configs_timings", {}).items()} \
            if getattr(at, "configs_timings", None) else None
    log.save(rec)


def dispatch_choice(log, dev, dtype):
    """What use_backend(autotune=True) measures and picks at FFN1 (fresh tuning cache)."""
    import tempfile

    import opsadv
    from opsadv.core import dispatch, tuning
    name, m, n, k, ep = FFN1
    a, wt, bias = inputs(m, n, k, ep, dev, dtype, seed=1)
    os.environ["OPSADV_CACHE_DIR"] = tempfile.mkdtemp(prefix="opsadv-tune-")
    tuning.reload()
    dispatch.clear_cache()
    with opsadv.use_backend("cuda", autotune=True), torch.no_grad():
        y = opsadv.ops.gemm(a, wt, bias=bias, activation="gelu")
        exp = opsadv.explain("gemm", a, wt, bias=bias, activation="gelu")
    log.save({"section": "dispatch", "case": name, "chosen": exp.chosen, "why": exp.why,
              "rel_err": rel(y, reference(a, wt, bias, "gelu"))})


def repeat(log, dev, dtype, table):
    rec0 = next((r for r in table if r["case"] == FFN1[0]), None)
    if not rec0 or "best_persistent" not in rec0:
        return
    name, m, n, k, ep = FFN1
    a, wt, bias = inputs(m, n, k, ep, dev, dtype)
    out = torch.empty(m, n, device=dev, dtype=dtype)
    fns = {**peers(ep, a, wt, bias), **variants(ep, a, wt, bias, out)}
    again = {v: bench(fns[v], dev) for v in sorted(set([rec0["best_peer"], rec0["best_persistent"]] +
                                                      [v for v in fns if v.startswith("tma")]))}
    log.save({"section": "repeat", "case": name, "ms": again, "first_ms": {v: rec0["ms"][v] for v in again}})


def main():
    out, budget, tiny, dev, dtype, meta = probe_setup("gemm_persistent_probe.json", 280.0)
    if dev == "cuda":
        meta["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    log = ProbeLog(out, budget, meta, t0=T0)
    log.guarded("precompile", lambda: precompile(log), need=60)
    table: list[dict] = []
    for name, m, n, k, ep in SHAPES if "timing" in SECTIONS else []:
        log.guarded("timing " + name, lambda a=(name, m, n, k, ep): timing(log, dev, dtype, *a, table), need=12)
    if "odd" in SECTIONS:
        log.guarded("odd", lambda: odd(log, dev, dtype), need=10)
    if "impl" in SECTIONS:
        log.guarded("impl", lambda: impl_timing(log, dev, dtype), need=8)
    if dev == "cuda" and "dispatch" in SECTIONS:
        log.guarded("dispatch", lambda: dispatch_choice(log, dev, dtype), need=8)
    if "repeat" in SECTIONS:
        log.guarded("repeat", lambda: repeat(log, dev, dtype, table), need=6)
    print(f"\n{'case':16s} {'variant':40s} {'ms':>9s} {'TFLOP/s':>8s} {'rel_err':>8s}")
    for r in table:
        fl = 2.0 * r["m"] * r["n"] * r["k"]
        for v, t in sorted(r["ms"].items(), key=lambda kv: kv[1]):
            print(f"{r['case']:16s} {v:40s} {t:9.4f} {fl / t / 1e9:8.1f} {r['rel_err'][v]:8.1e}")
        if "speedup_vs_best_peer" in r:
            print(f"{r['case']:16s} persistent/best peer: {r['speedup_vs_best_peer']}x "
                  f"({r['best_persistent']} vs {r['best_peer']})")
    print(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
