"""Block-sparse / variable-length attention (opsadv::sparse_attention) as Triton kernels.

Each program visits only the tiles the layout's `tile_index` lists for its row tile (partial
tiles first, with element masks for window edges, causal diagonal, padding, segment
boundaries and the block mask; then full tiles, unmasked).  Packed varlen batches are one
(1, h, total, d) sequence whose segments the tile lists and element masks keep apart, so the
work is proportional to the real tokens.  GQA by head index arithmetic; a row with no allowed
key gives zeros and lse = -inf.  Backward: a dK/dV kernel (per kv tile, over the transposed
lists and every query head of its group) and a dQ kernel, both without atomics.

Tiles come from ctx.profile.tiles["sparse_attention"] (the backend's profiles; DEFAULT_TILES below when it has
none); the forward takes the profile's larger "long_row" tile for long contiguous rows.
Forward loop structure: LOOP_IDS / FWD_DEFAULT below (full tiles walked as a column range when they
are one run per row, else column ids prefetched one iteration ahead, so K/V loads stay pipelined).
Backward: the same choices as BWD_LOOP_IDS / BWD_DEFAULT (still the in-loop id load until measured)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_TRITON, CallSpec, KernelImpl
from opsadv.core.sparse_tiles import tile_index
from opsadv.core.policy import current_policy

from .. import interpreter_bf16_reasons, triton_device_types
from . import band_persist as _persist
from .helpers import _allowed, _band_tiles, _fwd_finish, _kv_tile_unmasked, _softmax_step
from ..utils import load_tile, new_output, new_output_bshd
from ..tma import desc_bhsd, run_side_by_side, tma_tiles_ok

OP = "sparse_attention"
LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 96, 128, 256)
FEATURES = frozenset({"causal", "gqa", "key_padding", "varlen", "window", "global", "cross_length"})
MAX_REFINE_CELLS = 1 << 26      # tile classification grid (gcd of block size and tile) cap

# Tiles: ctx.profile.tiles["sparse_attention"] = {"small": tiles, "large": tiles[, "long_row": (fwd tile, min mean
# keys per row)]} by head-dim class ("small" <= 128 < "large"), tiles = ((fwd BLOCK_M, BLOCK_N, warps, stages
# [, rescale threshold]), (dq BLOCK_M, BLOCK_N, warps, stages), (dkdv BLOCK_M, BLOCK_N, warps, stages)); the
# tables are the backends' (e.g. opsadv/backends/cuda/profiles.py).  A bare tiles tuple there pins them for every
# head dim (benchmarks do), and turns the long-row tile off.  Used when the profile has none:
DEFAULT_TILES = {"small": ((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2)),
                 "large": ((64, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 1))}


def tiles_for(profile, head_dim: int):
    """((fwd), (dq), (dkdv)) tile configs: the profile's own, else DEFAULT_TILES."""
    own = getattr(profile, "tiles", {}).get(OP) if profile is not None else None
    cls = "small" if head_dim <= 128 else "large"
    if own is not None:
        return own[cls] if isinstance(own, dict) else own
    return DEFAULT_TILES[cls]


# ---- forward -------------------------------------------------------------------------------------------
# Loop variants (constexpr LOOP), measured on an H200:
#   0 "list":     partial tiles, then full tiles, each column id loaded from COLS inside the loop.  Triton's
#                 pipeliner treats the K/V loads as indirect (address from a load in the same iteration) and
#                 halves their latency budget: the full-tile loop got 2 buffers and waited for every copy at
#                 the top of each iteration (TTGIR: async_wait num = 0), i.e. K/V loads were not overlapped.
#   1 "prefetch": as 0, the next column id loaded one iteration ahead (a loop-carried scalar), so K/V loads
#                 get the dense kernel's 3-buffer pipeline (async_wait num = 2); any layout.
#   2 "run":      as 0, the full tiles walked as the contiguous range [cols[n_part], +n_full) (no index loads)
#                 when the layout's tile index says every row's full tiles are one run (TileIndex.full_run:
#                 windows, causal, varlen segments, padding); otherwise "prefetch".
#   3 "fused":    one loop over all listed tiles (ids prefetched as in 1), the element mask applied in a
#                 uniform branch for the first n_part (partial) tiles: one pipeline, no refill between loops.
#   4 "fused_run": as 3 where full tiles are one run (else 3): ids loaded only for the partial tiles, full
#                 tile t (t >= n_part) is column cols[n_part] + t - n_part.
#   5 "band":     band layouts only (a window and/or causal over an all-True or all-False block mask; no globals,
#                 key padding or segments; else "run"): every row's allowed keys are one interval whose ends grow
#                 with the row, so the program derives its tiles from (row tile, window, causal) with no index
#                 loads (_band_tiles); the full tiles first (the pipelined loop's first K/V loads issue at the
#                 program's start, not after two dependent list loads), then the masked edge tiles.
#                 (The masked tiles first timed the same within 1%: the saving is the index loads' latency, not
#                 the order.)
#   6 "band_fused": band tiles in one loop in column order (the "fused" structure): the masked edge tiles take the
#                 element mask in a uniform branch, so one pipeline covers the program (no refill between loops).
#   7 "band_persist": windowed bands only (else "band"): the persistent kernel of band_persist.py, a
#                 program walking (head, q tile) items, each running the band's widest tile count.  Faster than
#                 "band" only for narrow bands (H200, 5859e0a: w128 / w256 1.03-1.04x, w1024 0.95x): the default
#                 takes it for bands of <= PERSIST_MAX_TILES key tiles (below).
LOOP_IDS = {"list": 0, "prefetch": 1, "run": 2, "fused": 3, "fused_run": 4, "band": 5, "band_fused": 6,
            "band_persist": 7}
# H200 (two runs, 64x64/4/3): "run" vs "list" w256 0.308 vs 0.332 ms,
# w1024 0.726 vs 0.787, w4096 2.170 vs 2.461, w8192 3.615 vs 4.046, varlen 1.558 vs 1.771; global+window
# ("prefetch", full tiles not one run) 0.749 vs 0.918.  "fused"/"fused_run" were ~3% faster at w256 and
# 1-7% slower from w1024 up.  REVERSE: -2% on varlen, +3..5% on w4096/w8192: off.
# "tma" (K/V through descriptors; True / False, or "contiguous": only for layouts without segments, key padding
# or a mixed block mask).  H200 (causal windows s16384 d128
# bf16, "run" 64x64/4/3): w256 0.307 vs 0.319 ms, w1024 0.679 vs 0.741, w2048 1.196 vs 1.300 (128x128/8/3:
# 1.216 vs 1.307); the packed varlen batch slower, 1.831 vs 1.642 (causal 1.088 vs 0.974); global / block-mask
# layouts not measured.  Hence "contiguous".
# "band" (60e9cea, s16384 causal windows d128 bf16, TMA K/V,
# ms band / run): 64x64 w128 0.234 / 0.248, w256 0.299 / 0.310, w1024 0.691 / 0.707, w2048 1.200 / 1.240; 128x128
# w2048 1.161 / 1.184; the masked tiles first the same within 1%.
# Layouts that are not bands take "run".
# "persist_max_tiles": "band" becomes "band_persist" where the band is at most this many key tiles wide (H200,
# 5859e0a, 64x64 tiles: w128 = 3 tiles 0.2265 vs 0.2349 ms, w256 = 5 tiles
# 0.2837 vs 0.2922; w1024 = 17 tiles 0.712 vs 0.680).  Only without a variant: one naming its loop runs it as named.
PERSIST_MAX_TILES = 5
FWD_DEFAULT = {"loop": "band", "reverse": False, "tma": "contiguous", "persist_max_tiles": PERSIST_MAX_TILES}


@triton.jit
def _tile_pair(a_base, b_base, s_a, s_b, r0, offs_d, D, R, a_desc, b_desc, b, h, ROWS: tl.constexpr,
               COLS: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """Two (ROWS, COLS) tiles from row r0 of one head (K and V, or Q and dO).  TMA: through (b, h, s, d)
    descriptors, rows past R come back zero (partial tiles mask them); else pointer loads, rows masked in
    partial tiles (MASKED) and head-dim columns when padded (not EVEN_D)."""
    if TMA:
        x = a_desc.load([b, h, r0, 0]).reshape(ROWS, COLS)
        y = b_desc.load([b, h, r0, 0]).reshape(ROWS, COLS)
    else:
        offs_r = r0 + tl.arange(0, ROWS)
        x = load_tile(a_base + offs_r[:, None] * s_a + offs_d[None, :], offs_r, R, offs_d, D, MASKED, not EVEN_D)
        y = load_tile(b_base + offs_r[:, None] * s_b + offs_d[None, :], offs_r, R, offs_d, D, MASKED, not EVEN_D)
    return x, y


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
              bm_ptr, s_bm_q, s_bm_k, kpm_ptr, seg_ptr, pos_ptr, SQ, SK, OFF, WL, WR, NG, BS,
              BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, BM_MODE: tl.constexpr,
              HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr, RESCALE: tl.constexpr,
              k_desc=None, v_desc=None, b32=0, hk32=0, TMA: tl.constexpr = False):
    """One online-softmax step over key tile kt (MASKED: a partial tile, else a full in-bounds one)."""
    offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    k, v = _tile_pair(k_base, v_base, s_kn, s_vn, kt * BLOCK_N, offs_d, D, SK, k_desc, v_desc, b32, hk32, BLOCK_N,
                      q.shape[1], MASKED, EVEN_D, TMA)
    s = tl.dot(q, tl.trans(k))                      # raw scores; qk_scale (log2 domain) is applied in one FMA
    if MASKED:
        ok = _allowed(offs_m, offs_n, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, seg_ptr, pos_ptr, SQ, SK, OFF, WL, WR, NG,
                      BS, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG, True)
        s = tl.where(ok, s, float("-inf"))
    return _softmax_step(acc, l_i, m_i, s, v, qk_scale, MASKED, RESCALE)


@triton.jit
def _sparse_fwd(Q, K, V, O, LSE, ROWS, COLS, BM, KPM, SEG, POS, k_desc, v_desc,
                s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
                s_rb, s_rh, s_rr, s_cb, s_ch, s_cr, s_bmb, s_bmh, s_bm_q, s_bm_k, s_kpmb,
                H, GROUP, SQ, SK, OFF, D, qk_scale, WL, WR, NG, BS,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, EVEN_D: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, BM_MODE: tl.constexpr,
                HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr, RESCALE: tl.constexpr, LOOP: tl.constexpr,
                REVERSE: tl.constexpr, TMA: tl.constexpr = False):
    if REVERSE:                                       # last row tiles first (the longest ones when causal)
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)                        # 64-bit offsets: b * s_qb can pass 2^31 elements
    h = (bh % H).to(tl.int64)
    hk = h // GROUP                                   # GQA: the kv head this query head reads
    b32 = (bh // H).to(tl.int32)                      # descriptor coordinates are 32-bit
    hk32 = ((bh % H) // GROUP).to(tl.int32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < D), other=0.0)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    bm_ptr = BM + b * s_bmb + h * s_bmh               # strides are 0 on broadcast dims
    kpm_ptr = KPM + b * s_kpmb
    row = ROWS + b * s_rb + h * s_rh + pid_m * s_rr
    n_part = tl.load(row)
    n_all = tl.load(row + 1)
    cols = COLS + b * s_cb + h * s_ch + pid_m * s_cr
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    if LOOP == 5:                                     # band: tiles from the row tile's position, no index loads
        kt_lo, n_low, full_lo, n_full, hi_lo, n_high = _band_tiles(pid_m, SQ, SK, OFF, WL, WR, BLOCK_M, BLOCK_N,
                                                                   CAUSAL, BM_MODE)
        for kt in range(full_lo, full_lo + n_full):  # full tiles first (masks nowhere)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
                                      bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG, BS,
                                      BLOCK_N, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM,
                                      HAS_SEG, RESCALE, k_desc, v_desc, b32, hk32, TMA)
        for t in range(0, n_low + n_high):            # then the masked edge tiles below and above them
            kt = tl.where(t < n_low, kt_lo + t, hi_lo + t - n_low)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
                                      bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG, BS,
                                      BLOCK_N, EVEN_D, True, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM,
                                      HAS_SEG, RESCALE, k_desc, v_desc, b32, hk32, TMA)
    elif LOOP >= 3:
        if LOOP == 6:                                 # band_fused: ascending tiles, the masked ones at both ends
            kt, n_low, full_lo, n_full, hi_lo, n_high = _band_tiles(pid_m, SQ, SK, OFF, WL, WR, BLOCK_M, BLOCK_N,
                                                                    CAUSAL, BM_MODE)
            n_tiles = n_low + n_full + n_high
        else:
            n_tiles = n_all
            run0 = tl.load(cols + n_part, mask=n_part < n_all, other=0) - n_part   # LOOP 4: full tile t -> run0 + t
            if LOOP == 4:
                kt = tl.where(n_part > 0, tl.load(cols, mask=n_part > 0, other=0), run0)
            else:
                kt = tl.load(cols, mask=n_all > 0, other=0)
        for t in range(0, n_tiles):
            if LOOP == 6:
                kt_next = kt + 1
                masked = (t < n_low) | (t >= n_low + n_full)
            elif LOOP == 4:
                kt_next = tl.where(t + 1 < n_part, tl.load(cols + t + 1, mask=t + 1 < n_part, other=0), run0 + t + 1)
                masked = t < n_part
            else:
                kt_next = tl.load(cols + t + 1, mask=t + 1 < n_all, other=0)
                masked = t < n_part
            offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
            k, v = _kv_tile_unmasked(k_base, v_base, s_kn, s_vn, kt, offs_d, SK, D, k_desc, v_desc, b32, hk32, BLOCK_N,
                                     HEAD_D, EVEN_D, TMA)
            s = tl.dot(q, tl.trans(k))
            if masked:                                # partial tiles (first in the list; band_fused: at both ends)
                ok = _allowed(offs_m, offs_n, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG,
                              BS, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG, True)
                s = tl.where(ok, s, float("-inf"))
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, qk_scale, True, RESCALE)
            kt = kt_next
    else:
        for t in range(0, n_part):                    # partial tiles: element masks
            kt = tl.load(cols + t)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
                                      bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG, BS,
                                      BLOCK_N, EVEN_D, True, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM,
                                      HAS_SEG, RESCALE, k_desc, v_desc, b32, hk32, TMA)
        # full tiles: no masks at all
        if LOOP == 2:
            c0 = tl.load(cols + n_part, mask=n_part < n_all, other=0)
            for kt in range(c0, c0 + n_all - n_part):
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D,
                                          qk_scale, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR,
                                          NG, BS, BLOCK_N, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE,
                                          HAS_KPM, HAS_SEG, RESCALE, k_desc, v_desc, b32, hk32, TMA)
        elif LOOP == 1:
            kt = tl.load(cols + n_part, mask=n_part < n_all, other=0)
            for t in range(n_part, n_all):
                kt_next = tl.load(cols + t + 1, mask=t + 1 < n_all, other=0)
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D,
                                          qk_scale, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR,
                                          NG, BS, BLOCK_N, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE,
                                          HAS_KPM, HAS_SEG, RESCALE, k_desc, v_desc, b32, hk32, TMA)
                kt = kt_next
        else:
            for t in range(n_part, n_all):
                kt = tl.load(cols + t)
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D,
                                          qk_scale, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR,
                                          NG, BS, BLOCK_N, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE,
                                          HAS_KPM, HAS_SEG, RESCALE, k_desc, v_desc, b32, hk32, TMA)
    _fwd_finish(acc, l_i, m_i, O, LSE, b, h, bh, s_ob, s_oh, s_om, offs_m, offs_d, SQ, D)


# ---- backward ------------------------------------------------------------------------------------------
# Loop variants of _sparse_dq (over a query tile's key tiles) and _sparse_dkdv (over a key tile's query
# tiles, the transposed lists), constexpr LOOP, as the forward's (see LOOP_IDS):
#   0 "list":     each tile id loaded from the list inside the loop (the kernels before the variants; same TTGIR).
#   1 "prefetch": the next id loaded one iteration ahead (partial and full loops); any layout.
#   2 "run":      partial ids prefetched, full tiles walked as the range [cols[n_part], +n_full) when every
#                 row (dK/dV: every key tile) has them as one run (TileIndex.full_run / t_full_run), else 1.
# sm_90 TTGIR: at the h100 profile's
# 2 stages every variant gets 2 K/V (Q/dO) buffers with async_wait num=0 (prefetch distance 1 is all two
# stages give); at 3 stages "list"'s full-tile loop keeps 2 buffers / wait 0 (the id load takes stage 0,
# the forward's problem) while "prefetch"/"run" get 3 buffers.  Not measured on a GPU yet: the default
# stays "list" until an H200 measurement says otherwise.
BWD_LOOP_IDS = {"list": 0, "prefetch": 1, "run": 2}
# "tma": q / dO (dK/dV kernel) and k / v (dQ kernel) through descriptors (True / False / "contiguous" as the
# forward's, or "no_mixed_mask": all but mixed block masks); "streams": the dQ kernel on a side stream next to
# the dK/dV one (CUDA).  H200 (dd42066, s16384 d128 bf16 causal
# windows; GPU tests 4 passed): tma + streams 1.057x / 1.084x / 1.079x the pointer-load one-stream backward at
# w256 / w1024 / w2048 (tma alone 1.039-1.065x, streams alone 1.014-1.023x), the packed varlen batch 1.182x.
# Mixed block masks (the gather path) were not measured: pointer loads there.
BWD_DEFAULT = {"dq": "list", "dkdv": "list", "tma": "no_mixed_mask", "streams": True}


@triton.jit
def _bwd_delta(O, DO, DELTA, s_ob, s_oh, s_om, s_db, s_dh, s_dm, H, SQ, D,
               BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr):
    """delta = rowsum(out * dout) in fp32."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < D)
    o = tl.load(O + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_dm + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + bh * SQ + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < SQ)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, s_qm, s_dom, lse_base, delta_base, qt, offs_n, offs_d, D, qk_scale,
               bm_ptr, s_bm_q, s_bm_k, kpm_ptr, seg_ptr, pos_ptr, SQ, SK, OFF, WL, WR, NG, BS,
               BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, BM_MODE: tl.constexpr,
               HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr,
               q_desc=None, do_desc=None, b32=0, h32=0, TMA: tl.constexpr = False):
    """Accumulate dK, dV of one key tile from query tile qt (transposed: rows are keys)."""
    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    # query rows past s_q: zero (TMA) or masked; their lse is +inf below, so p = 0 there
    q, do = _tile_pair(q_base, do_base, s_qm, s_dom, qt * BLOCK_M, offs_d, D, SQ, q_desc, do_desc, b32, h32, BLOCK_M,
                       k.shape[1], MASKED, EVEN_D, TMA)
    if MASKED:
        lse = tl.load(lse_base + offs_m, mask=offs_m < SQ, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < SQ, other=0.0)
        lse = tl.where(lse == float("-inf"), float("inf"), lse)      # fully masked rows: p = 0
    else:
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    st = tl.dot(k, tl.trans(q)) * qk_scale            # (keys, queries), log2 domain
    pt = tl.math.exp2(st - (lse * 1.4426950408889634)[None, :])
    if MASKED:
        ok = _allowed(offs_m, offs_n, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, seg_ptr, pos_ptr, SQ, SK, OFF, WL, WR, NG,
                      BS, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG)
        pt = tl.where(tl.trans(ok), pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dpt = tl.dot(v, tl.trans(do))                     # (keys, queries)
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _sparse_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, TROWS, TCOLS, BM, KPM, SEG, POS, q_desc, do_desc,
                 s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_db, s_dh, s_dm,
                 s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
                 s_rb, s_rh, s_rr, s_cb, s_ch, s_cr, s_bmb, s_bmh, s_bm_q, s_bm_k, s_kpmb,
                 H, HK, GROUP, SQ, SK, OFF, D, qk_scale, sm_scale, WL, WR, NG, BS,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, EVEN_D: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, BM_MODE: tl.constexpr,
                 HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr, LOOP: tl.constexpr, TMA: tl.constexpr = False):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < D)
    k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    kpm_ptr = KPM + b * s_kpmb
    for g in range(0, GROUP):                         # every query head sharing this kv head
        h = hk * GROUP + g
        q_base = Q + b * s_qb + h * s_qh
        do_base = DO + b * s_db + h * s_dh
        lse_base = LSE + (b * H + h) * SQ
        delta_base = DELTA + (b * H + h) * SQ
        bm_ptr = BM + b * s_bmb + h * s_bmh
        row = TROWS + b * s_rb + h * s_rh + pid_n * s_rr
        n_part = tl.load(row)
        n_all = tl.load(row + 1)
        cols = TCOLS + b * s_cb + h * s_ch + pid_n * s_cr
        # partial tiles (element masks); LOOP >= 1: each query tile id loaded one iteration ahead
        if LOOP == 0:
            for t in range(0, n_part):
                qt = tl.load(cols + t)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, s_qm, s_dm, lse_base, delta_base, qt, offs_n,
                                    offs_d, D, qk_scale, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL,
                                    WR, NG, BS, BLOCK_M, EVEN_D, True, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM,
                                    HAS_SEG, q_desc, do_desc, b, h, TMA)
        else:
            qt = tl.load(cols, mask=n_all > 0, other=0)
            for t in range(0, n_part):
                qt_next = tl.load(cols + t + 1, mask=t + 1 < n_all, other=0)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, s_qm, s_dm, lse_base, delta_base, qt, offs_n,
                                    offs_d, D, qk_scale, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL,
                                    WR, NG, BS, BLOCK_M, EVEN_D, True, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM,
                                    HAS_SEG, q_desc, do_desc, b, h, TMA)
                qt = qt_next
        # full tiles: no masks (prefetched ids / the run [cols[n_part], +n_full) / ids loaded in the loop)
        if LOOP == 1:
            for t in range(n_part, n_all):
                qt_next = tl.load(cols + t + 1, mask=t + 1 < n_all, other=0)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, s_qm, s_dm, lse_base, delta_base, qt, offs_n,
                                    offs_d, D, qk_scale, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL,
                                    WR, NG, BS, BLOCK_M, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM,
                                    HAS_SEG, q_desc, do_desc, b, h, TMA)
                qt = qt_next
        else:
            if LOOP == 2:
                run0 = tl.load(cols + n_part, mask=n_part < n_all, other=0) - n_part
            for t in range(n_part, n_all):
                if LOOP == 2:
                    qt = run0 + t
                else:
                    qt = tl.load(cols + t)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, s_qm, s_dm, lse_base, delta_base, qt, offs_n,
                                    offs_d, D, qk_scale, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL,
                                    WR, NG, BS, BLOCK_M, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM,
                                    HAS_SEG, q_desc, do_desc, b, h, TMA)
    tl.store(DK + b * s_dkb + hk * s_dkh + offs_n[:, None] * s_dkn + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * s_dvb + hk * s_dvh + offs_n[:, None] * s_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
             bm_ptr, s_bm_q, s_bm_k, kpm_ptr, seg_ptr, pos_ptr, SQ, SK, OFF, WL, WR, NG, BS,
             BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, BM_MODE: tl.constexpr,
             HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr,
             k_desc=None, v_desc=None, b32=0, hk32=0, TMA: tl.constexpr = False):
    """Accumulate dQ of one query tile from key tile kt."""
    offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    k, v = _tile_pair(k_base, v_base, s_kn, s_vn, kt * BLOCK_N, offs_d, D, SK, k_desc, v_desc, b32, hk32, BLOCK_N,
                      q.shape[1], MASKED, EVEN_D, TMA)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    if MASKED:
        ok = _allowed(offs_m, offs_n, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, seg_ptr, pos_ptr, SQ, SK, OFF, WL, WR, NG,
                      BS, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _sparse_dq(Q, K, V, DO, LSE, DELTA, DQ, ROWS, COLS, BM, KPM, SEG, POS, k_desc, v_desc,
               s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_db, s_dh, s_dm, s_dqb, s_dqh, s_dqm,
               s_rb, s_rh, s_rr, s_cb, s_ch, s_cr, s_bmb, s_bmh, s_bm_q, s_bm_k, s_kpmb,
               H, GROUP, SQ, SK, OFF, D, qk_scale, sm_scale, WL, WR, NG, BS,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, EVEN_D: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, BM_MODE: tl.constexpr,
               HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr, LOOP: tl.constexpr, TMA: tl.constexpr = False):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < D)
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_dm + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh * SQ + offs_m, mask=offs_m < SQ, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634   # masked rows: p = 0
    delta = tl.load(DELTA + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    bm_ptr = BM + b * s_bmb + h * s_bmh
    kpm_ptr = KPM + b * s_kpmb
    row = ROWS + b * s_rb + h * s_rh + pid_m * s_rr
    n_part = tl.load(row)
    n_all = tl.load(row + 1)
    cols = COLS + b * s_cb + h * s_ch + pid_m * s_cr
    dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    # partial tiles (element masks); LOOP >= 1: each key tile id loaded one iteration ahead
    if LOOP == 0:
        for t in range(0, n_part):
            kt = tl.load(cols + t)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
                          bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG, BS,
                          BLOCK_N, EVEN_D, True, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG,
                          k_desc, v_desc, b, hk, TMA)
    else:
        kt = tl.load(cols, mask=n_all > 0, other=0)
        for t in range(0, n_part):
            kt_next = tl.load(cols + t + 1, mask=t + 1 < n_all, other=0)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
                          bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG, BS,
                          BLOCK_N, EVEN_D, True, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG,
                          k_desc, v_desc, b, hk, TMA)
            kt = kt_next
    # full tiles: no masks (prefetched ids / the run [cols[n_part], +n_full) / ids loaded in the loop)
    if LOOP == 1:
        for t in range(n_part, n_all):
            kt_next = tl.load(cols + t + 1, mask=t + 1 < n_all, other=0)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
                          bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG, BS,
                          BLOCK_N, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG,
                          k_desc, v_desc, b, hk, TMA)
            kt = kt_next
    else:
        if LOOP == 2:
            run0 = tl.load(cols + n_part, mask=n_part < n_all, other=0) - n_part
        for t in range(n_part, n_all):
            if LOOP == 2:
                kt = run0 + t
            else:
                kt = tl.load(cols + t)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, s_kn, s_vn, kt, offs_m, offs_d, D, qk_scale,
                          bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SEG, POS, SQ, SK, OFF, WL, WR, NG, BS,
                          BLOCK_N, EVEN_D, False, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, HAS_SEG,
                          k_desc, v_desc, b, hk, TMA)
    tl.store(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqm + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# ---- host side -----------------------------------------------------------------------------------------
def _new(shape, dtype, device, bshd: bool = False) -> torch.Tensor:
    """Output buffers, NaN-filled under OPSADV_POISON_OUTPUTS=1 (tests: the kernels must write every
    element); bshd: (b, h, s, d) over (b, s, h, d) memory, the ops' boundary layout (out, dq, dk, dv)."""
    return new_output_bshd(shape, dtype, device) if bshd else new_output(shape, dtype, device)


def _compute_dtype(ctx, dtype: torch.dtype) -> torch.dtype:
    if dtype != torch.float32:
        return dtype
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[ctx.options["precision"].attention]


def _s4(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B|1, H|1, R, ...) index tensor; 0 on broadcast dims."""
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0, t.stride(2))


def _layout_args(ti, bm, kpm, q):
    """Pointer + stride arguments for the block mask / key padding / segment tables."""
    bm8, dummy = ti.bm8, ti.rows
    bm_s = (bm8.stride(0) if bm8.shape[0] > 1 else 0, bm8.stride(1) if bm8.shape[1] > 1 else 0,
            bm8.stride(2), bm8.stride(3))
    kpm8 = ti.kpm8 if ti.kpm8 is not None else dummy
    seg = ti.seg if ti.seg is not None else dummy
    pos = ti.pos if ti.pos is not None else dummy
    return (bm8, kpm8, seg, pos), (*bm_s, kpm8.stride(0) if ti.kpm8 is not None else 0)


def _flags(ti, causal, wl, ng, cu, kpm):
    return dict(CAUSAL=causal, HAS_WIN=wl >= 0, HAS_GLOBAL=ng > 0, BM_MODE=ti.bm_mode,
                HAS_KPM=kpm is not None, HAS_SEG=cu is not None)


def _prep(ctx, *ts):
    cd = _compute_dtype(ctx, ts[0].dtype)
    return [t.to(cd) if t.stride(-1) == 1 else t.to(cd).contiguous() for t in ts]


def _long_row_tile(profile, d, ti, block_n, cu, kpm):
    """The profile's long-row forward tile ("long_row" of its sparse tiles) when this layout qualifies, else None:
    only layouts whose full tiles are one run per row, without segments, key padding or a mixed block mask, whose
    rows visit at least the given mean number of keys.  Not when the profile pins bare tiles (benchmarks do), under
    the seed's tile_size, or during CUDA graph capture (ti.tiles = -1)."""
    own = (getattr(profile, "tiles", None) or {}).get(OP)
    cfg = own.get("long_row") if isinstance(own, dict) else None
    if cfg is None or d > 128 or (getattr(profile, "extra", None) or {}).get("tile_size"):
        return None
    if cu is not None or kpm is not None or ti.bm_mode == 2 or not ti.full_run or ti.tiles < 0:
        return None
    tile, min_keys = cfg
    n_rows = ti.rows.shape[0] * ti.rows.shape[1] * ti.rows.shape[2]
    return tile if ti.tiles * block_n >= min_keys * n_rows else None


def _is_band(ti, cu, kpm, wl, ng) -> bool:
    """Every row's allowed keys are one interval with non-decreasing ends (LOOP "band"): a window and/or causal
    over an all-True / all-False block mask, no globals, key padding or packed segments."""
    return cu is None and kpm is None and ng == 0 and (ti.bm_mode == 1 or (ti.bm_mode == 0 and wl >= 0))


def sparse_fwd(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks=False,
               max_seqlen=-1, *, variant=None):
    """variant (benchmarks): {"loop": one of LOOP_IDS, "reverse": bool, "tma": bool | "contiguous"} instead of
    FWD_DEFAULT ("tma": K/V through descriptors where tma_tiles_ok; see FWD_DEFAULT)."""
    in_dtype = q.dtype
    q, k, v = _prep(ctx, q, k, v)
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    (bm_m, bn_f, warps, stages, *fwd_flags), _, _ = tiles_for(ctx.profile, d)
    ti = tile_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk, bm_m, bn_f)
    long = _long_row_tile(ctx.profile, d, ti, bn_f, cu, kpm)
    if long is not None:
        bm_m, bn_f, warps, stages = long
        ti = tile_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk, bm_m, bn_f)
    opts = {**FWD_DEFAULT, **(variant or {})}
    loop = LOOP_IDS[opts["loop"]]
    if loop == 5 and variant is None and _narrow_band(ti, sq, sk, wl, wr, causal, bm_m, bn_f,
                                                      opts.get("persist_max_tiles", 0)):
        loop = 7
    if loop == 7 and (wl < 0 or ti.bm_mode != 0 or ti.tiles < 0 or long is not None):
        loop = 5    # persistent band: a window over an all-False block mask only (an all-True one has no bounded
        #             width), not under graph capture, not at the long-row tile (never measured there: the long
        #             rows are where "band" beat it)
    if loop >= 5 and not _is_band(ti, cu, kpm, wl, ng):
        loop = 4 if loop == 6 else 2                # not a band: the tile lists
    if loop in (2, 4) and not ti.full_run:          # full tiles not one run per row: the general list path
        loop = {2: 1, 4: 3}[loop]
    out = _new(q.shape, q.dtype, q.device, bshd=True)
    lse = _new((b, hq, sq), torch.float32, q.device)
    ptrs, strides = _layout_args(ti, block_mask, kpm, q)
    hd = max(16, triton.next_power_of_2(d))
    tma = opts.get("tma", False)
    if tma == "contiguous":
        tma = cu is None and kpm is None and ti.bm_mode != 2
    tma = bool(tma) and tma_tiles_ok(ctx, d, hd, k, v)
    k_desc, v_desc = (desc_bhsd(k, bn_f), desc_bhsd(v, bn_f)) if tma else (None, None)
    if loop == 7:
        _persist.launch(q, k, v, out, lse, ti, ptrs, strides, k_desc, v_desc, hq, hk, sq, sk, d, hd, scale * LOG2E, wl,
                        wr, bs, causal, (bm_m, bn_f, warps, stages), float(fwd_flags[0]) if fwd_flags else 0.0, tma)
        return out.to(in_dtype), lse
    grid = (triton.cdiv(sq, bm_m), b * hq)
    _sparse_fwd[grid](q, k, v, out, lse, ti.rows, ti.cols, *ptrs, k_desc, v_desc,
                      *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                      *_s4(ti.rows), *_s4(ti.cols), *strides,
                      hq, hq // hk, sq, sk, sk - sq, d, scale * LOG2E, wl, wr, ng, bs,
                      BLOCK_M=bm_m, BLOCK_N=bn_f, HEAD_D=hd, EVEN_D=hd == d, **_flags(ti, causal, wl, ng, cu, kpm),
                      RESCALE=float(fwd_flags[0]) if fwd_flags else 0.0, LOOP=loop, REVERSE=bool(opts["reverse"]),
                      TMA=tma, num_warps=warps, num_stages=stages)
    return out.to(in_dtype), lse


def _narrow_band(ti, sq: int, sk: int, wl: int, wr: int, causal: bool, bm_m: int, bn_f: int, most: int) -> bool:
    """A window over an all-False block mask (the layouts "band_persist" takes) at most `most` key tiles wide; not
    during graph capture (ti.tiles < 0: no host-side tile facts)."""
    if most <= 0 or wl < 0 or ti.bm_mode != 0 or ti.tiles < 0:
        return False
    return _persist.band_width_tiles(sq, sk, wl, wr, causal, bm_m, bn_f) <= most


def _bwd_loop(name: str, full_run: bool) -> int:
    loop = BWD_LOOP_IDS[name]
    return 1 if loop == 2 and not full_run else loop     # full tiles not one run: prefetched ids


def sparse_bwd(ctx, dout, q, k, v, out, lse, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale,
               dense_blocks=False, max_seqlen=-1, *, only=None, variant=None):
    """dq, dk, dv.  `only` ("dkdv" / "dq"; benchmarks) launches just one of the two main kernels;
    variant (benchmarks): {"dq": name, "dkdv": name} of BWD_LOOP_IDS, "tma", "streams" instead of BWD_DEFAULT."""
    opts = {**BWD_DEFAULT, **(variant or {})}
    in_dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, out, dout = _prep(ctx, q, k, v, out, dout)
    lse = lse.to(torch.float32).contiguous()
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    _, (qm, qn, qw, qs), (km, kn, kw, ks) = tiles_for(ctx.profile, d)
    hd = max(16, triton.next_power_of_2(d))
    delta = _new((b, hq, sq), torch.float32, q.device)
    _bwd_delta[(triton.cdiv(sq, 64), b * hq)](out, dout, delta, *out.stride()[:3], *dout.stride()[:3], hq, sq, d,
                                              BLOCK_M=64, HEAD_D=hd)
    common = dict(HEAD_D=hd, EVEN_D=hd == d)
    dq = _new(q.shape, q.dtype, q.device, bshd=True)
    dk = _new(k.shape, k.dtype, k.device, bshd=True)
    dv = _new(v.shape, v.dtype, v.device, bshd=True)
    ti = tile_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk, km, kn)      # the dK/dV kernel's tiles
    tma = opts.get("tma", False)
    if tma in ("contiguous", "no_mixed_mask"):
        tma = ti.bm_mode != 2 and (tma == "no_mixed_mask" or (cu is None and kpm is None))
    tma = bool(tma) and tma_tiles_ok(ctx, d, hd, q, k, v, dout)
    launches = []
    if only != "dq":
        ptrs, strides = _layout_args(ti, block_mask, kpm, q)
        q_desc, do_desc = (desc_bhsd(q, km), desc_bhsd(dout, km)) if tma else (None, None)
        launches.append(lambda: _sparse_dkdv[(triton.cdiv(sk, kn), b * hk)](
            q, k, v, dout, lse, delta, dk, dv, ti.t_rows, ti.t_cols, *ptrs, q_desc, do_desc,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3],
            *dv.stride()[:3], *_s4(ti.t_rows), *_s4(ti.t_cols), *strides,
            hq, hk, hq // hk, sq, sk, sk - sq, d, scale * LOG2E, scale, wl, wr, ng, bs,
            BLOCK_M=km, BLOCK_N=kn, **common, **_flags(ti, causal, wl, ng, cu, kpm),
            LOOP=_bwd_loop(opts["dkdv"], ti.t_full_run), TMA=tma, num_warps=kw, num_stages=ks))
    if only != "dkdv":
        ti_q = tile_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk, qm, qn)
        ptrs_q, strides_q = _layout_args(ti_q, block_mask, kpm, q)
        k_desc, v_desc = (desc_bhsd(k, qn), desc_bhsd(v, qn)) if tma else (None, None)
        launches.append(lambda: _sparse_dq[(triton.cdiv(sq, qm), b * hq)](
            q, k, v, dout, lse, delta, dq, ti_q.rows, ti_q.cols, *ptrs_q, k_desc, v_desc,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3],
            *_s4(ti_q.rows), *_s4(ti_q.cols), *strides_q,
            hq, hq // hk, sq, sk, sk - sq, d, scale * LOG2E, scale, wl, wr, ng, bs,
            BLOCK_M=qm, BLOCK_N=qn, **common, **_flags(ti_q, causal, wl, ng, cu, kpm),
            LOOP=_bwd_loop(opts["dq"], ti_q.full_run), TMA=tma, num_warps=qw, num_stages=qs))
    if opts.get("streams") and len(launches) == 2 and q.device.type == "cuda":
        run_side_by_side(q.device, launches[0], launches[1])
    else:
        for launch in launches:
            launch()
    return dq.to(in_dtypes[0]), dk.to(in_dtypes[1]), dv.to(in_dtypes[2])


def _check(spec: CallSpec, env) -> list[str]:
    why = []
    cdt = spec.dtype
    if spec.dtype == torch.float32:
        prec = current_policy().precision.attention
        if prec not in ("fp16", "bf16"):
            why.append("float32 inputs need precision policy attention='fp16' or 'bf16' (tensor-core kernel)")
        cdt = torch.bfloat16 if prec == "bf16" else torch.float16
    why.extend(interpreter_bf16_reasons(spec, cdt))
    why.extend(refinement_reasons(spec, 16))
    return why


def refinement_reasons(spec: CallSpec, tile: int) -> list[str]:
    """The tile classifier refines the block mask to gcd(block_size, tile) cells: too many cells
    (a block size that shares no large factor with the tile) is refused with the numbers."""
    bs = spec.bucket[0]
    sq, sk = spec.shapes[0][2], spec.shapes[1][2]
    g = math.gcd(bs, tile)
    cells = -(-sq // g) * -(-sk // g)
    if cells <= MAX_REFINE_CELLS:
        return []
    return [f"layout block_size {bs}: classifying {sq}x{sk} into {tile}-tiles at granularity {g} needs "
            f"{cells} cells (> {MAX_REFINE_CELLS}); use a block size that is a multiple of 16"]


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.sparse_attention", op=OP, backend=backend, fn=sparse_fwd, backward=sparse_bwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), head_dims=HEAD_DIMS, features=FEATURES,
        deterministic=True, requires_interpret_or_cuda=True, check=_check, memory=MEMORY_FLASH,
        honours=frozenset({"attention"}),     # its tiles are its own (no profile tiles to cap)
        description="Triton block-sparse flash attention: visits only the layout's non-empty tiles "
                    "(partial tiles element-masked), packed varlen, GQA; dK/dV and dQ kernels without atomics")]
