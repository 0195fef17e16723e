"""GPU probe for the sparse attention FORWARD loop variants (opsadv/backends/cuda/sparse.py LOOP_IDS,
program order, tile configs), one process, interleaved:

  1. correctness of every variant on small odd patterns (bf16, through SP.sparse_fwd) against the
     reference backend (float32), and at the timing shapes against SDPA with the dense boolean mask;
  2. timing (do_bench median, two interleaved rounds) of b1 h32 s16384 d128 bf16 causal sliding windows
     256/1024/4096/8192, a global+window pattern (full tiles not one run: "run" falls back to
     "prefetch"), the packed varlen batch (~30% padding) vs dense flash over the padded batch, and the
     peers: compiled FlexAttention (same mask) and our dense Triton flash kernel (causal, same shape).

Work is counted on the 64x64 tile grid for every variant (visited tiles / all tiles * 4*b*h*s*s*d), so
effective TFLOP/s compare like ms do, whatever tile a variant uses.

  PYTHONPATH=. python benchmarks/sparse_fwd_probe.py OUT.json [budget_s]
The JSON is rewritten after every record (a killed run keeps what it had).
Dry run on CPU under the interpreter (tiny shapes, fp16, no flex): PROBE_TINY=1 TRITON_INTERPRET=1 ..."""
from __future__ import annotations

import dataclasses
import os
import time

T0 = time.time()

import torch  # noqa: E402
from _probe_log import ProbeLog, probe_setup  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
from _sparse_patterns import odd_patterns  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import opsadv  # noqa: E402
from opsadv import SparseLayout  # noqa: E402
from opsadv.backends.cuda import sparse as SP  # noqa: E402
from opsadv.bench import suite_sparse as SS  # noqa: E402
from opsadv.bench.case import flex_peer  # noqa: E402
from opsadv.bench.runner import rel_err, time_ms  # noqa: E402
from opsadv.core import dispatch  # noqa: E402
from opsadv.core.ops import sparse as S  # noqa: E402

OUT, BUDGET, TINY, DEV, DT, R = probe_setup("sparse_fwd_probe.json", 200.0)

# name -> (fwd tile (BLOCK_M, BLOCK_N, warps, stages), variant)
VARIANTS = {
    "list_64": ((64, 64, 4, 3), {"loop": "list", "reverse": False}),       # the kernel as of 98a2d46
    "prefetch_64": ((64, 64, 4, 3), {"loop": "prefetch", "reverse": False}),
    "run_64": ((64, 64, 4, 3), {"loop": "run", "reverse": False}),
    "fused_64": ((64, 64, 4, 3), {"loop": "fused", "reverse": False}),
    "fused_run_64": ((64, 64, 4, 3), {"loop": "fused_run", "reverse": False}),
    "run_64_rev": ((64, 64, 4, 3), {"loop": "run", "reverse": True}),
    "run_128x64_rev": ((128, 64, 8, 3), {"loop": "run", "reverse": True}),
    "run_128x128": ((128, 128, 8, 3), {"loop": "run", "reverse": False}),
    # set 4 (session 10, occupancy; sm_90 compile of the w1024 forward: 64x64/4/3 174 registers and 112 KB of
    # shared memory -> 2 CTAs (8 warps) per SM; 64x32/4/3 128 registers, 64 KB -> 3 CTAs (12 warps))
    "run_64x32": ((64, 32, 4, 3), {"loop": "run", "reverse": False}),
    "run_64x32_st4": ((64, 32, 4, 4), {"loop": "run", "reverse": False}),
    "run_64_st2": ((64, 64, 4, 2), {"loop": "run", "reverse": False}),
    "run_128x128_rev": ((128, 128, 8, 3), {"loop": "run", "reverse": True}),
    "fused_run_128x128": ((128, 128, 8, 3), {"loop": "fused_run", "reverse": False}),
    # set 5 (session 11): K/V through TMA descriptors (sparse.py's "tma" variant)
    "run_64_tma": ((64, 64, 4, 3), {"loop": "run", "reverse": False, "tma": True}),
    "fused_run_64_tma": ((64, 64, 4, 3), {"loop": "fused_run", "reverse": False, "tma": True}),
    "run_64_st4_tma": ((64, 64, 4, 4), {"loop": "run", "reverse": False, "tma": True}),
    "run_128x128_tma": ((128, 128, 8, 3), {"loop": "run", "reverse": False, "tma": True}),
    # set 6 (session 15): band layouts' tiles derived in the kernel (no index loads); its run (60e9cea) also timed a
    # masked-tiles-first loop ("band_mf", the same within 1%, since removed)
    "band_64_tma": ((64, 64, 4, 3), {"loop": "band", "reverse": False, "tma": True}),
    "band_128x128_tma": ((128, 128, 8, 3), {"loop": "band", "reverse": False, "tma": True}),
    # set 7: the band tiles in one loop (masked edges in a uniform branch)
    "band_fused_64_tma": ((64, 64, 4, 3), {"loop": "band_fused", "reverse": False, "tma": True}),
    "band_fused_128x128_tma": ((128, 128, 8, 3), {"loop": "band_fused", "reverse": False, "tma": True}),
    # set 8 (session 16, 5859e0a): the persistent band forward; its run also timed the item and tile loops fused by
    # Triton (flatten: wrong outputs at the timing shapes and slower, since removed; "persist_64_noflat_tma" there is
    # "persist_64_tma" now)
    "persist_64_tma": ((64, 64, 4, 3), {"loop": "band_persist", "reverse": False, "tma": True}),
    "persist_64_st2_tma": ((64, 64, 4, 2), {"loop": "band_persist", "reverse": False, "tma": True}),
}
# PROBE_SET picks which variants each section compiles (each is a separate compile per pattern's flags).
# Set 1 (first H200 run, 6ec5a3d): the loop structures; set 2 (f914ce2): fused_run, and 128x128 tiles over
# the windows; set 3: the defaults chosen from them, through the public op.
SETS = {
    "1": dict(windows=(256, 1024, 4096, 8192), global_=True,
              window=("list_64", "prefetch_64", "run_64", "fused_64", "run_64_rev", "run_128x64_rev",
                      "run_128x128_rev"),
              small=("prefetch_64", "run_64", "fused_64"), glob=("list_64", "prefetch_64", "fused_64"),
              varlen=("list_64", "run_64", "fused_64", "run_64_rev", "run_128x64_rev")),
    "2": dict(windows=(256, 1024, 2048, 4096, 8192), global_=False,
              window=("run_64", "fused_run_64", "fused_64", "run_128x128", "fused_run_128x128"),
              small=("fused_run_64", "fused_run_128x128"), glob=(),
              varlen=("list_64", "run_64", "fused_run_64", "run_64_rev", "run_128x128")),
    # set 3: the new defaults through the public op (loop "run", LONG_ROW_FWD) next to the pinned 64x64 "run"
    "3": dict(windows=(1024, 2048, 8192), global_=False, window=("op_default", "run_64"),
              small=("op_default",), glob=(), varlen=("op_default", "list_64")),
    # set 4: more resident warps per SM at short windows (issue 5's w1024 forward: 1.254x flex, 1.3x wanted)
    "4": dict(windows=(256, 512, 1024, 2048), global_=False,
              window=("op_default", "run_64", "run_64x32", "run_64x32_st4", "run_64_st2"),
              small=("run_64x32",), glob=(), varlen=("op_default", "run_64x32")),
    # set 5: TMA loads of K/V at the 64x64 tile (w <= 1024) and the long-row 128x128 one (w2048)
    "5": dict(windows=(256, 1024, 2048), global_=False,
              window=("op_default", "run_64", "run_64_tma", "fused_run_64_tma", "run_64_st4_tma",
                      "run_128x128", "run_128x128_tma"),
              small=("run_64_tma", "fused_run_64_tma"), glob=(), varlen=("op_default", "run_64", "run_64_tma")),
    # set 6: LOOP "band" (session 15) against "run" at the same tiles, TMA K/V as the default
    "6": dict(windows=(128, 256, 1024, 2048), global_=False,
              window=("op_default", "run_64_tma", "band_64_tma", "run_128x128_tma", "band_128x128_tma"),
              small=("band_64_tma", "band_128x128_tma"), glob=(), varlen=("op_default",)),
    # set 7: LOOP "band_fused" against "band" (session 15's default from set 6) and "run"
    "7": dict(windows=(256, 1024, 2048), global_=False,
              window=("op_default", "run_64_tma", "band_64_tma", "band_fused_64_tma", "band_128x128_tma",
                      "band_fused_128x128_tma"),
              small=("band_fused_64_tma", "band_fused_128x128_tma"), glob=(), varlen=()),
    # set 8: the persistent band forward against "band" (the default since session 15)
    "8": dict(windows=(128, 256, 1024, 2048), global_=False,
              window=("op_default", "band_64_tma", "persist_64_tma", "persist_64_st2_tma"),
              small=("persist_64_tma", "persist_64_st2_tma"), glob=(), varlen=()),
}
SET = os.environ.get("PROBE_SET", "3")
R["probe_set"] = SET
CFG = SETS[SET]


LOG = ProbeLog(OUT, BUDGET, R, T0)
save, left, guarded = LOG.save, LOG.left, LOG.guarded


def bench(fn) -> float:
    return time_ms(fn)          # do_bench median (warmup 25 ms, rep 100 ms) on a GPU


_ctx_cache: dict = {}


def ctx_for(q, k, layout, fwd_tile):
    spec = S.layout_spec(q, k, layout, False)
    with opsadv.use_backend("cuda", impls={"sparse_attention": "cuda.triton.sparse_attention"}):
        exp, r = dispatch.explain_spec(spec)     # pinned: varlen layouts may go to flash_varlen otherwise
    assert r is not None and r.impl.id == "cuda.triton.sparse_attention", str(exp)
    base = SP.tiles_for(r.ctx.profile, q.shape[-1])
    tiles = (fwd_tile, base[1], base[2])
    return dataclasses.replace(r.ctx, profile=dataclasses.replace(r.ctx.profile, tiles={SP.OP: tiles}))


def args_of(layout):
    return (layout.block_mask, layout.key_padding_mask, layout.cu_seqlens, layout.block_size, layout.causal,
            layout.window_left, layout.window_right, layout.num_global)


def runner(q, k, v, layout, name):
    if name == "op_default":                    # the public op, dispatcher and default tiles / loop
        def op():
            with torch.no_grad():
                return opsadv.ops.sparse_attention(q, k, v, layout)
        return op
    tile, variant = VARIANTS[name]
    ctx = ctx_for(q, k, layout, tile)
    args = args_of(layout)
    scale = q.shape[-1] ** -0.5
    return lambda: SP.sparse_fwd(ctx, q, k, v, *args, scale, variant=variant)[0]


def randn(*shape, dtype=DT, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)


# ---- 1. small odd patterns vs the reference backend -----------------------------------------------------
def small_correctness():
    s = 150 if TINY else 1500
    pats = odd_patterns(s, DEV)
    for pname, (lay, b) in pats.items():
        for d in ((128, 96) if pname == "varlen_causal" else (128,)):
            q, k, v = (randn(b, 4 if i == 0 else 2, s, d, seed=i + 1) for i in range(3))     # GQA 2:1
            with opsadv.use_backend("reference"):
                ref = opsadv.ops.sparse_attention(q.float(), k.float(), v.float(), lay)
            errs = {}
            for name in CFG["small"]:
                out = runner(q, k, v, lay, name)()
                errs[name] = float(f"{rel_err(out, ref):.3g}")
            save({"section": "correct_small", "pattern": pname, "d": d, "full_run": lay.tile_index(64, 64).full_run,
                  "errs": errs, "ok": all(e < 2e-2 for e in errs.values())})


# ---- 2. timing ---------------------------------------------------------------------------------------------
def _window_mod(w):
    """Flex mask_mod closing over w (a default argument is not guarded by torch.compile: set 1 passed
    w=w as a default and flex reused the first window's element mask, rel err 0.22 at w1024)."""
    def mm(b, h, i, j):
        return (i >= j) & (i - j <= w)
    return mm


def _global_mod(w, g):
    def mm(b, h, i, j):
        return ((i - j <= w) & (j - i <= w)) | (i < g) | (j < g)
    return mm


def window_series():
    b, h, s, d = (1, 2, 384, 32) if TINY else (1, 32, 16384, 128)
    q, k, v = (randn(b, h, s, d, seed=i) for i in range(3))
    flex, make_mask = (None, None) if TINY else flex_peer()
    dense_own = SS.dense_own_case(s=s, h=h, d=d, dtype=DT, dev=DEV).opsadv
    dense_own()
    cases = []
    for w in ((24, 100) if TINY else CFG["windows"]):
        lay = SparseLayout.sliding_window(s, w, causal=True, block_size=128, device=DEV)
        cases.append((f"sliding{w} causal", lay, _window_mod(w)))
    if CFG["global_"]:
        g, w = (16, 24) if TINY else (128, 256)
        lay = SparseLayout.global_tokens(s, g, window=w, causal=False, block_size=128, device=DEV)
        cases.append((f"sliding{w} global{g}", lay, _global_mod(w, g)))
    prepared = []
    for cname, lay, mm in cases:
        if left() < 15:
            break
        ti = lay.tile_index(64, 64)
        work = 4.0 * b * h * s * s * d * ti.tiles / ti.total_tiles
        names = CFG["glob"] if "global" in cname else CFG["window"]
        fns = {name: runner(q, k, v, lay, name) for name in names}
        dm = lay.dense_mask(device=DEV)
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dm)
        del dm
        errs = {name: float(f"{rel_err(fn(), ref):.3g}") for name, fn in fns.items()}
        peers = {}
        if flex is not None:
            bm = make_mask(mm, None, None, s, s, device=DEV)
            peers["flex"] = (lambda bm=bm: flex(q, k, v, block_mask=bm))
            errs["flex"] = float(f"{rel_err(peers['flex'](), ref):.3g}")
        del ref
        save({"section": "correct_timing_shape", "case": cname, "rel_err_vs_sdpa_masked": errs,
              "density64": round(ti.tiles / ti.total_tiles, 4), "full_run": ti.full_run})
        prepared.append((cname, work, fns, peers))
    rounds = {}
    for rnd in range(2):                        # interleaved: every variant of every case, twice
        if rnd == 0:
            rounds.setdefault("dense_own", []).append(bench(dense_own))
        for cname, work, fns, peers in prepared:
            if left() < 12:
                break
            for name, fn in {**fns, **peers}.items():
                rounds.setdefault((cname, name), []).append(bench(fn))
        if rnd == 1:
            rounds["dense_own"].append(bench(dense_own))
    dense_ms = min(rounds["dense_own"])
    dense_tf = 4.0 * h * s * s * d / 2 / dense_ms / 1e9
    save({"section": "dense_own", "case": f"fwd bf16 b1 h{h} s{s} d{d} dense causal [own]", "ms": rounds["dense_own"],
          "tflops": round(dense_tf, 1)})
    for cname, work, fns, peers in prepared:
        flex_ms = min(rounds.get((cname, "flex"), [float("nan")]))
        rec = {"section": "window_time", "case": cname, "flex_ms": round(flex_ms, 4), "variants": {}}
        for name in fns:
            ms_l = rounds.get((cname, name))
            if not ms_l:
                continue
            ms = min(ms_l)
            rec["variants"][name] = {"ms": [round(x, 4) for x in ms_l], "tflops64": round(work / ms / 1e9, 1),
                                     "vs_dense_own": round(work / ms / 1e9 / dense_tf, 3),
                                     "speedup_vs_flex": round(flex_ms / ms, 3)}
        save(rec)


def varlen():
    n, max_len, h, d = (4, 160, 2, 32) if TINY else (8, 4096, 16, 128)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lens = SS.varlen_lengths(n, max_len)
    total = sum(lens)
    res = {}
    for causal in (False, True):
        lay = SparseLayout.varlen(lens, causal=causal, block_size=128, device=DEV)
        q, k, v = (randn(1, h, total, d, seed=i) for i in range(3))
        am = torch.zeros(n, max_len, dtype=torch.long, device=DEV)
        for i, L in enumerate(lens):
            am[i, :L] = 1
        _, info = SparseLayout.unpad(torch.zeros(n, 1, max_len, 1, device=DEV), am)
        qp, kp, vp = (SparseLayout.pad(t, info) for t in (q, k, v))

        def padded(qp=qp, kp=kp, vp=vp, causal=causal):
            with sdpa_kernel([SDPBackend.MATH if TINY else SDPBackend.FLASH_ATTENTION]), torch.no_grad():
                return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)
        starts = [0]
        for L in lens:
            starts.append(starts[-1] + L)
        with torch.no_grad():
            ref = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b_], k[:, :, a:b_], v[:, :, a:b_],
                                                            is_causal=causal) for a, b_ in zip(starts, starts[1:])], 2)
        fns = {name: runner(q, k, v, lay, name) for name in CFG["varlen"]}
        errs = {name: float(f"{rel_err(fn(), ref):.3g}") for name, fn in fns.items()}
        res[causal] = (lay, fns, padded, errs)
    times = {}
    for rnd in range(2):
        for causal, (lay, fns, padded, errs) in res.items():
            if left() < 8:
                break
            times.setdefault((causal, "padded_dense"), []).append(bench(padded))
            for name, fn in fns.items():
                times.setdefault((causal, name), []).append(bench(fn))
    for causal, (lay, fns, padded, errs) in res.items():
        pd = min(times.get((causal, "padded_dense"), [float("nan")]))
        rec = {"section": "varlen_time", "case": f"fwd bf16 n{n} h{h} s{max_len} d{d} varlen pad"
               f"{round(100 * (1 - total / (n * max_len)))}" + (" causal" if causal else ""),
               "padded_dense_ms": round(pd, 4), "rel_err_vs_per_seq_sdpa": errs,
               "full_run": lay.tile_index(64, 64).full_run, "variants": {}}
        for name in fns:
            ms_l = times.get((causal, name))
            if ms_l:
                rec["variants"][name] = {"ms": [round(x, 4) for x in ms_l],
                                         "speedup_vs_padded_dense": round(pd / min(ms_l), 3)}
        save(rec)


def summary():
    rows = []
    for r in R["records"]:
        if r.get("section") in ("window_time", "varlen_time") and r.get("variants"):    # set 7 times no varlen
            peer = r.get("flex_ms", r.get("padded_dense_ms"))
            best = min(r["variants"].items(), key=lambda kv: min(kv[1]["ms"]))
            base = next(iter(r["variants"].values()), {}).get("ms", [float("nan")])
            rows.append(f"{r['case'][:44]:44s} peer {peer:7.3f}  first {min(base):7.3f}  best {best[0]:14s} "
                        f"{min(best[1]['ms']):7.3f}")
            rows.append("    " + "  ".join(f"{k}={min(v['ms']):.3f}" for k, v in r["variants"].items()))
        if r.get("section") == "dense_own":
            rows.append(f"dense own causal: {min(r['ms']):.3f} ms {r['tflops']} TFLOP/s")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    guarded("correct_small", small_correctness, 20)
    guarded("window_series", window_series, 20)
    guarded("varlen", varlen, 15)
    guarded("summary", summary, 0)
    print(f"total {time.time() - T0:.0f}s", flush=True)
