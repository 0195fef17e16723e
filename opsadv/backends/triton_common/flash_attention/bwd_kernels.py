"""Triton kernels of the flash-attention backward (FlashAttention-2 scheme; the host side is attention.py).

A preprocess kernel (delta = rowsum(dO * O), lse in log2 units); a dK/dV kernel (one program per kv block and kv
head, looping over the q blocks of every q head of its group, so GQA's sum over the group happens in registers --
or, SPLIT, one program per kv block and q head with the group's shares added by _bwd_group_sum_kernel;
optionally dQ by fp32 atomics, or dS^T written to a workspace for dq_gemm.py's dQ GEMM); a dQ kernel (one
program per q block, looping over kv blocks, recomputing S and dP).  With TMA the streamed tiles come through
(b, h, s, d) descriptors."""
from __future__ import annotations

import triton
import triton.language as tl

from ..utils import load_tile, store_tile


@triton.jit
def _head_tile(base, off_b, off_h, s_b, s_h, offs_r, s_r, offs_d, n_r, HEAD_DIM: tl.constexpr, MASK_R: tl.constexpr,
               PAD_D: tl.constexpr):
    """Rows offs_r (x head dim) of head (off_b, off_h) of a (b, h, s, d) strided tensor; zeros past n_r / HEAD_DIM."""
    return load_tile(base + off_b.to(tl.int64) * s_b + off_h.to(tl.int64) * s_h + offs_r[:, None] * s_r + offs_d[None, :],
                     offs_r, n_r, offs_d, HEAD_DIM, MASK_R, PAD_D)


@triton.jit
def _bwd_pre_kernel(O, DO, LSE, DELTA, LSE2, s_ob, s_oh, s_om, s_db, s_dh, s_dm, H, SQ,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _head_tile(O, off_b, off_h, s_ob, s_oh, offs_m, s_om, offs_d, SQ, HEAD_DIM, True, BLOCK_D != HEAD_DIM)
    do = _head_tile(DO, off_b, off_h, s_db, s_dh, offs_m, s_dm, offs_d, SQ, HEAD_DIM, True, BLOCK_D != HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = pid_bh.to(tl.int64) * SQ + offs_m
    lse = tl.load(LSE + row, mask=offs_m < SQ, other=0.0)
    # log2 units; an empty row (lse = -inf) becomes +inf so that every p = exp2(s - lse2) is 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + row, delta, mask=offs_m < SQ)
    tl.store(LSE2 + row, lse2, mask=offs_m < SQ)


@triton.jit
def _bwd_kv_inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, off_b, off_h, L, D, DQA, dq_desc, bh, s_qm, s_dm,
                  offs_n, offs_d, lo, hi, SQ, SK, OFFSET, qk_scale, scale, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, PAD_D: tl.constexpr, MASKED: tl.constexpr, EVEN_M: tl.constexpr,
                  EVEN_N: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, TMA: tl.constexpr,
                  DS, ds_slab, s_dss, s_dsn, n0, DS_STORE: tl.constexpr, DS_TMA: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if TMA:  # (b, h, s_q, d) descriptors: rows past s_q come back zero, no address math in the GEMM warps
            q = q_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
            do = do_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        else:
            q = load_tile(q_base + offs_m[:, None] * s_qm + offs_d[None, :], offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M,
                          PAD_D)
            do = load_tile(do_base + offs_m[:, None] * s_dm + offs_d[None, :], offs_m, SQ, offs_d, HEAD_DIM,
                           not EVEN_M, PAD_D)
        if EVEN_M:
            lse2 = tl.load(L + offs_m)
            delta = tl.load(D + offs_m)
        else:  # rows past s_q: lse2 = +inf makes their p exactly 0
            lse2 = tl.load(L + offs_m, mask=offs_m < SQ, other=float("inf"))
            delta = tl.load(D + offs_m, mask=offs_m < SQ, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])    # P^T: (BLOCK_N, BLOCK_M)
        if MASKED:  # causal diagonal band: key j visible to query i iff j <= i + OFFSET
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + OFFSET, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        if DS_STORE:  # dS^T kept for the dQ GEMM (dq_gemm.py): keys past s_k stored as 0, not p * (0 - delta)
            if not EVEN_N:
                ds_t = tl.where(offs_n[:, None] < SK, ds_t, 0.0)
            ds_h = ds_t.to(q.dtype)
            if DS_TMA:  # through shared memory by one bulk copy (registers freed at the copy-in)
                DS.store([ds_slab, n0, start_m], ds_h.reshape([1, ds_h.shape[0], ds_h.shape[1]]))
            else:       # the workspace is padded to whole tiles of both kernels: no store mask
                tl.store(DS + ds_slab.to(tl.int64) * s_dss + offs_n[:, None] * s_dsn + offs_m[None, :], ds_h)
            dk += tl.dot(ds_h, q)
        else:
            dk += tl.dot(ds_t.to(q.dtype), q)
        if ATOMIC_DQ:  # this kv block's share of dQ, reduced across kv blocks in fp32 (order varies: not deterministic)
            if not EVEN_N:  # keys past s_k: k is 0 there, but p could be inf, and inf * 0 is NaN
                ds_t = tl.where(offs_n[:, None] < SK, ds_t, 0.0)
            dq_part = tl.dot(tl.trans(ds_t.to(k.dtype)), k) * scale
            if DQ_TMA:  # one bulk reduce-add of the whole tile (TMA, done in L2; rows past s_q are clipped by the
                        # (b*h, s_q, d) descriptor's bounds) instead of BLOCK_M * HEAD_DIM atomics from registers
                dq_desc.atomic_add([bh, start_m, 0], dq_part.reshape([1, BLOCK_M, HEAD_DIM]))
            else:
                dqa_ptrs = DQA + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
                if EVEN_M and not PAD_D:
                    tl.atomic_add(dqa_ptrs, dq_part, sem="relaxed")
                else:
                    tl.atomic_add(dqa_ptrs, dq_part, sem="relaxed",
                                  mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM))
    return dk, dv


@triton.jit
def _bwd_kv_q_head(dk, dv, k, v, Q, DO, LSE2, DELTA, DQA, dq_desc, q_desc, do_desc, off_b, off_hk, g, local,
                   s_qb, s_qh, s_qm, s_db, s_dh, s_dm, H, GROUP, SQ, SK, OFFSET, qk_scale, scale, offs_n, offs_d,
                   m_lo, m_mid, sq_pad, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PAD_D: tl.constexpr,
                   EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
                   TMA: tl.constexpr, DS, s_dss, s_dsn, n0, DS_STORE: tl.constexpr, DS_TMA: tl.constexpr):
    """dK / dV of one kv block += the share of q head g of its group: the causal band's masked q blocks
    [m_lo, m_mid), then the unmasked ones up to sq_pad."""
    off_h = off_hk * GROUP + g
    q_base = Q + off_b.to(tl.int64) * s_qb + off_h.to(tl.int64) * s_qh
    do_base = DO + off_b.to(tl.int64) * s_db + off_h.to(tl.int64) * s_dh
    row0 = (off_b * H + off_h).to(tl.int64) * SQ
    dqa = DQA + row0 * HEAD_DIM                             # fp32 dQ accumulator (b, h_q, s_q, d), contiguous
    bh = off_b * H + off_h                                  # this q head's slab of the dQ descriptor
    ds_slab = local * GROUP + g                             # this q head's slab of the dS workspace
    dk, dv = _bwd_kv_inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, off_b, off_h, LSE2 + row0,
                           DELTA + row0, dqa, dq_desc, bh, s_qm, s_dm, offs_n, offs_d, m_lo, m_mid, SQ, SK,
                           OFFSET, qk_scale, scale, HEAD_DIM, BLOCK_M, PAD_D, True, EVEN_M, EVEN_N, ATOMIC_DQ,
                           DQ_TMA, TMA, DS, ds_slab, s_dss, s_dsn, n0, DS_STORE, DS_TMA)
    dk, dv = _bwd_kv_inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, off_b, off_h, LSE2 + row0,
                           DELTA + row0, dqa, dq_desc, bh, s_qm, s_dm, offs_n, offs_d, m_mid, sq_pad, SQ, SK,
                           OFFSET, qk_scale, scale, HEAD_DIM, BLOCK_M, PAD_D, False, EVEN_M, EVEN_N, ATOMIC_DQ,
                           DQ_TMA, TMA, DS, ds_slab, s_dss, s_dsn, n0, DS_STORE, DS_TMA)
    return dk, dv


@triton.jit
def _bwd_kv_kernel(Q, K, V, DO, DK, DV, LSE2, DELTA, DQA, dq_desc, q_desc, do_desc,
                   s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_db, s_dh, s_dm,
                   s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
                   H, GROUP, SQ, SK, OFFSET, qk_scale, scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                   DQ_TMA: tl.constexpr = False, TMA: tl.constexpr = False,
                   DS=None, s_dss=0, s_dsn=0, BHK0=0, DS_STORE: tl.constexpr = False, DS_TMA: tl.constexpr = False,
                   LPT: tl.constexpr = False, s_dkg=0, s_dvg=0, SPLIT: tl.constexpr = False):
    """DS_STORE: also write dS^T (key rows, query columns; q's dtype) of q head slab (program_id(1) * GROUP + g)
    into the workspace DS, for a chunk of kv heads starting at BHK0 (the dQ GEMM of dq_gemm.py reads it);
    DS_TMA: DS is a (slabs, s_k, s_q) descriptor of (1, BLOCK_N, BLOCK_M) blocks.
    SPLIT (GQA): one program per kv block and q head instead of per kv block and kv head (GROUP times as many,
    GROUP times shorter programs: a chunk of one kv head is GROUP times wider); each writes its q head's share
    of dK / dV (fp32) into DK / DV = this launch's (GROUP, kv heads, s_k, d) shares, and _bwd_group_sum_kernel
    adds the GROUP shares in order.
    LPT: grid (kv heads, kv blocks) instead of (kv blocks, kv heads): the launch order walks every head's first kv
    block before any head's second, so with causal masking (the first kv blocks see the most q rows) the longest
    programs start first and the short ones fill the last wave (longest-processing-time-first)."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    unit = tl.program_id(0) if LPT else tl.program_id(1)   # kv head (q head with SPLIT) within this launch (chunk)
    pid_n = tl.program_id(1) if LPT else tl.program_id(0)
    if SPLIT:
        local = unit // GROUP
        g_lo = unit % GROUP
    else:
        local = unit
        g_lo = unit * 0
    pid_bhk = local + BHK0
    HKV = H // GROUP
    off_b = pid_bhk // HKV
    off_hk = pid_bhk % HKV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _head_tile(K, off_b, off_hk, s_kb, s_kh, offs_n, s_kn, offs_d, SK, HEAD_DIM, not EVEN_N, PAD_D)
    v = _head_tile(V, off_b, off_hk, s_vb, s_vh, offs_n, s_vn, offs_d, SK, HEAD_DIM, not EVEN_N, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    sq_pad = tl.cdiv(SQ, BLOCK_M) * BLOCK_M
    if CAUSAL:
        m_lo = tl.minimum((tl.maximum(n0 - OFFSET, 0) // BLOCK_M) * BLOCK_M, sq_pad)   # first row seeing key n0
        m_mid = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - OFFSET, 0), BLOCK_M) * BLOCK_M   # rows from here see all keys
        m_mid = tl.minimum(tl.maximum(m_mid, m_lo), sq_pad)
    else:
        m_lo = 0
        m_mid = 0
    if SPLIT:   # one q head, no loop: the registers of a grouped program's loop were spills (tests: sm_90 compile)
        dk, dv = _bwd_kv_q_head(dk, dv, k, v, Q, DO, LSE2, DELTA, DQA, dq_desc, q_desc, do_desc, off_b, off_hk, g_lo,
                                local, s_qb, s_qh, s_qm, s_db, s_dh, s_dm, H, GROUP, SQ, SK, OFFSET, qk_scale, scale,
                                offs_n, offs_d, m_lo, m_mid, sq_pad, HEAD_DIM, BLOCK_M, PAD_D, EVEN_M, EVEN_N,
                                ATOMIC_DQ, DQ_TMA, TMA, DS, s_dss, s_dsn, n0, DS_STORE, DS_TMA)
    else:
        for g in range(GROUP):                              # GQA: the q heads sharing this kv head
            dk, dv = _bwd_kv_q_head(dk, dv, k, v, Q, DO, LSE2, DELTA, DQA, dq_desc, q_desc, do_desc, off_b, off_hk,
                                    g, local, s_qb, s_qh, s_qm, s_db, s_dh, s_dm, H, GROUP, SQ, SK, OFFSET, qk_scale,
                                    scale, offs_n, offs_d, m_lo, m_mid, sq_pad, HEAD_DIM, BLOCK_M, PAD_D, EVEN_M,
                                    EVEN_N, ATOMIC_DQ, DQ_TMA, TMA, DS, s_dss, s_dsn, n0, DS_STORE, DS_TMA)
    dk = dk * scale
    if SPLIT:   # this launch's shares: (GROUP, its kv heads, s_k, d), indexed by the kv head within the launch
        dk_base = DK + g_lo.to(tl.int64) * s_dkg + local.to(tl.int64) * s_dkh
        dv_base = DV + g_lo.to(tl.int64) * s_dvg + local.to(tl.int64) * s_dvh
    else:
        dk_base = DK + off_b.to(tl.int64) * s_dkb + off_hk.to(tl.int64) * s_dkh
        dv_base = DV + off_b.to(tl.int64) * s_dvb + off_hk.to(tl.int64) * s_dvh
    store_tile(dk_base + offs_n[:, None] * s_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), offs_n, SK, offs_d,
               HEAD_DIM, not EVEN_N, PAD_D)
    store_tile(dv_base + offs_n[:, None] * s_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), offs_n, SK, offs_d,
               HEAD_DIM, not EVEN_N, PAD_D)


@triton.jit
def _bwd_group_sum_kernel(DKP, DVP, DK, DV, s_pg, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, HKV, GROUP, SK, BHK0,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK / dV of kv head BHK0 + program_id(1) = the sum of its GROUP q heads' fp32 shares (_bwd_kv_kernel with
    SPLIT; this launch's (GROUP, kv heads, s_k, d), contiguous per share), added in the order g = 0, 1, ...:
    deterministic."""
    local = tl.program_id(1)
    pid_bhk = local + BHK0
    off_b = pid_bhk // HKV
    off_hk = pid_bhk % HKV
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_n < SK)[:, None] & (offs_d < HEAD_DIM)[None, :]
    share = (local.to(tl.int64) * SK + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    pk = DKP + share
    pv = DVP + share
    for _ in range(GROUP):                                  # g = 0, 1, ...: one share per step (64-bit pointers)
        dk += tl.load(pk, mask=mask, other=0.0)
        dv += tl.load(pv, mask=mask, other=0.0)
        pk += s_pg
        pv += s_pg
    dk_base = DK + off_b.to(tl.int64) * s_dkb + off_hk.to(tl.int64) * s_dkh
    dv_base = DV + off_b.to(tl.int64) * s_dvb + off_hk.to(tl.int64) * s_dvh
    store_tile(dk_base + offs_n[:, None] * s_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), offs_n, SK, offs_d,
               HEAD_DIM, True, BLOCK_D != HEAD_DIM)
    store_tile(dv_base + offs_n[:, None] * s_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), offs_n, SK, offs_d,
               HEAD_DIM, True, BLOCK_D != HEAD_DIM)


@triton.jit
def _bwd_q_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, off_b, off_hk, s_kn, s_vn, offs_m, offs_d,
                 lo, hi, SK, OFFSET, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                 CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:  # (b, h_kv, s_k, d) descriptors: keys past s_k come back zero
            k = k_desc.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            v = v_desc.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k = load_tile(k_base + offs_n[:, None] * s_kn + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, MASKED,
                          PAD_D)
            v = load_tile(v_base + offs_n[:, None] * s_vn + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, MASKED,
                          PAD_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASKED:
            keep = offs_n[None, :] < SK
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
            p = tl.where(keep, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def key_range(m0, SK, OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(n_full, hi) for the query tile at m0: keys [0, n_full) are visible to every row of the tile in whole
    BLOCK_N tiles (no mask), keys [n_full, hi) need the element mask (causal diagonal band, keys past s_k)."""
    if CAUSAL:
        hi = tl.maximum(tl.minimum(SK, m0 + BLOCK_M + OFFSET), 0)
        n_full = tl.maximum(tl.minimum(SK, m0 + OFFSET + 1), 0)
    else:
        hi = SK
        n_full = SK
    return (n_full // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _bwd_q_kernel(Q, K, V, DO, DQ, LSE2, DELTA, k_desc, v_desc,
                  s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_db, s_dh, s_dm, s_dqb, s_dqh, s_dqm,
                  H, GROUP, SQ, SK, OFFSET, qk_scale, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr = False):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _head_tile(Q, off_b, off_h, s_qb, s_qh, offs_m, s_qm, offs_d, SQ, HEAD_DIM, not EVEN_M, PAD_D)
    do = _head_tile(DO, off_b, off_h, s_db, s_dh, offs_m, s_dm, offs_d, SQ, HEAD_DIM, not EVEN_M, PAD_D)
    row = pid_bh.to(tl.int64) * SQ + offs_m
    lse2 = tl.load(LSE2 + row, mask=offs_m < SQ, other=float("inf"))
    delta = tl.load(DELTA + row, mask=offs_m < SQ, other=0.0)
    k_base = K + off_b.to(tl.int64) * s_kb + off_hk.to(tl.int64) * s_kh
    v_base = V + off_b.to(tl.int64) * s_vb + off_hk.to(tl.int64) * s_vh
    n_full, hi = key_range(m0, SK, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _bwd_q_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, off_b, off_hk, s_kn, s_vn, offs_m,
                      offs_d, 0, n_full, SK, OFFSET, qk_scale, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, False, TMA)
    dq = _bwd_q_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, off_b, off_hk, s_kn, s_vn, offs_m,
                      offs_d, n_full, hi, SK, OFFSET, qk_scale, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, True, TMA)
    dq = dq * scale
    store_tile(DQ + off_b.to(tl.int64) * s_dqb + off_h.to(tl.int64) * s_dqh + offs_m[:, None] * s_dqm + offs_d[None, :],
               dq.to(DQ.dtype.element_ty), offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
