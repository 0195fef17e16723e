"""GPU check + timing of the Gluon block-sparse forward (impl cuda.gluon.sparse_attention, issue #5).

  PYTHONPATH=. python benchmarks/gluon_fa/sparse_probe.py OUT.json [--quick] [--variants=default,pingpong,...]

1. Checks (NaN-poisoned outputs): out and lse of the Gluon forward against float32 masked softmax
   attention of the layout's dense mask (small shapes), and against the Triton sparse forward at the
   bench shape; forward + backward through opsadv.ops.sparse_attention pinned to the impl (the backward
   is the Triton one from out + lse).  Every kernel schedule of gluon_sparse.VARIANTS ("default" = the
   measured one; "pingpong", "pingpong_kv", "st3", "pingpong_st3", "q1": added for issue #5, never
   run on a GPU before this probe), each with both grids (persistent / one item per CTA).
2. Timing (do_bench median, launch only): s=16384 causal sliding window 1024 d128 bf16 b1 h32: Gluon
   (every variant that passed its checks, both grids; "gluon" / "gluon_nonpersistent" are the default
   schedule, "gluon_<variant>[_nonpersistent]" the others), the Triton sparse impl, compiled
   FlexAttention with the same block mask; a density sweep (windows 128 .. 8192); the dense references
   (Triton flash causal, the suite's "[own]" case, and SDPA cuDNN).  Work as the bench suite counts it:
   computed tiles of the Triton forward's tile grid (also reported at the Gluon kernel's 128 x 128 grid).
The st3 variants are checked at d128 only (at d64 they would only shorten the 4-stage ring).  About 50
kernel compiles for all 6 variants: when one call risks a 10-minute limit, split it, e.g.
--variants=default,pingpong,pingpong_kv then --variants=st3,pingpong_st3,q1 (each JSON is complete on
its own).
A variant that fails a check is not timed; a timed output that differs from the Triton one (rel err
>= 2e-2) is a failure too (logged FAIL, not timed).  The JSON is saved after every check block and
every timing row.  Exit 1 when any check failed."""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

os.environ.setdefault("OPSADV_POISON_OUTPUTS", "1")

import opsadv  # noqa: E402
from opsadv import SparseLayout  # noqa: E402
from opsadv.backends.cuda import gluon_sparse as GS  # noqa: E402

DEV = "cuda"
TRITON_ID = "cuda.triton.sparse_attention"
T0 = time.time()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ref_fwd(q, k, v, layout, scale):
    """float32 attention under the layout's dense mask; rows with no key -> 0, lse -inf."""
    b, hq, sq, d = q.shape
    g = hq // k.shape[1]
    kf = k.float().repeat_interleave(g, 1)
    vf = v.float().repeat_interleave(g, 1)
    mask = layout.dense_mask(device=q.device)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None].masked_fill(torch.isneginf(lse[..., None]), 0))
    p = p.masked_fill(~mask, 0)
    return p @ vf, lse


def gluon_fwd(q, k, v, layout, scale, persistent=True, variant="default"):
    return GS.sparse_fwd(None, q, k, v, layout.block_mask, layout.key_padding_mask, layout.cu_seqlens,
                         layout.block_size, layout.causal, layout.window_left, layout.window_right,
                         layout.num_global, scale, variant={**GS.VARIANTS[variant], "persistent": persistent})


def tag(variant, persistent):
    """Timing key: "gluon" / "gluon_nonpersistent" for the default schedule (the names of earlier runs)."""
    base = "gluon" if variant == "default" else f"gluon_{variant}"
    return base if persistent else f"{base}_nonpersistent"


VARIANTS = list(GS.VARIANTS)


def check_lse(lse, rl):
    empty = torch.isneginf(rl)
    same_empty = torch.equal(torch.isneginf(lse), empty)
    err = (lse[~empty] - rl[~empty]).abs().max().item() if (~empty).any() else 0.0
    return same_empty, err


def layouts():
    """(name, layout, b, hq, hkv, d, dtype, bshd)"""
    g = torch.Generator().manual_seed(3)
    kpm = torch.rand(2, 500, generator=g) < 0.8
    kpm[1, 300:] = False
    bm = torch.rand(2, 1, 8, 10, generator=g) < 0.4
    return [
        ("window_causal_odd", SparseLayout.sliding_window(1000, 300, causal=True, block_size=128, device=DEV),
         1, 4, 2, 128, torch.bfloat16, False),
        ("window_causal_d64_fp16", SparseLayout.sliding_window(777, 129, causal=True, block_size=64, device=DEV),
         2, 2, 1, 64, torch.float16, False),
        ("causal_dense", SparseLayout.dense(1000, causal=True, block_size=128, device=DEV),
         1, 3, 3, 128, torch.bfloat16, False),
        ("bigbird_blockmask", SparseLayout.bigbird(1000, block_size=64, heads=4, random_blocks=1, causal=False,
                                                   device=DEV), 1, 4, 4, 128, torch.bfloat16, False),
        ("blockmask_batch_bs100", SparseLayout.from_block_mask(bm.to(DEV), block_size=100, seq_q=777, seq_k=1000),
         2, 2, 2, 64, torch.bfloat16, False),
        ("padding_causal", SparseLayout.from_padding_mask(kpm.to(DEV), causal=True, block_size=128),
         2, 4, 2, 128, torch.bfloat16, False),
        ("global_window", SparseLayout.global_tokens(900, 64, window=200, causal=False, block_size=128, device=DEV),
         1, 2, 2, 128, torch.bfloat16, False),
        ("window_cross", SparseLayout.sliding_window(300, (7, 211), causal=False, seq_k=700, block_size=32,
                                                     device=DEV), 1, 2, 2, 128, torch.float16, False),
        ("causal_sq_gt_sk_empty_rows", SparseLayout.dense(700, 300, causal=True, block_size=128, device=DEV),
         1, 2, 2, 64, torch.bfloat16, False),
        ("window_causal_bshd", SparseLayout.sliding_window(1333, 256, causal=True, block_size=128, device=DEV),
         2, 4, 2, 128, torch.bfloat16, True),
        ("window1024_s4096_h8", SparseLayout.sliding_window(4096, 1024, causal=True, block_size=128, device=DEV),
         1, 8, 8, 128, torch.bfloat16, False),
    ]


def make_qkv(b, hq, hkv, sq, sk, d, dtype, bshd, grad=False):
    def one(h, s):
        if bshd:
            t = torch.randn(b, s, h, d, device=DEV, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(b, h, s, d, device=DEV, dtype=dtype)
        return t.requires_grad_(grad)
    return one(hq, sq), one(hkv, sk), one(hkv, sk)


def run_checks(results, variant_ok):
    """variant_ok: variant -> bool, set False by any failed check of that variant."""
    ok_all = True
    for name, lay, b, hq, hkv, d, dt, bshd in layouts():
        q, k, v = make_qkv(b, hq, hkv, lay.seq_q, lay.seq_k, d, dt, bshd)
        scale = 0.9 / math.sqrt(d)
        ro, rl = ref_fwd(q, k, v, lay, scale)
        for variant, persistent in [(vn, p) for vn in VARIANTS for p in (True, False)]:
            if d != 128 and "stages" in GS.VARIANTS[variant]:
                continue            # a ring depth chosen for d128 (st3): at d64 only a shallower ring
            row = {"check": name, "variant": variant, "persistent": persistent,
                   "shape": [b, hq, hkv, lay.seq_q, lay.seq_k, d], "dtype": str(dt).split(".")[-1]}
            try:
                out, lse = gluon_fwd(q, k, v, lay, scale, persistent, variant)
                torch.cuda.synchronize()
                same_empty, lerr = check_lse(lse, rl)
                row.update(rel_err=rel(out, ro), lse_max_err=lerr, nan=bool(torch.isnan(out).any()
                                                                              or torch.isnan(lse).any()),
                           empty_rows_match=same_empty)
                row["ok"] = (row["rel_err"] < 2e-2 and lerr < 1e-2 and not row["nan"] and same_empty)
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800])
                traceback.print_exc()
            ok_all &= row["ok"]
            variant_ok[variant] = variant_ok.get(variant, True) and row["ok"]
            results.append(row)
            log(f"check {name} {variant} persistent={persistent}: {'ok' if row['ok'] else 'FAIL'} "
                f"{ {k_: row.get(k_) for k_ in ('rel_err', 'lse_max_err', 'nan', 'empty_rows_match', 'error')} }")
        SAVE_PARTIAL()
    # forward + backward through the op, pinned to the impl (backward: Triton sparse from out + lse)
    for name, lay, b, hq, hkv, d, dt, bshd in layouts()[:3] + layouts()[5:6]:
        row = {"check": f"op_fwd_bwd {name}"}
        try:
            q, k, v = make_qkv(b, hq, hkv, lay.seq_q, lay.seq_k, d, dt, bshd, grad=True)
            scale = 0.9 / math.sqrt(d)
            with opsadv.use_backend("cuda", experimental=True, autotune=False,
                                    impls={"sparse_attention": GS.IMPL_ID}), opsadv.trace() as tr:
                out, lse = opsadv.ops.sparse_attention(q, k, v, lay, scale=scale, return_lse=True)
                do = torch.randn_like(out)
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            with opsadv.use_backend("reference"):
                ro = opsadv.ops.sparse_attention(qd, kd, vd, lay, scale=scale)
                rq, rk, rv = torch.autograd.grad(ro, (qd, kd, vd), do.double())
            errs = {n: rel(x, r) for n, x, r in (("out", out, ro), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv))}
            nan = any(bool(torch.isnan(x).any()) for x in (out, dq, dk, dv))
            row.update(errs, counts={k_: v_ for k_, v_ in tr.counts.items()}, nan=nan,
                       ok=all(e < 2e-2 for e in errs.values()) and not nan and tr.counts.get(GS.IMPL_ID, 0) >= 1)
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800])
            traceback.print_exc()
        ok_all &= row["ok"]
        variant_ok["default"] = variant_ok.get("default", True) and row["ok"]     # the impl runs the default
        results.append(row)
        log(f"{row['check']}: {'ok' if row['ok'] else 'FAIL'} { {k_: row.get(k_) for k_ in ('out', 'dq', 'dk', 'dv', 'error')} }")
        SAVE_PARTIAL()
    return ok_all


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def triton_tiles(lay, d):
    from opsadv.bench.suite_sparse import fwd_tiles
    return fwd_tiles(lay, d)


def run_timing(results, variant_ok, windows):
    """variant_ok: the variants whose checks passed (only those are timed)."""
    from opsadv.bench.case import flex_peer
    b, h, s, d, dt = 1, 32, 16384, 128, torch.bfloat16
    q, k, v = make_qkv(b, h, h, s, s, d, dt, False)
    scale = 1 / math.sqrt(d)
    os.environ["OPSADV_POISON_OUTPUTS"] = "0"
    flex, make_mask = flex_peer()
    rows = []
    for w in windows:
        lay = SparseLayout.sliding_window(s, w, causal=True, block_size=128, device=DEV)
        vis, tot = triton_tiles(lay, d)
        ti = GS.layout_index(lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal,
                             lay.window_left, lay.window_right, lay.num_global, s, s)
        work = 4.0 * b * h * s * s * d * vis / tot
        work128 = 4.0 * b * h * s * s * d * ti.tiles / ti.total_tiles
        row = {"case": f"fwd bf16 b{b} h{h} s{s} d{d} sliding{w} causal", "density": round(vis / tot, 4),
               "density_128": round(ti.tiles / ti.total_tiles, 4), "ms": {}}
        with torch.no_grad():
            with opsadv.use_backend("cuda", autotune=False, impls={"sparse_attention": TRITON_ID}):
                ref_out = opsadv.ops.sparse_attention(q, k, v, lay)
                row["ms"]["triton"] = bench(lambda: opsadv.ops.sparse_attention(q, k, v, lay))
            for variant in VARIANTS:
                if not variant_ok.get(variant):
                    continue
                for persistent in (True, False):
                    t = tag(variant, persistent)
                    try:
                        out, _ = gluon_fwd(q, k, v, lay, scale, persistent, variant)
                        err = row[f"rel_err_{t}_vs_triton"] = rel(out, ref_out)
                        if not err < 2e-2:      # also NaN
                            raise AssertionError(f"rel err {err} vs the Triton sparse forward")
                        row["ms"][t] = bench(lambda: gluon_fwd(q, k, v, lay, scale, persistent, variant))
                    except Exception as e:
                        traceback.print_exc()
                        row.setdefault("failures", {})[t] = f"{type(e).__name__}: {e}"[:500]
                        results["timing_checks_ok"] = False
                        log(f"FAIL {t} at window {w}: {row['failures'][t]}")
            if variant_ok.get("default"):
                with opsadv.use_backend("cuda", experimental=True, autotune=False,
                                        impls={"sparse_attention": GS.IMPL_ID}):
                    row["ms"]["gluon_op"] = bench(lambda: opsadv.ops.sparse_attention(q, k, v, lay))
            if flex is not None and (w == 1024 or len(windows) > 1):
                def mm(b_, h_, i, j, w=w):
                    return (i >= j) & (i - j <= w)
                bm = make_mask(mm, None, None, s, s, device=DEV)
                row["ms"]["flex"] = bench(lambda: flex(q, k, v, block_mask=bm))
        row["tflops"] = {n: work / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
        row["tflops_128grid"] = {n: work128 / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
        if "flex" in row["ms"]:
            row["vs_flex"] = {n: row["ms"]["flex"] / ms for n, ms in row["ms"].items() if n != "flex"}
        if "gluon" in row["ms"]:
            row["gluon_vs_triton"] = row["ms"]["triton"] / row["ms"]["gluon"]
            # the new schedules against the measured default (> 1: faster than it)
            row["vs_default_gluon"] = {n: row["ms"]["gluon"] / ms for n, ms in row["ms"].items()
                                       if n.startswith("gluon_") and n != "gluon_op"}
        rows.append(row)
        results["timing"] = rows
        SAVE(results)
        log(f"{row['case']}: ms { {n: round(x, 4) for n, x in row['ms'].items()} } "
            f"TFLOP/s { {n: round(x, 1) for n, x in row['tflops'].items()} } vs_flex {row.get('vs_flex')}")
        torch.cuda.empty_cache()
    # dense references: our Triton flash (the suite's "[own]" case), causal; SDPA cuDNN
    dense = {}
    with torch.no_grad():
        with opsadv.use_backend("cuda", autotune=False, impls={"flash_attention": "cuda.triton.flash_attention"}):
            dense["triton_flash_causal"] = bench(lambda: opsadv.ops.flash_attention(q, k, v, causal=True))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense["sdpa_cudnn_causal"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    dwork = 4.0 * b * h * s * s * d / 2
    dense_tf = {n: dwork / (ms * 1e-3) / 1e12 for n, ms in dense.items()}
    log(f"dense causal s{s}: ms {dense} TFLOP/s {dense_tf}")
    for row in rows:
        row["vs_dense_triton_tflops"] = {n: tf / dense_tf["triton_flash_causal"] for n, tf in row["tflops"].items()}
    results["timing"] = rows
    results["dense"] = {"ms": dense, "tflops": dense_tf}


def SAVE(res):
    """Write what we have so far (a timed-out call still returns the checks and the rows done)."""
    res["log"] = LOG
    with open(OUT_PATH, "w") as f:
        json.dump(res, f, indent=1)


OUT_PATH = "gluon_sparse_h200.json"
RESULTS: dict = {}


def SAVE_PARTIAL():
    SAVE(RESULTS)


def main():
    global OUT_PATH, VARIANTS
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    OUT_PATH = out_path = args[0] if args else OUT_PATH
    quick = "--quick" in sys.argv
    for a in sys.argv[1:]:
        if a.startswith("--variants="):
            VARIANTS = [v for v in a.split("=", 1)[1].split(",") if v]
            unknown = set(VARIANTS) - set(GS.VARIANTS)
            if unknown:
                raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(GS.VARIANTS)}")
    res = RESULTS
    res.update({"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "triton": __import__("triton").__version__, "variants": VARIANTS,
                "checks": []})
    ok = False
    variant_ok: dict = {}
    try:
        ok = run_checks(res["checks"], variant_ok)
    except Exception:
        traceback.print_exc()
        variant_ok = {}             # a check block that crashed: time nothing
    res["checks_ok"] = ok
    res["variant_checks_ok"] = variant_ok
    log(f"checks ok: {ok} {variant_ok}")
    SAVE(res)
    try:
        run_timing(res, variant_ok, [1024] if quick else [1024, 128, 256, 512, 2048, 4096, 8192])
    except Exception as e:
        traceback.print_exc()
        res["timing_error"] = f"{type(e).__name__}: {e}"[:1500]
    res["log"] = LOG
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    for row in res.get("timing", []):
        print(row["case"], {n: round(x, 4) for n, x in row["ms"].items()}, "vs_flex", row.get("vs_flex"),
              "eff vs dense", {n: round(x, 3) for n, x in row["vs_dense_triton_tflops"].items()})
    ok = ok and res.get("timing_checks_ok", True)
    if not ok:
        print("FAILED: see the rows with ok=False / 'failures' in", out_path, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
