"""Triton kernels of the FP8 attention backward (fp8_attention.py's fp8_bwd; FlashAttention-2 scheme, as
flash_attention's bwd_kernels.py, whose preprocess kernel -- delta = rowsum(dO * O), lse in log2 units -- it reuses).

Inputs: e4m3 q8, k8, v8 with their float32 descales (per tensor or per (batch, head); q's may be per kv head), the
forward's out and lse, dO in bf16 / fp16 (the "half" dtype below).  Per tile pair the five GEMMs are

  S   = q8 k8^T           FP8 (e4m3 x e4m3, float32 accumulation): exact products of the saved operands; the
                          descales and the softmax scale fold into the exp2 argument, P = exp2(S * qk_scale - lse2)
  dV += P^T dO            half: P rounded to the half dtype (as in the bf16 backward)
  dP  = dO v8^T           half: v8 converted to the half dtype exactly (every e4m3 value is a bf16 / fp16 value);
                          v_descale applied in float32, in the FMA dS = P * (dP * v_descale - delta)
  dK += dS^T q8           half: dS rounded to the half dtype, q8 converted exactly; q_descale and the softmax scale
                          applied to the float32 accumulator
  dQ += dS k8             half: likewise, k_descale and the softmax scale applied at the end

Why only S runs in FP8 (the error budget, docs/fp8.md): rounding P, dO or dS to e4m3 costs ~2.5% rms per element
(3 mantissa bits, whatever the scaling), and that error does not average out of a GEMM's result relative to its
norm.  Emulated in float64 (b1 h2 s1024 d128, causal and not), the gradients' error against float64 autograd of the
dequantized attention, as a multiple of the bf16 backward's (0.3-0.7%): P in e4m3 for dV 8-14x (dV), dO in e4m3
for dP 4-9x (per head or per row scale; e5m2 10-17x) (dQ, dK), dS in e4m3 per 64x64 block for dQ / dK 4-8x (e5m2
8-16x), against the issue's 2x.  The saved operands q8, k8, v8 are exact in every GEMM, so this backward's error
is 0.7-0.9x the bf16 backward's (which rounds the dequantized q, k, v to bf16).

dK/dV kernel: one program per kv block and kv head (grid order LPT: kv heads first), looping over the q blocks of
every q head of its GQA group (the group's sum in registers; a per-q-head q_descale is folded in by rescaling the
dK accumulator when the head changes, so the loop keeps the accumulating dot form).  dQ kernel: one program per
q block and q head, looping over kv blocks.  The two run side by side on a GPU (no shared outputs).  TMA (config
flag, Hopper or the interpreter): the streamed tiles (q8 / dO in the dK/dV kernel, k8 / v8 in the dQ kernel) come
through (b, h, s, d) descriptors, as in flash_attention's backward."""
from __future__ import annotations

import triton
import triton.language as tl

from ..utils import load_tile, store_tile


@triton.jit
def _fp8_bwd_kv_inner(dk, dv, k8, v_h, q_base, do_base, q_desc, do_desc, off_b, off_h, L, D, s_qm, s_dm, offs_n,
                      offs_d, lo, hi, SQ, OFFSET, qk_scale, v_descale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      PAD_D: tl.constexpr, MASKED: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr):
    """dK (in units of this q head's q_descale) and dV of one kv block += the q blocks [lo, hi) of one q head;
    MASKED: the causal diagonal band.  TMA: q / dO tiles through (b, h, s, d) descriptors (rows past s_q: zero)."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if TMA:
            q8 = q_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
            do = do_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        else:
            q8 = load_tile(q_base + offs_m[:, None] * s_qm + offs_d[None, :], offs_m, SQ, offs_d, HEAD_DIM,
                           not EVEN_M, PAD_D)
            do = load_tile(do_base + offs_m[:, None] * s_dm + offs_d[None, :], offs_m, SQ, offs_d, HEAD_DIM,
                           not EVEN_M, PAD_D)
        if EVEN_M:
            lse2 = tl.load(L + offs_m)
            delta = tl.load(D + offs_m)
        else:   # rows past s_q: lse2 = +inf makes their p exactly 0
            lse2 = tl.load(L + offs_m, mask=offs_m < SQ, other=float("inf"))
            delta = tl.load(D + offs_m, mask=offs_m < SQ, other=0.0)
        p_t = tl.math.exp2(tl.dot(k8, tl.trans(q8)) * qk_scale - lse2[None, :])     # FP8 S^T, (BLOCK_N, BLOCK_M)
        if MASKED:  # key j visible to query i iff j <= i + OFFSET
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + OFFSET, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v_h, tl.trans(do))
        ds_t = p_t * (dp_t * v_descale - delta[None, :])
        dk = tl.dot(ds_t.to(do.dtype), q8.to(do.dtype), dk)
    return dk, dv


@triton.jit
def fp8_bwd_kv_kernel(Q, K, V, DO, DK, DV, LSE2, DELTA, QD, KD, VD, q_desc, do_desc,
                      s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_db, s_dh, s_dm,
                      s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, s_qdb, s_qdh, s_kdb, s_kdh, s_vdb, s_vdh,
                      H, GROUP, Q_DESCALE_GROUP, SQ, SK, OFFSET, sm_scale_log2, scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, LPT: tl.constexpr,
                      TMA: tl.constexpr):
    """Grid (kv blocks, b * h_kv), or with LPT (b * h_kv, kv blocks): every head's first (with causal masking, the
    longest) kv block launches before any head's second.  TMA: the streamed q / dO tiles through the descriptors
    q_desc / do_desc."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_bhk = tl.program_id(0) if LPT else tl.program_id(1)
    pid_n = tl.program_id(1) if LPT else tl.program_id(0)
    HKV = H // GROUP
    off_b = pid_bhk // HKV
    off_hk = pid_bhk % HKV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k8 = load_tile(K + off_b.to(tl.int64) * s_kb + off_hk.to(tl.int64) * s_kh + offs_n[:, None] * s_kn
                   + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, not EVEN_N, PAD_D)
    v8 = load_tile(V + off_b.to(tl.int64) * s_vb + off_hk.to(tl.int64) * s_vh + offs_n[:, None] * s_vn
                   + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, not EVEN_N, PAD_D)
    v_h = v8.to(DO.dtype.element_ty)                      # exact: e4m3 values are bf16 / fp16 values
    kd = tl.load(KD + off_b * s_kdb + off_hk * s_kdh)
    vd = tl.load(VD + off_b * s_vdb + off_hk * s_vdh)
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
    qd_prev = 1.0
    for g in range(GROUP):                                # GQA: the q heads sharing this kv head
        off_h = off_hk * GROUP + g
        qd = tl.load(QD + off_b * s_qdb + (off_h // Q_DESCALE_GROUP) * s_qdh)
        dk = dk * (qd_prev / qd)                          # dk is kept in units of the current head's q_descale
        qd_prev = qd
        qk_scale = sm_scale_log2 * qd * kd
        q_base = Q + off_b.to(tl.int64) * s_qb + off_h.to(tl.int64) * s_qh
        do_base = DO + off_b.to(tl.int64) * s_db + off_h.to(tl.int64) * s_dh
        row0 = (off_b * H + off_h).to(tl.int64) * SQ
        dk, dv = _fp8_bwd_kv_inner(dk, dv, k8, v_h, q_base, do_base, q_desc, do_desc, off_b, off_h, LSE2 + row0,
                                   DELTA + row0, s_qm, s_dm, offs_n, offs_d, m_lo, m_mid, SQ, OFFSET, qk_scale, vd,
                                   HEAD_DIM, BLOCK_M, PAD_D, True, EVEN_M, TMA)
        dk, dv = _fp8_bwd_kv_inner(dk, dv, k8, v_h, q_base, do_base, q_desc, do_desc, off_b, off_h, LSE2 + row0,
                                   DELTA + row0, s_qm, s_dm, offs_n, offs_d, m_mid, sq_pad, SQ, OFFSET, qk_scale, vd,
                                   HEAD_DIM, BLOCK_M, PAD_D, False, EVEN_M, TMA)
    dk = dk * (qd_prev * scale)
    dk_base = DK + off_b.to(tl.int64) * s_dkb + off_hk.to(tl.int64) * s_dkh
    dv_base = DV + off_b.to(tl.int64) * s_dvb + off_hk.to(tl.int64) * s_dvh
    store_tile(dk_base + offs_n[:, None] * s_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), offs_n, SK, offs_d,
               HEAD_DIM, not EVEN_N, PAD_D)
    store_tile(dv_base + offs_n[:, None] * s_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), offs_n, SK, offs_d,
               HEAD_DIM, not EVEN_N, PAD_D)


@triton.jit
def _fp8_bwd_q_inner(dq, q8, do, lse2, delta, k_base, v_base, k_desc, v_desc, off_b, off_hk, s_kn, s_vn, offs_m,
                     offs_d, lo, hi, SK, OFFSET, qk_scale, v_descale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                     PAD_D: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:     # (b, h_kv, s_k, d) descriptors: keys past s_k come back zero
            k8 = k_desc.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            v8 = v_desc.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k8 = load_tile(k_base + offs_n[:, None] * s_kn + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, MASKED,
                           PAD_D)
            v8 = load_tile(v_base + offs_n[:, None] * s_vn + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, MASKED,
                           PAD_D)
        p = tl.math.exp2(tl.dot(q8, tl.trans(k8)) * qk_scale - lse2[:, None])        # FP8 S
        if MASKED:  # keys past s_k (k is 0 there, but p need not be) and the causal band
            keep = offs_n[None, :] < SK
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v8.to(do.dtype)))
        ds = p * (dp * v_descale - delta[:, None])
        dq = tl.dot(ds.to(do.dtype), k8.to(do.dtype), dq)
    return dq


@triton.jit
def fp8_bwd_q_kernel(Q, K, V, DO, DQ, LSE2, DELTA, QD, KD, VD, k_desc, v_desc,
                     s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_db, s_dh, s_dm, s_dqb, s_dqh, s_dqm,
                     s_qdb, s_qdh, s_kdb, s_kdh, s_vdb, s_vdh,
                     H, GROUP, Q_DESCALE_GROUP, SQ, SK, OFFSET, sm_scale_log2, scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr):
    """Grid (q blocks, b * h_q), the last q blocks (the longest causal rows) first.  TMA: the streamed k8 / v8
    tiles through the descriptors k_desc / v_desc."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q8 = load_tile(Q + off_b.to(tl.int64) * s_qb + off_h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm
                   + offs_d[None, :], offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
    do = load_tile(DO + off_b.to(tl.int64) * s_db + off_h.to(tl.int64) * s_dh + offs_m[:, None] * s_dm
                   + offs_d[None, :], offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
    row = pid_bh.to(tl.int64) * SQ + offs_m
    lse2 = tl.load(LSE2 + row, mask=offs_m < SQ, other=float("inf"))
    delta = tl.load(DELTA + row, mask=offs_m < SQ, other=0.0)
    qd = tl.load(QD + off_b * s_qdb + (off_h // Q_DESCALE_GROUP) * s_qdh)
    kd = tl.load(KD + off_b * s_kdb + off_hk * s_kdh)
    vd = tl.load(VD + off_b * s_vdb + off_hk * s_vdh)
    qk_scale = sm_scale_log2 * qd * kd
    k_base = K + off_b.to(tl.int64) * s_kb + off_hk.to(tl.int64) * s_kh
    v_base = V + off_b.to(tl.int64) * s_vb + off_hk.to(tl.int64) * s_vh
    if CAUSAL:      # as flash_attention's key_range: [0, n_full) unmasked whole blocks, [n_full, hi) masked
        hi = tl.maximum(tl.minimum(SK, m0 + BLOCK_M + OFFSET), 0)
        n_full = tl.maximum(tl.minimum(SK, m0 + OFFSET + 1), 0)
    else:
        hi = SK
        n_full = SK
    n_full = (n_full // BLOCK_N) * BLOCK_N
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _fp8_bwd_q_inner(dq, q8, do, lse2, delta, k_base, v_base, k_desc, v_desc, off_b, off_hk, s_kn, s_vn, offs_m,
                          offs_d, 0, n_full, SK, OFFSET, qk_scale, vd, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, False, TMA)
    dq = _fp8_bwd_q_inner(dq, q8, do, lse2, delta, k_base, v_base, k_desc, v_desc, off_b, off_hk, s_kn, s_vn, offs_m,
                          offs_d, n_full, hi, SK, OFFSET, qk_scale, vd, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, True, TMA)
    dq = dq * (scale * kd)
    store_tile(DQ + off_b.to(tl.int64) * s_dqb + off_h.to(tl.int64) * s_dqh + offs_m[:, None] * s_dqm
               + offs_d[None, :], dq.to(DQ.dtype.element_ty), offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
