"""Triton helpers of the sparse-attention forward kernels that both sparse.py's kernels and the persistent
band kernel (band_persist.py) call: the element mask, the online-softmax step, K/V tile loads, the
epilogue, and the band tile classification."""
from __future__ import annotations

import triton
import triton.language as tl

from ..utils import load_tile


# ---- element mask of one (BLOCK_M x BLOCK_N) tile ---------------------------------------------------
@triton.jit
def _allowed(offs_m, offs_n, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, seg_ptr, pos_ptr, SQ, SK, OFF, WL, WR, NG, BS,
             CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, BM_MODE: tl.constexpr,
             HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr, INTERVAL: tl.constexpr = False):
    """allowed(i, j) as opsadv.ops.sparse_attention.layout defines it, for rows offs_m and columns offs_n.  INTERVAL (the
    forward kernels): band layouts (a window and/or causal over an all-True or all-False block mask; no globals,
    key padding or segments) take the same mask as one key interval [lo_i, hi_i] per row, two compares per
    element instead of the predicate chain (the Gluon kernel's interval mask: 0.680 vs 0.726 ms at s16384 w1024
    on the H200).  The backward keeps the predicate: there the intervals cost registers (sm_90 compile of
    _sparse_dkdv: 56 -> 60 B of spills)."""
    if INTERVAL and BM_MODE != 2 and not HAS_GLOBAL and not HAS_KPM and not HAS_SEG:
        ip = offs_m + OFF                                # bottom-right aligned query position
        if BM_MODE == 1:
            lo = tl.zeros_like(ip)                       # every block allowed (the window adds nothing)
        elif HAS_WIN:
            lo = ip - WL
        else:
            lo = tl.zeros_like(ip) + SK                  # no block, no window: nothing
        hi = tl.zeros_like(ip) + (SK - 1)
        if BM_MODE == 0 and HAS_WIN:
            hi = tl.minimum(hi, ip + WR)
        if CAUSAL:
            hi = tl.minimum(hi, ip)
        hi = tl.where(offs_m < SQ, hi, -1)              # rows past s_q: nothing
        j = offs_n[None, :]
        ok = (j >= lo[:, None]) & (j <= hi[:, None])
    else:
        i = offs_m[:, None]
        j = offs_n[None, :]
        ip = i + OFF                                     # bottom-right aligned query position
        inb = (i < SQ) & (j < SK)
        if BM_MODE == 2:                                 # mixed block mask: gather its bit per element
            ok = tl.load(bm_ptr + (i // BS) * s_bm_q + (j // BS) * s_bm_k, mask=inb, other=0) != 0
        else:
            ok = inb & (BM_MODE == 1)
        if HAS_WIN:
            ok = ok | ((j >= ip - WL) & (j <= ip + WR))
        if HAS_GLOBAL:
            if HAS_SEG:                                  # globals count from each packed sequence's start
                pi = tl.load(pos_ptr + offs_m, mask=offs_m < SQ, other=NG)
                pj = tl.load(pos_ptr + offs_n, mask=offs_n < SK, other=NG)
                ok = ok | (pi[:, None] < NG) | (pj[None, :] < NG)
            else:
                ok = ok | (i < NG) | (j < NG)
        if CAUSAL:
            ok = ok & (j <= ip)
        if HAS_SEG:
            si = tl.load(seg_ptr + offs_m, mask=offs_m < SQ, other=-1)
            sj = tl.load(seg_ptr + offs_n, mask=offs_n < SK, other=-2)
            ok = ok & (si[:, None] == sj[None, :])
        if HAS_KPM:
            ok = ok & (tl.load(kpm_ptr + offs_n, mask=offs_n < SK, other=0) != 0)[None, :]
        ok = ok & inb
    return ok


# ---- forward steps -----------------------------------------------------------------------------------
@triton.jit
def _softmax_step(acc, l_i, m_i, s, v, qk_scale, GUARD: tl.constexpr, RESCALE: tl.constexpr):
    """Fold raw scores s (-inf where masked) and their V tile into the running (acc, l_i, m_i) (log2
    domain).  GUARD: a row may have seen only masked keys so far (max -inf): keep exp2 finite."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if RESCALE > 0:  # keep the old reference max unless it grew by more than RESCALE (p <= 2^RESCALE)
        m_new = tl.where(m_new - m_i > RESCALE, m_new, m_i)      # both -inf: NaN > x is false, keeps -inf
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s * qk_scale - m_use[:, None])   # scale and shift in one FMA
    alpha = tl.math.exp2(m_i - m_use)                # rescale of the running sums (0 when m_i = -inf)
    if RESCALE > 0:
        if tl.max((m_new > m_i).to(tl.int32), 0) > 0:   # only when some row's reference moved
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)              # accumulate in the MMA
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit
def _kv_tile_unmasked(k_base, v_base, s_kn, s_vn, kt, offs_d, SK, D, k_desc, v_desc, b32, hk32, BLOCK_N: tl.constexpr,
                      HEAD_D: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """K and V of key tile kt without a row mask (the one-loop variants): through descriptors (rows past s_k read
    zero) or pointers clamped to the last key (that key re-read); the element mask of a partial tile drops both."""
    if TMA:
        k = k_desc.load([b32, hk32, kt * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_D)
        v = v_desc.load([b32, hk32, kt * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_D)
    else:
        rows_kv = tl.minimum(kt * BLOCK_N + tl.arange(0, BLOCK_N), SK - 1)
        k = load_tile(k_base + rows_kv[:, None] * s_kn + offs_d[None, :], rows_kv, SK, offs_d, D, False, not EVEN_D)
        v = load_tile(v_base + rows_kv[:, None] * s_vn + offs_d[None, :], rows_kv, SK, offs_d, D, False, not EVEN_D)
    return k, v


@triton.jit
def _fwd_finish(acc, l_i, m_i, O, LSE, b, h, bh, s_ob, s_oh, s_om, offs_m, offs_d, SQ, D):
    """out = acc / l and lse (natural log) of one row tile; a row with no allowed key gets zeros and lse = -inf."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < D))
    tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=offs_m < SQ)


@triton.jit
def _band_tiles(pid_m, SQ, SK, OFF, WL, WR, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                BM_MODE: tl.constexpr):
    """Key tiles of row tile pid_m in a band layout: row i allows [lo(i), hi(i)] (BM_MODE 1: [0, s_k); else the
    window [i' - WL, i' + WR], i' = i + OFF; causal caps hi at i'), both ends non-decreasing in i.  Tiles meeting
    [lo(r0), hi(r1)] are visited; those inside [lo(r1), hi(r0)] are full (every row allows every key), the
    rest of the visited ones are masked: (lo tile, its count), (first full tile, count), (first tile above
    the full ones, count).  Rows past s_q may share a full tile: they compute and are never stored."""
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, SQ) - 1
    if BM_MODE == 1:
        lo0 = r0 * 0
        lo1 = lo0
        hi0 = lo0 + SK - 1
        hi1 = hi0
    else:
        lo0 = tl.maximum(r0 + OFF - WL, 0)
        lo1 = tl.maximum(r1 + OFF - WL, 0)
        hi0 = tl.minimum(r0 + OFF + WR, SK - 1)
        hi1 = tl.minimum(r1 + OFF + WR, SK - 1)
    if CAUSAL:
        hi0 = tl.minimum(hi0, r0 + OFF)
        hi1 = tl.minimum(hi1, r1 + OFF)
    kt_lo = lo0 // BLOCK_N
    n_vis = tl.where(hi1 >= lo0, hi1 // BLOCK_N - kt_lo + 1, 0)        # hi1 >= lo0 >= 0: no negative division
    full_lo = tl.maximum((lo1 + BLOCK_N - 1) // BLOCK_N, kt_lo)
    full_hi = tl.minimum(tl.maximum(hi0 + 1, 0) // BLOCK_N - 1, kt_lo + n_vis - 1)
    n_full = tl.maximum(full_hi - full_lo + 1, 0)
    n_low = tl.where(n_full > 0, full_lo - kt_lo, n_vis)                 # no full tile: all of them masked
    return kt_lo, n_low, full_lo, n_full, full_lo + n_full, n_vis - n_low - n_full
