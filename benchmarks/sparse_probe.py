"""GPU probe for the cuda backend's sparse attention: correctness (bf16/fp16, forward and
backward, several patterns, through the public op) against the reference, then timing of
s=16384 sliding window 1024 (causal) vs compiled FlexAttention, packed varlen (~30% padding) vs
dense flash over the padded batch, a tile-config sweep, and a window-size (density) series.

  PYTHONPATH=. python benchmarks/sparse_probe.py OUT.json [budget_s]
Tiny CPU check under the interpreter: PROBE_TINY=1 TRITON_INTERPRET=1 ... (no flex, tiny shapes).
The JSON is rewritten after every record, so a killed run keeps what it had."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

T0 = time.time()
TINY = os.environ.get("PROBE_TINY") == "1"

import torch  # noqa: E402
from _probe_log import ProbeLog  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
import torch.nn.functional as F  # noqa: E402

import opsadv  # noqa: E402
from opsadv import SparseLayout  # noqa: E402
from opsadv.backends.cuda import sparse as SP  # noqa: E402
from opsadv.bench import suite_sparse as SS  # noqa: E402
from opsadv.bench.runner import rel_err, time_ms  # noqa: E402
from opsadv.core import dispatch  # noqa: E402
from opsadv.core.ops import sparse as S  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "sparse_probe.json"
BUDGET = float(sys.argv[2]) if len(sys.argv) > 2 else 140.0
DEV = "cpu" if TINY else "cuda"
R: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "triton": __import__("triton").__version__, "records": []}


LOG = ProbeLog(OUT, BUDGET, R, T0)
save, left, guarded = LOG.save, LOG.left, LOG.guarded


def ctx_for(q, k, layout, tiles=None):
    spec = S._spec(q, k, layout.key_padding_mask, layout.cu_seqlens, layout.block_size, layout.causal,
                   layout.window_left, layout.num_global, False)
    exp, r = dispatch.explain_spec(spec)
    assert r is not None and r.impl.id == "cuda.triton.sparse_attention", str(exp)
    ctx = r.ctx
    if tiles is not None:
        ctx = dataclasses.replace(ctx, profile=dataclasses.replace(ctx.profile, tiles={S.OP: tiles}))
    return ctx


def args_of(layout):
    return (layout.block_mask, layout.key_padding_mask, layout.cu_seqlens, layout.block_size, layout.causal,
            layout.window_left, layout.window_right, layout.num_global)


# ---- 1. correctness through the public op ------------------------------------------------------------
def correctness():
    s = 80 if TINY else 1500
    pats = {
        "window_causal": SparseLayout.sliding_window(s, s // 6, causal=True, block_size=16 if TINY else 128, device=DEV),
        "varlen_causal": SparseLayout.varlen([s // 3, 7, s // 2, s - s // 3 - 7 - s // 2], causal=True,
                                             block_size=16 if TINY else 128, device=DEV),
        "bigbird": SparseLayout.bigbird(s, block_size=16 if TINY else 64, heads=4, random_blocks=2, device=DEV),
        "window_padding_global": SparseLayout.global_tokens(s, 9, window=s // 8, block_size=16 if TINY else 64,
                                                            device=DEV).combine(SparseLayout.from_padding_mask(
                                                                (torch.arange(s, device=DEV)[None] <
                                                                 torch.tensor([[s - 37], [s // 2]], device=DEV)).long(),
                                                                block_size=16 if TINY else 64)),
    }
    for name, lay in pats.items():
        for dtype, d in ((torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 96)):
            if TINY and dtype == torch.bfloat16:
                dtype = torch.float16      # the interpreter's bf16 dot is wrong
            if d == 96 and name != "varlen_causal":
                continue
            b = 2 if lay.key_padding_mask is not None else 1
            hq, hk = 4, 2
            g = torch.Generator(device=DEV).manual_seed(1)
            q = torch.randn(b, hq, s, d, device=DEV, generator=g).to(dtype)
            k = torch.randn(b, hk, s, d, device=DEV, generator=g).to(dtype)
            v = torch.randn(b, hk, s, d, device=DEV, generator=g).to(dtype)
            do = torch.randn(b, hq, s, d, device=DEV, generator=g).to(dtype)
            outs = {}
            for be, cast in (("cuda", dtype), ("reference", torch.float32)):
                with opsadv.use_backend(be):
                    qq, kk, vv = (t.detach().to(cast).clone().requires_grad_() for t in (q, k, v))
                    o, lse = opsadv.ops.sparse_attention(qq, kk, vv, lay, return_lse=True)
                    o.backward(do.to(cast))
                    outs[be] = (o, lse, qq.grad, kk.grad, vv.grad)
            errs = {}
            for nm, x, y in zip(("out", "lse", "dq", "dk", "dv"), outs["cuda"], outs["reference"]):
                fin = torch.isfinite(y)
                errs[nm] = float(f"{rel_err(x[fin], y[fin]):.3g}") if nm == "lse" else float(f"{rel_err(x, y):.3g}")
            errs["nan"] = any(bool(torch.isnan(x).any()) for x in outs["cuda"])
            save({"section": "correct", "pattern": name, "dtype": str(dtype)[6:], "d": d, "errs": errs,
                  "ok": (not errs["nan"]) and max(v for k_, v in errs.items() if k_ != "nan") < 3e-2})


# ---- 2. timing -------------------------------------------------------------------------------------------
def tensors(b, h, s, d, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(0)
    return [torch.randn(b, h, s, d, device=DEV, dtype=dtype, generator=g) for _ in range(4)]


FWD_CFGS = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3)]
DQ_CFGS = [(64, 64, 4, 2), (128, 32, 4, 4), (64, 32, 4, 3), (128, 64, 8, 2)]
DKDV_CFGS = [(64, 64, 4, 2), (32, 128, 4, 4), (32, 64, 4, 3), (64, 128, 8, 2)]
if TINY:
    FWD_CFGS, DQ_CFGS, DKDV_CFGS = [(32, 16, 4, 1), (16, 16, 4, 1)], [(16, 32, 4, 1)], [(32, 16, 4, 1)]


def window_timing():
    b, h, s, d, w = (1, 2, 128, 32, 24) if TINY else (1, 32, 16384, 128, 1024)
    lay = SparseLayout.sliding_window(s, w, causal=True, block_size=16 if TINY else 128, device=DEV)
    q, k, v, do = tensors(b, h, s, d, torch.float16 if TINY else torch.bfloat16)
    scale = d ** -0.5
    base = ctx_for(q, k, lay)
    # flex peer
    flex_out = None
    rec = {"section": "window", "case": f"b{b} h{h} s{s} d{d} sliding{w} causal"}
    if not TINY:
        flex, make_mask = SS.flex_peer()
        bm = make_mask(lambda b_, h_, i, j: (i >= j) & (i - j <= w), None, None, s, s, device=DEV)
        with torch.no_grad():
            flex_out = flex(q, k, v, block_mask=bm)
        rec["flex_fwd_ms"] = round(time_ms(lambda: flex(q, k, v, block_mask=bm)), 4)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        fb = lambda: torch.autograd.grad(flex(qg, kg, vg, block_mask=bm), (qg, kg, vg), do)  # noqa: E731
        flex_grads = fb()
        rec["flex_fwdbwd_ms"] = round(time_ms(fb), 4)
        save(dict(rec))
    # forward tile sweep
    best = None
    for cfg in FWD_CFGS:
        if left() < 15:
            break
        tl_ = {"small": (cfg, SP.TILES["h100"]["small"][1], SP.TILES["h100"]["small"][2])}
        ctx = ctx_for(q, k, lay, tl_["small"])
        o, lse = SP.sparse_fwd(ctx, q, k, v, *args_of(lay), scale)
        ms = time_ms(lambda: SP.sparse_fwd(ctx, q, k, v, *args_of(lay), scale))
        ti = lay.tile_index(cfg[0], cfg[1])
        r = {"section": "window_fwd_cfg", "cfg": cfg, "ms": round(ms, 4), "density": round(ti.tiles / ti.total_tiles, 4),
             "tflops": round(4 * b * h * s * s * d * ti.tiles / ti.total_tiles / ms / 1e9, 1)}
        if flex_out is not None:
            r["rel_err_vs_flex"] = float(f"{rel_err(o, flex_out):.3g}")
            r["speedup_vs_flex"] = round(rec["flex_fwd_ms"] / ms, 3)
        save(r)
        if best is None or ms < best[1]:
            best = (cfg, ms)
    o, lse = SP.sparse_fwd(base, q, k, v, *args_of(lay), scale)
    # backward sweeps: dq and dkdv kernels separately
    for part, cfgs, idx in (("dkdv", DKDV_CFGS, 2), ("dq", DQ_CFGS, 1)):
        for cfg in cfgs:
            if left() < 15:
                break
            t3 = list(SP.TILES["h100"]["small"])
            t3[idx] = cfg
            ctx = ctx_for(q, k, lay, tuple(t3))
            g = SP.sparse_bwd(ctx, do, q, k, v, o, lse, *args_of(lay), scale, only=part)
            ms = time_ms(lambda: SP.sparse_bwd(ctx, do, q, k, v, o, lse, *args_of(lay), scale, only=part))
            r = {"section": f"window_{part}_cfg", "cfg": cfg, "ms": round(ms, 4)}
            if not TINY:
                pick = (1, 2) if part == "dkdv" else (0,)
                r["rel_err_vs_flex"] = float(f"{max(rel_err(g[i], flex_grads[i]) for i in pick):.3g}")
            save(r)
    # the public op, default tiles, forward and forward+backward
    with torch.no_grad():
        ms_f = time_ms(lambda: opsadv.ops.sparse_attention(q, k, v, lay))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fb = lambda: torch.autograd.grad(opsadv.ops.sparse_attention(qg, kg, vg, lay), (qg, kg, vg), do)  # noqa: E731
    grads = fb()
    ms_fb = time_ms(fb)
    r = {"section": "window_op", "fwd_ms": round(ms_f, 4), "fwdbwd_ms": round(ms_fb, 4),
         "default_tiles": SP.tiles_for(base.profile, d)}
    if not TINY:
        r.update(fwd_speedup_vs_flex=round(rec["flex_fwd_ms"] / ms_f, 3),
                 bwd_speedup_vs_flex=round((rec["flex_fwdbwd_ms"] - rec["flex_fwd_ms"]) / (ms_fb - ms_f), 3),
                 fwdbwd_speedup_vs_flex=round(rec["flex_fwdbwd_ms"] / ms_fb, 3),
                 grad_rel_err_vs_flex=float(f"{rel_err(grads, flex_grads):.3g}"))
    save(r)


def varlen_timing():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n, max_len, h, d = (3, 64, 2, 32) if TINY else (8, 4096, 16, 128)
    dtype = torch.float16 if TINY else torch.bfloat16
    for causal in (False, True):
        lens = SS.varlen_lengths(n, max_len)
        total = sum(lens)
        lay = SparseLayout.varlen(lens, causal=causal, block_size=16 if TINY else 128, device=DEV)
        q, k, v, do = tensors(1, h, total, d, dtype)
        am = (torch.arange(max_len, device=DEV)[None] < torch.tensor(lens, device=DEV)[:, None]).long()
        _, info = SparseLayout.unpad(torch.zeros(n, 1, max_len, 1, device=DEV), am)
        qp, kp, vp, dop = (SparseLayout.pad(t, info) for t in (q, k, v, do))
        rec = {"section": "varlen", "case": f"n{n} s{max_len} h{h} d{d} pad{1 - total / (n * max_len):.2f}"
               + (" causal" if causal else ""), "lens": lens}
        if not TINY:
            def padded(q_, k_, v_):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
            with torch.no_grad():
                rec["padded_fwd_ms"] = round(time_ms(lambda: padded(qp, kp, vp)), 4)
            qg, kg, vg = (t.clone().requires_grad_() for t in (qp, kp, vp))
            pb = lambda: torch.autograd.grad(padded(qg, kg, vg), (qg, kg, vg), dop)  # noqa: E731
            pb()
            rec["padded_fwdbwd_ms"] = round(time_ms(pb), 4)
        with torch.no_grad():
            o = opsadv.ops.sparse_attention(q, k, v, lay)
            rec["fwd_ms"] = round(time_ms(lambda: opsadv.ops.sparse_attention(q, k, v, lay)), 4)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        fb = lambda: torch.autograd.grad(opsadv.ops.sparse_attention(qg, kg, vg, lay), (qg, kg, vg), do)  # noqa: E731
        fb()
        rec["fwdbwd_ms"] = round(time_ms(fb), 4)
        # correctness: per-sequence SDPA (math of the real tokens only)
        ref, st = [], 0
        for L in lens:
            sl = slice(st, st + L)
            ref.append(F.scaled_dot_product_attention(q[:, :, sl].float(), k[:, :, sl].float(), v[:, :, sl].float(),
                                                      is_causal=causal))
            st += L
        rec["rel_err_vs_per_seq_sdpa"] = float(f"{rel_err(o, torch.cat(ref, 2)):.3g}")
        if not TINY:
            rec["fwd_speedup"] = round(rec["padded_fwd_ms"] / rec["fwd_ms"], 3)
            rec["fwdbwd_speedup"] = round(rec["padded_fwdbwd_ms"] / rec["fwdbwd_ms"], 3)
        ti = lay.tile_index(*SP.tiles_for(ctx_for(q, k, lay).profile, d)[0][:2])
        rec["fwd_tflops_effective"] = round(4 * h * total * total * d * ti.tiles / ti.total_tiles / rec["fwd_ms"] / 1e9, 1)
        save(rec)
        # forward tile sweep on the varlen case
        for cfg in FWD_CFGS[:3] if not causal else []:
            if left() < 20:
                break
            ctx = ctx_for(q, k, lay, (cfg, *SP.TILES["h100"]["small"][1:]))
            SP.sparse_fwd(ctx, q, k, v, *args_of(lay), d ** -0.5)
            ms = time_ms(lambda: SP.sparse_fwd(ctx, q, k, v, *args_of(lay), d ** -0.5))
            save({"section": "varlen_fwd_cfg", "causal": causal, "cfg": cfg, "ms": round(ms, 4),
                  **({"speedup": round(rec["padded_fwd_ms"] / ms, 3)} if not TINY else {})})


def density_series():
    if TINY:
        return
    flex, make_mask = SS.flex_peer()
    b, h, s, d = 1, 32, 16384, 128
    q, k, v, _ = tensors(b, h, s, d)
    for w in (256, 4096):
        if left() < 25:
            break
        lay = SparseLayout.sliding_window(s, w, causal=True, block_size=128, device=DEV)
        bm = make_mask(lambda b_, h_, i, j, w=w: (i >= j) & (i - j <= w), None, None, s, s, device=DEV)
        with torch.no_grad():
            fl = time_ms(lambda: flex(q, k, v, block_mask=bm))
            ms = time_ms(lambda: opsadv.ops.sparse_attention(q, k, v, lay))
        save({"section": "density", "window": w, "flex_ms": round(fl, 4), "ms": round(ms, 4),
              "speedup": round(fl / ms, 3)})


def suite_smoke():
    if TINY:
        return
    from opsadv.bench.runner import run_case
    opsadv.use_backend("auto")
    for row in run_case(next(iter(SS.cases(quick=True)))):
        save({"section": "suite_smoke", **row})
    opsadv.use_backend("cuda")


if __name__ == "__main__":
    opsadv.use_backend("cuda")
    save({"section": "start", "profile": getattr(ctx_for(*tensors(1, 1, 64, 64, torch.float16)[:2],
                                                         SparseLayout.dense(64, block_size=64, device=DEV)).profile,
                                                 "name", None)})
    guarded("window", window_timing, 40)
    guarded("varlen", varlen_timing, 20)
    guarded("correct", correctness, 15)
    guarded("suite_smoke", suite_smoke, 20)
    guarded("density", density_series, 25)
    save({"section": "done"})
