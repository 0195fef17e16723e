"""The FP8 attention forward kernel (FlashAttention-2 scheme, as flash_attention's attention.py) for op
"fp8_attention".

One program per (q block, batch * q head); online softmax over kv blocks in two loops (the blocks every row sees in
full without masks, then the causal-diagonal / tail blocks with masks).  Both GEMMs are FP8 tensor-core dots with
float32 accumulation:
  S = q8 k8^T                   (e4m3 x e4m3); q_descale * k_descale * scale * log2(e) folded into the softmax scale
  O += P8 v8                    P rounded to e4m3 after scaling by 2^P_SHIFT (P in [0, 1] after the max subtraction:
                                exp2(s - (m - P_SHIFT)) gives 256 P at no cost; a power of two keeps the scaling exact,
                                and e4m3's relative precision is the same at any scale, so 256 rather than 448 loses
                                nothing but range below 2^-17 that P does not need); v_descale and the 2^-P_SHIFT
                                cancel in out = acc * v_descale / l (l sums the same 256-scaled, unrounded P)
V is read as tiles (BLOCK_N, D) of a (.., s, d) tensor, or with V_T as (D, BLOCK_N) tiles of a (.., d, s) copy
(seq contiguous) fed to the dot transposed: the K-major operand Hopper's FP8 wgmma takes, as FA3 and Triton's
tutorial transpose V for fp8.  TMA (full blocks through tensor descriptors) as in the bf16 forward.
ROUND_P: round P onto the e4m3 grid in float32 before the cast (scaled_gemm's _round_fp8, torch's cast bit for bit):
the interpreter's own float32 -> fp8 cast is wrong (ties away from zero, carries lost); on a GPU the hardware cast
(round to nearest even) gives the same values."""
from __future__ import annotations

import triton
import triton.language as tl

from ..flash_attention.attention import _kv_tile
from ..scaled_gemm.kernels import _round_fp8
from ..utils import load_tile, store_tile

P_SHIFT = tl.constexpr(8.0)        # log2 of P's fp8 scale (256)


@triton.jit
def _v_tile(v_base, desc_v, vt_row0, start_n, s_vn, s_vd, offs_d, SK, HEAD_DIM: tl.constexpr,
            BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, MASKED: tl.constexpr, V_T: tl.constexpr, TMA: tl.constexpr):
    """V's tile for keys start_n..: (BLOCK_N, BLOCK_D) as the dot's B operand (with V_T: loaded (BLOCK_D, BLOCK_N)
    from the seq-contiguous copy and transposed: K-major)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if V_T:
        if TMA:
            vt = desc_v.load([vt_row0, start_n])
        else:
            ptrs = v_base + offs_d[:, None] * s_vd + offs_n[None, :] * s_vn
            vt = load_tile(ptrs, offs_d, HEAD_DIM, offs_n, SK, PAD_D, MASKED)
        v = tl.trans(vt)
    else:
        if TMA:
            v = desc_v.load([vt_row0 + start_n, 0])
        else:
            ptrs = v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd
            v = load_tile(ptrs, offs_n, SK, offs_d, HEAD_DIM, MASKED, PAD_D)
    return v


@triton.jit
def _fp8_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row0, vt_row0, s_kn, s_vn, s_vd,
               offs_m, offs_d, lo, hi, SK, OFFSET, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, V_T: tl.constexpr, TMA: tl.constexpr, ROUND_P: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _kv_tile(k_base, desc_k, k_row0, start_n, s_kn, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D, MASKED, TMA)
        qk = tl.dot(q, tl.trans(k))                                        # FP8 tensor cores, float32 accumulator
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < SK
            if CAUSAL:      # bottom-right aligned: query i sees keys j <= i + OFFSET
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - (m_new[:, None] - P_SHIFT))
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - (m_new[:, None] - P_SHIFT))   # 2^P_SHIFT P: scale and shift in one FMA
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.sum(p, 1)
        if ROUND_P:
            p = _round_fp8(p, 448.0, 3, -6)
        v = _v_tile(v_base, desc_v, vt_row0, start_n, s_vn, s_vd, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D, MASKED, V_T,
                    TMA)
        acc = tl.dot(p.to(v.dtype), v, acc)                                # FP8 P @ V
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fp8_attention_fwd_kernel(Q, K, V, O, LSE, QD, KD, VD, desc_k, desc_v,
                             s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_vd, s_ob, s_oh, s_om,
                             s_qdb, s_qdh, s_kdb, s_kdh, s_vdb, s_vdh,
                             H, GROUP, Q_DESCALE_GROUP, SQ, SK, OFFSET, sm_scale_log2,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, V_T: tl.constexpr,
                             TMA: tl.constexpr, ROUND_P: tl.constexpr):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)     # longest (causal) q blocks start first
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP                               # GQA: the kv head this q head reads
    hkv = H // GROUP
    # descales: per tensor (strides 0) or per (batch, head); q's may be per kv head (Q_DESCALE_GROUP = GROUP)
    qd = tl.load(QD + off_b * s_qdb + (off_h // Q_DESCALE_GROUP) * s_qdh)
    kd = tl.load(KD + off_b * s_kdb + off_hk * s_kdh)
    vd = tl.load(VD + off_b * s_vdb + off_hk * s_vdh)
    qk_scale = sm_scale_log2 * qd * kd
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + off_b.to(tl.int64) * s_qb + off_h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :]
    q = load_tile(q_ptrs, offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
    k_base = K + off_b.to(tl.int64) * s_kb + off_hk.to(tl.int64) * s_kh
    v_base = V + off_b.to(tl.int64) * s_vb + off_hk.to(tl.int64) * s_vh
    k_row0 = (off_b * hkv + off_hk) * SK                  # this head's first row in the (b*hkv*sk, d) TMA view
    if V_T:
        vt_row0 = (off_b * hkv + off_hk) * HEAD_DIM       # ... in the (b*hkv*d, sk) view of the transposed V
    else:
        vt_row0 = k_row0
    if CAUSAL:
        hi = tl.maximum(tl.minimum(SK, m0 + BLOCK_M + OFFSET), 0)      # last key any row of the block sees
        n_full = tl.maximum(tl.minimum(SK, m0 + OFFSET + 1), 0)        # keys every row of the block sees
    else:
        hi = SK
        n_full = SK
    n_full = (n_full // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)        # finite: a fully masked block gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _fp8_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row0, vt_row0, s_kn, s_vn, s_vd,
                               offs_m, offs_d, 0, n_full, SK, OFFSET, qk_scale,
                               HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, False, V_T, TMA, ROUND_P)
    acc, l_i, m_i = _fp8_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_row0, vt_row0, s_kn, s_vn, s_vd,
                               offs_m, offs_d, n_full, hi, SK, OFFSET, qk_scale,
                               HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, True, V_T, False, ROUND_P)
    empty = l_i == 0.0                                    # the row saw no key (causal with s_q > s_k)
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (vd / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i - P_SHIFT + tl.math.log2(l_safe)) * 0.6931471805599453)  # log2 -> ln
    o_ptrs = O + off_b.to(tl.int64) * s_ob + off_h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :]
    store_tile(o_ptrs, out.to(O.dtype.element_ty), offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
    lse_ptrs = LSE + pid_bh.to(tl.int64) * SQ + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < SQ)
