"""Triton flash attention (FlashAttention-2 scheme) for op "flash_attention".

Forward: one program per (q block, batch*q head); online softmax over kv blocks in two loops,
first the kv blocks every row of the q block sees in full (no masking work), then the few
boundary blocks (causal diagonal, kv tail) with masks.  GQA/MQA read kv head h // group: K/V
are never repeated in memory.  Causal is bottom-right aligned (query i sees keys
j <= i + s_k - s_q); a row that sees no key gets zeros and lse = -inf.
On Hopper, full kv blocks can come through TMA tensor descriptors (config flag TMA); in the backward the flag
loads the streamed tiles (q / dO in the dK/dV kernel, k / v in the dQ kernel) through (b, h, s, d) descriptors.

Backward (deterministic, no atomics; kernels in bwd_kernels.py): a preprocess kernel (delta = rowsum(dO * O),
lse in log2 units), a dK/dV kernel (one program per kv block and kv head, looping over the q blocks of every q head
of its group, so GQA's sum over the group happens in registers), then dQ either by a dQ kernel (one program per q
block, looping over kv blocks; 7 GEMMs per tile pair in all) or, variant "ds", by a GEMM over the dS the dK/dV
kernel wrote to a capped workspace (dq_gemm.py; 5 GEMMs); which one per shape bucket is measured.

Tiles come from ctx.profile.tiles["flash_attention"][pass][head-dim class]: the first config
is the default, the list is the autotune space (GPU only, when profile.autotune)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_TRITON, KernelImpl
from opsadv.core.policy import current_policy

from .. import interpreter_bf16_reasons, triton_device_types
from . import dq_gemm
from .bwd_kernels import _bwd_group_sum_kernel, _bwd_kv_kernel, _bwd_pre_kernel, _bwd_q_kernel
from ..tma import TensorDescriptor, desc_bhsd, run_side_by_side, side_stream, sm90_plus, tma_tiles_ok
from ..utils import ConfigTuner, bucket, load_tile, new_output, new_output_bshd, store_tile

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
HEAD_DIMS = (32, 64, 96, 128, 256)
FEATURES = frozenset({"causal", "gqa", "cross_length"})
# The atomic-dQ backward (dQ by one TMA bulk reduce-add per tile on Hopper, _dq_tma_ok; fp32 element atomics
# elsewhere) is correct but slower than the two-kernel one, so it ranks below and is experimental
# (use_backend(..., experimental=True) to measure it).  H200, TMA reduce, b4 s4096 d128: 8.09 ms vs 6.85
# deterministic and 5.34 cuDNN (causal 4.43 / 3.66 / 2.96); element atomics, bf16 d128 s4096: 7.8 vs 6.7 ms.
ATOMIC_DQ_PRIORITY_DELTA = -10


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _softmax_pv(acc, l_i, m_i, qk, v, offs_m, offs_n, SK, OFFSET, qk_scale,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, RESCALE: tl.constexpr):
    """One online-softmax step: fold the raw scores qk of one kv block and its V into (acc, l_i, m_i).
    m_i is the reference max (log2 units) that acc and l_i are scaled to.  RESCALE > 0: a row keeps
    its old reference unless its max grew by more than RESCALE (p stays <= 2^RESCALE), and acc is
    multiplied only when some row's reference moved (FA4's conditional rescaling)."""
    if MASKED:
        keep = offs_n[None, :] < SK
        if CAUSAL:  # bottom-right aligned: query i sees keys j <= i + OFFSET
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if RESCALE > 0:
        m_new = tl.where(m_new - m_i > RESCALE, m_new, m_i)
    if MASKED:
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])   # scale and shift in one FMA
    alpha = tl.math.exp2(m_i - m_new)              # rescale what was accumulated under the old max
    if RESCALE > 0:
        if tl.max((m_new > m_i).to(tl.int32), 0) > 0:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit
def _kv_tile(base, desc, kv_row0, start_n, s_n, offs_d, SK, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
             PAD_D: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) K or V tile starting at key start_n."""
    if TMA:  # bulk copy of a full block; rows are this head's (never the tail)
        x = desc.load([kv_row0 + start_n, 0])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        x = load_tile(base + offs_n[:, None] * s_n + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, MASKED, PAD_D)
    return x


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, kv_row0, s_kn, s_vn,
               offs_m, offs_d, lo, hi, SK, OFFSET, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, RESCALE: tl.constexpr,
               WS: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _kv_tile(k_base, desc_k, kv_row0, start_n, s_kn, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D, MASKED, TMA)
        qk = tl.dot(q, tl.trans(k))
        v = _kv_tile(v_base, desc_v, kv_row0, start_n, s_vn, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D, MASKED, TMA)
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, v, offs_m, start_n + tl.arange(0, BLOCK_N), SK, OFFSET,
                                    qk_scale, CAUSAL, MASKED, RESCALE)
    return acc, l_i, m_i


@triton.jit
def _fwd_inner_pipe(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, kv_row0, s_kn, s_vn,
                    offs_m, offs_d, lo, hi, SK, OFFSET, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                    TMA: tl.constexpr, RESCALE: tl.constexpr):
    """Full (unmasked) kv blocks with QK^T of block j+1 issued before the softmax of block j, so the
    tensor cores work on it while the softmax runs (FA3's intra-warpgroup overlap, in source)."""
    if lo < hi:
        k = _kv_tile(k_base, desc_k, kv_row0, lo, s_kn, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D, False, TMA)
        qk = tl.dot(q, tl.trans(k))
        for start_n in range(lo, hi - BLOCK_N, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            k = _kv_tile(k_base, desc_k, kv_row0, start_n + BLOCK_N, s_kn, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D,
                         False, TMA)
            qk_next = tl.dot(q, tl.trans(k))
            v = _kv_tile(v_base, desc_v, kv_row0, start_n, s_vn, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D, False, TMA)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, v, offs_m, start_n + tl.arange(0, BLOCK_N), SK,
                                        OFFSET, qk_scale, False, False, RESCALE)
            qk = qk_next
        v = _kv_tile(v_base, desc_v, kv_row0, hi - BLOCK_N, s_vn, offs_d, SK, HEAD_DIM, BLOCK_N, PAD_D, False, TMA)
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, v, offs_m, hi - BLOCK_N + tl.arange(0, BLOCK_N), SK,
                                    OFFSET, qk_scale, False, False, RESCALE)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, desc_k, desc_v,
                s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
                H, GROUP, SQ, SK, OFFSET, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr, RESCALE: tl.constexpr,
                PIPE: tl.constexpr, WS: tl.constexpr):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)   # longest (causal) q blocks start first
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP                                # GQA: the kv head this q head reads
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + off_b.to(tl.int64) * s_qb + off_h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :]
    q = load_tile(q_ptrs, offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
    k_base = K + off_b.to(tl.int64) * s_kb + off_hk.to(tl.int64) * s_kh
    v_base = V + off_b.to(tl.int64) * s_vb + off_hk.to(tl.int64) * s_vh
    kv_row0 = (off_b * (H // GROUP) + off_hk) * SK         # this head's first row in the (b*hkv*sk, d) TMA view
    if CAUSAL:
        hi = tl.maximum(tl.minimum(SK, m0 + BLOCK_M + OFFSET), 0)        # last key any row of the block sees
        n_full = tl.maximum(tl.minimum(SK, m0 + OFFSET + 1), 0)          # keys every row of the block sees
    else:
        hi = SK
        n_full = SK
    n_full = (n_full // BLOCK_N) * BLOCK_N                                # whole, unmasked kv blocks
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)          # finite: a fully masked block gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if PIPE:
        acc, l_i, m_i = _fwd_inner_pipe(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, kv_row0, s_kn, s_vn,
                                        offs_m, offs_d, 0, n_full, SK, OFFSET, qk_scale,
                                        HEAD_DIM, BLOCK_N, PAD_D, TMA, RESCALE)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, kv_row0, s_kn, s_vn,
                                   offs_m, offs_d, 0, n_full, SK, OFFSET, qk_scale,
                                   HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, False, TMA, RESCALE, WS)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, kv_row0, s_kn, s_vn,
                               offs_m, offs_d, n_full, hi, SK, OFFSET, qk_scale,
                               HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, True, False, RESCALE, False)
    empty = l_i == 0.0                                     # row saw no key (causal with s_q > s_k)
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # log2 -> ln
    o_ptrs = O + off_b.to(tl.int64) * s_ob + off_h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :]
    store_tile(o_ptrs, out.to(O.dtype.element_ty), offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)
    lse_ptrs = LSE + pid_bh.to(tl.int64) * SQ + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < SQ)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
_FWD = ConfigTuner("flash_attention.fwd")
_BWD_KV = ConfigTuner("flash_attention.bwd_kv")
_BWD_Q = ConfigTuner("flash_attention.bwd_q")
_BWD_KVA = ConfigTuner("flash_attention.bwd_kv_atomic_dq")
_BWD_KVDS = ConfigTuner("flash_attention.bwd_kv_ds")          # the dK/dV kernel writing dS (its own timing)
_BWD_DQG = ConfigTuner("flash_attention.bwd_dq_gemm")
_BWD_VARIANT = ConfigTuner("flash_attention.bwd_variant")     # kernels / ds / ds_pipe, the whole backward timed

# Forward-only kernel variants a config may switch on (profile data; absent = off): TMA descriptor loads,
# conditional rescaling threshold (log2 units, 0 = rescale every block), QK^T of the next block issued
# before the softmax (PIPE), Triton warp specialization of the kv loop (WS).
_FWD_FLAGS = {"TMA": False, "RESCALE": 0.0, "PIPE": False, "WS": False}

# Used when the profile names no attention tiles (a third-party or future profile).
_DEFAULT_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def _dclass(d: int) -> int:
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def _configs(ctx, which: str, d: int, tma_ok: bool) -> list[dict]:
    """The profile's configs for this pass and head-dim class; TMA ones dropped when not usable."""
    tiles = (ctx.profile.tiles.get("flash_attention", {}) if ctx.profile is not None else {})
    cfgs = [dict(c) for c in tiles.get(which, {}).get(_dclass(d), [])] or [dict(_DEFAULT_TILE)]
    out: list[dict] = []
    for c in cfgs:
        for flag, off in _FWD_FLAGS.items():
            c.setdefault(flag, off)
        if c["TMA"] and not tma_ok:
            c["TMA"] = False
        if c not in out:
            out.append(c)
    return out


def _autotune(ctx, device: torch.device) -> bool:
    return device.type == "cuda" and ctx.profile is not None and ctx.profile.autotune


def _compute_dtype(ctx, dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 run as is; fp32 runs in the precision policy's attention dtype (check() has
    already rejected fp32 when that policy keeps fp32)."""
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    prec = ctx.options.get("precision")
    return torch.bfloat16 if getattr(prec, "attention", "fp32") == "bf16" else torch.float16


def _prep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()    # kernels assume unit stride along head_dim


def _launch_args(cfg: dict) -> dict:
    return {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}


def flash_fwd(ctx, q, k, v, attn_mask, causal, scale):
    in_dtype = q.dtype
    cdt = _compute_dtype(ctx, in_dtype)
    q, k, v = _prep(q, cdt), _prep(k, cdt), _prep(v, cdt)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    out = new_output_bshd(q.shape, cdt, q.device)     # (b, s, h, d) memory: the ops' boundary layout
    lse = new_output((b, hq, sq), torch.float32, q.device)
    block_d = max(16, triton.next_power_of_2(d))
    tma_ok = (TensorDescriptor is not None and q.device.type == "cuda" and block_d == d
              and k.is_contiguous() and v.is_contiguous())
    qk_scale = scale * LOG2E

    def launch(cfg):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        dk_ = dv_ = None
        if cfg["TMA"]:
            dk_ = TensorDescriptor(k, [b * hkv * sk, d], [d, 1], [bn, d])
            dv_ = TensorDescriptor(v, [b * hkv * sk, d], [d, 1], [bn, d])
        grid = (triton.cdiv(sq, bm), b * hq)
        _fwd_kernel[grid](q, k, v, out, lse, dk_, dv_,
                          q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                          hq, hq // hkv, sq, sk, sk - sq, qk_scale,
                          HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, EVEN_M=sq % bm == 0,
                          TMA=cfg["TMA"], RESCALE=float(cfg["RESCALE"]), PIPE=cfg["PIPE"], WS=cfg["WS"],
                          **_launch_args(cfg))

    cfgs = _configs(ctx, "fwd", d, tma_ok)
    key = (str(cdt), d, causal, hq // hkv, bucket(sq), bucket(sk), bucket(b * hq), tma_ok)
    cfg = _FWD.pick(key, cfgs, launch, _autotune(ctx, q.device))
    launch(cfg)
    if out.dtype != in_dtype:
        out = out.to(in_dtype)
    return out, lse


def flash_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    """Deterministic backward (no atomics): dK/dV kernel + dQ kernel, or dK/dV kernel writing dS + a dQ GEMM over
    it, whichever measured faster for the bucket (_bwd)."""
    return _bwd(ctx, dout, q, k, v, out, lse, causal, scale, atomic_dq=False)


def flash_bwd_variant(ctx, dout, q, k, v, out, lse, causal, scale, variant: str):
    """The deterministic backward with its variant forced ("kernels", "ds", "ds_pipe"): tests and probes."""
    return _bwd(ctx, dout, q, k, v, out, lse, causal, scale, atomic_dq=False, variant=variant)


def flash_bwd_atomic(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    """dQ accumulated in fp32 inside the dK/dV kernel: no QK^T/dP recomputation for dQ, but the summation order
    varies between runs (not deterministic).  On Hopper each tile's share goes in one TMA bulk reduce-add
    (FA3's way); elsewhere (and under the interpreter) by element atomics."""
    return _bwd(ctx, dout, q, k, v, out, lse, causal, scale, atomic_dq=True)


def _dq_tma_ok(q: torch.Tensor, d: int, block_d: int) -> bool:
    """dQ reduced through TMA (a bulk reduce-add per tile, Hopper+): needs host descriptors, an unpadded head
    dim and a real GPU (the interpreter has no descriptor reduce)."""
    return (TensorDescriptor is not None and q.device.type == "cuda" and d == block_d
            and sm90_plus(q.device.index))


# The deterministic backward's dK/dV and dQ kernels on two streams (CUDA only).  H200 (gradients bit-identical):
# 1.006-1.057x the one-stream backward in 8 of 8 cases (b4 s4096 d128 6.535 vs 6.572 ms, causal 3.560 vs
# 3.631, GQA causal 3.465 vs 3.661, s16384 1.013-1.015x, d64 1.021x).
CONCURRENT_BWD = True


def _bwd(ctx, dout, q, k, v, out, lse, causal, scale, atomic_dq: bool, variant: str | None = None):
    """variant (deterministic backward only): None = measured per bucket among "kernels" (dK/dV + dQ kernels)
    and "ds" / "ds_pipe" (dK/dV kernel writing dS, dQ by a GEMM over it: dq_gemm.py) where the dS
    workspace fits its cap; a name forces that variant (tests, probes) and raises if it cannot run."""
    in_dtype = q.dtype
    cdt = _compute_dtype(ctx, in_dtype)
    q, k, v, out, dout = (_prep(t, cdt) for t in (q, k, v, out, dout))
    lse = lse.float().contiguous()
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    pre_bm = 64
    _bwd_pre_kernel[(triton.cdiv(sq, pre_bm), b * hq)](
        out, dout, lse, delta, lse2, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), hq, sq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_bm)
    dq = new_output_bshd(q.shape, cdt, q.device)      # (b, s, h, d) memory, as the op boundary promises
    dqa = torch.zeros((b, hq, sq, d), dtype=torch.float32, device=q.device) if atomic_dq else dq
    dk = new_output_bshd(k.shape, cdt, q.device)
    dv = new_output_bshd(v.shape, cdt, q.device)
    qk_scale = scale * LOG2E
    common = (hq, group, sq, sk, sk - sq, qk_scale, scale)

    dq_tma = atomic_dq and _dq_tma_ok(q, d, block_d)
    tma_ok = not atomic_dq and tma_tiles_ok(ctx, d, block_d, q, k, v, dout)

    shares: list = []       # SPLIT's fp32 dK / dV shares per q head, (2, group, kv heads of a launch, s_k, d)

    def launch_kv(cfg, chunk=None, ws=None):
        """dK/dV of kv heads chunk = (first, count) over b * h_kv (all by default); ws: also write dS^T there.
        SPLIT (GQA): one program per q head, then the group's shares summed in order into dk / dv."""
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        bhk0, nkv = chunk or (0, b * hkv)
        split = bool(cfg.get("SPLIT")) and group > 1 and not atomic_dq
        out_k, out_v, g_strides = dk, dv, {}
        kv_strides = (*dk.stride()[:3], *dv.stride()[:3])
        if split:           # one buffer, reused by every chunk in stream order (sized for the largest)
            if not shares or shares[0].shape[2] < nkv:
                shares[:] = [new_output((2, group, nkv, sk, d), torch.float32, q.device)]
            out_k, out_v = shares[0][0], shares[0][1]
            g_strides = dict(s_dkg=out_k.stride(0), s_dvg=out_v.stride(0), SPLIT=True)
            kv_strides = (0, out_k.stride(1), out_k.stride(2), 0, out_v.stride(1), out_v.stride(2))
        dq_desc = qd = dod = None
        if cfg["TMA"]:
            qd, dod = desc_bhsd(q, bm), desc_bhsd(dout, bm)
        if atomic_dq:
            dqa.zero_()                                     # the tuner may launch this more than once
            if dq_tma:                                      # (b*h, s_q, d) fp32: TMA clips rows past s_q
                dq_desc = TensorDescriptor(dqa, [b * hq, sq, d], [sq * d, d, 1], [1, bm, d])
        ds_args = {}
        if ws is not None:
            ds = TensorDescriptor(ws, list(ws.shape), list(ws.stride()), [1, bn, bm]) if cfg.get("DS_TMA") else ws
            ds_args = dict(DS=ds, s_dss=ws.stride(0), s_dsn=ws.stride(1), BHK0=bhk0, DS_STORE=True,
                           DS_TMA=bool(cfg.get("DS_TMA")))
        lpt = bool(cfg.get("LPT"))
        units = nkv * group if split else nkv               # programs per kv block
        _bwd_kv_kernel[(units, triton.cdiv(sk, bn)) if lpt else (triton.cdiv(sk, bn), units)](
            q, k, v, dout, out_k, out_v, lse2, delta, dqa, dq_desc, qd, dod,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            *kv_strides, *common,
            HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, EVEN_M=sq % bm == 0, EVEN_N=sk % bn == 0,
            ATOMIC_DQ=atomic_dq, DQ_TMA=dq_tma, TMA=cfg["TMA"], LPT=lpt, **ds_args, **g_strides, **_launch_args(cfg))
        if split:
            sum_bn = 32                                     # (two fp32 tiles of 32 x d per program)
            _bwd_group_sum_kernel[(triton.cdiv(sk, sum_bn), nkv)](
                out_k, out_v, dk, dv, out_k.stride(0), dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2), hkv, group, sk, bhk0, HEAD_DIM=d, BLOCK_D=block_d,
                BLOCK_N=sum_bn)

    def launch_q(cfg):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        kd = vd = None
        if cfg["TMA"]:
            kd, vd = desc_bhsd(k, bn), desc_bhsd(v, bn)
        _bwd_q_kernel[(triton.cdiv(sq, bm), b * hq)](
            q, k, v, dout, dq, lse2, delta, kd, vd,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), *common,
            HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, EVEN_M=sq % bm == 0, TMA=cfg["TMA"], **_launch_args(cfg))

    key = (str(cdt), d, causal, group, bucket(sq), bucket(sk), bucket(b * hq), tma_ok)
    tune = _autotune(ctx, q.device)
    if atomic_dq:
        launch_kv(_BWD_KVA.pick(key, _configs(ctx, "bwd_kv", d, False), launch_kv, tune))
        dq.copy_(dqa)                                       # fp32 accumulator -> q's dtype
    else:
        def run_kernels():
            fits = _split_bytes(group, b * hkv, sk, d) <= dq_gemm.workspace_cap(ctx)
            kv_cfgs = _with_lpt(_with_split(_configs(ctx, "bwd_kv", d, tma_ok), group, q, fits), causal, q)
            cfg_kv = _BWD_KV.pick(key, kv_cfgs, launch_kv, tune)
            cfg_q = _BWD_Q.pick(key, _configs(ctx, "bwd_q", d, tma_ok), launch_q, tune)
            if CONCURRENT_BWD and q.device.type == "cuda":     # the dQ kernel on a side stream next to dK/dV
                run_side_by_side(q.device, lambda: launch_kv(cfg_kv), lambda: launch_q(cfg_q))
            else:
                launch_kv(cfg_kv)
                launch_q(cfg_q)

        per_chunk = dq_gemm.kv_heads_per_chunk(ctx, b, hkv, group, sq, sk, cdt)
        runs = {"kernels": run_kernels}
        if per_chunk > 0:
            runs["ds"] = lambda: _bwd_ds(ctx, key, tune, tma_ok, launch_kv, q, k, dq, causal, scale, per_chunk,
                                          False)
            if per_chunk >= 2 and q.device.type == "cuda":    # two chunks in flight: half the cap each
                runs["ds_pipe"] = lambda: _bwd_ds(ctx, key, tune, tma_ok, launch_kv, q, k, dq, causal, scale,
                                                  per_chunk // 2, True)
        if variant is None:
            offered = [{"variant": n} for n in runs if n == "kernels" or DS_BACKWARD]
            variant = _BWD_VARIANT.pick(key, offered, lambda c: runs[c["variant"]](), tune)["variant"]
        elif variant not in runs:
            raise ValueError(
                f"flash_attention backward: variant {variant!r} cannot run here (available: {sorted(runs)}; the dS "
                f"workspace of one kv head's q heads, {group * dq_gemm.slab_bytes(sq, sk, cdt)} bytes, against the "
                f"cap {dq_gemm.workspace_cap(ctx)}; ds_pipe needs CUDA and two kv heads per chunk)")
        runs[variant]()
    if in_dtype != cdt:
        dq, dk, dv = dq.to(in_dtype), dk.to(in_dtype), dv.to(in_dtype)
    return dq, dk, dv


def _with_lpt(cfgs: list[dict], causal: bool, q: torch.Tensor) -> list[dict]:
    """cfgs, then each again with a longest-first launch order of the dK/dV programs (LPT) for causal masks on a
    GPU, for the tuner to measure: for the GQA dS backward (4x longer programs per chunk; it lost, 0.93x) and the
    two-kernel backward (the variant GQA s16384 causal runs; LPT not picked there at 0a99afe)."""
    if not causal or q.device.type != "cuda":
        return cfgs
    return cfgs + [{**c, "LPT": True} for c in cfgs]


def _split_bytes(group: int, kv_heads: int, sk: int, d: int) -> int:
    """Bytes of SPLIT's fp32 dK / dV shares for a launch over kv_heads: scratch that counts against the
    workspace cap with the dS workspace (a chunk of the dS variant: both together).  GQA 32/8 s16384 d128: one
    kv head's dS slabs take 2 GiB and its shares 64 MiB, inside the 2.25 GiB default (a 2 GiB cap would leave
    SPLIT there only to the two-kernel variant, all kv heads' shares: 512 MiB)."""
    return 2 * group * kv_heads * sk * d * 4


def _with_split(cfgs: list[dict], group: int, q: torch.Tensor, fits: bool = True) -> list[dict]:
    """cfgs, then each again with one dK/dV program per q head (SPLIT) for GQA on a GPU, for the tuner to measure:
    the dS backward's chunks of one kv head (s16384: 2 GiB holds one head's 4 q-head slabs) launched only 256
    programs of up to 4 x 256 q blocks each, under one wave of the H200's slots (without SPLIT ds was not chosen
    for GQA s16384 causal, own fwd+bwd 1.467x SDPA-flash); SPLIT gives GROUP times as many, GROUP times shorter ones,
    for an fp32 write and read of the group's dK / dV shares (offered only where they fit the workspace cap:
    fits)."""
    if group == 1 or q.device.type != "cuda" or not fits:
        return cfgs
    return cfgs + [{**c, "SPLIT": True} for c in cfgs]


# The dS backward variants take part in the measured choice (False: only when forced by name).
DS_BACKWARD = True


def _bwd_ds(ctx, key, tune, tma_ok: bool, launch_kv, q, k, dq, causal, scale, per_chunk: int, pipelined: bool) -> None:
    """dK/dV kernel writing dS^T, then dQ = scale * dS K by dq_gemm, per chunk of per_chunk kv heads.
    pipelined: two workspaces; chunk i's dQ GEMM (memory-bound) runs on a side stream while chunk i+1's
    dK/dV kernel (compute-bound) runs on the caller's, each workspace reused once its GEMM has read it."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    chunks = dq_gemm.balanced_chunks(b * hkv, per_chunk)
    bufs = [dq_gemm.new_workspace(per_chunk * group, sq, sk, q.dtype, q.device) for _ in range(1 + pipelined)]

    def dq_of(cfg, chunk, ws):
        h0, n = chunk
        dq_gemm.launch_dq_gemm(ws, k, dq, h0 * group, n * group, hq, group, sq, sk, causal, scale, cfg)

    first = chunks[0]
    kv_cfgs = _configs(ctx, "bwd_kv", d, tma_ok)
    if tma_ok:      # dS out through a descriptor: it won every d128 bucket timed against plain stores
        kv_cfgs = [{**c, "DS_TMA": True} for c in kv_cfgs]
    scratch = sum(w.numel() * w.element_size() for w in bufs) + _split_bytes(group, per_chunk, sk, d)
    kv_cfgs = _with_lpt(_with_split(kv_cfgs, group, q, scratch <= dq_gemm.workspace_cap(ctx)), causal, q)
    cfg_kv = _BWD_KVDS.pick(key, kv_cfgs, lambda c: launch_kv(c, first, bufs[0]), tune)
    cfg_dq = _BWD_DQG.pick(key, _configs(ctx, "bwd_dsq", d, tma_ok), lambda c: dq_of(c, first, bufs[0]), tune)
    if not pipelined:
        for chunk in chunks:
            launch_kv(cfg_kv, chunk, bufs[0])
            dq_of(cfg_dq, chunk, bufs[0])
        return
    main = torch.cuda.current_stream(q.device)
    side = side_stream(q.device)
    side.wait_stream(main)
    freed = [None, None]                      # event: the buffer's last dQ GEMM has read it
    for i, chunk in enumerate(chunks):
        ws = bufs[i % 2]
        if freed[i % 2] is not None:
            main.wait_event(freed[i % 2])
        launch_kv(cfg_kv, chunk, ws)
        written = torch.cuda.Event()
        written.record(main)
        side.wait_event(written)
        with torch.cuda.stream(side):
            dq_of(cfg_dq, chunk, ws)
            freed[i % 2] = torch.cuda.Event()
            freed[i % 2].record(side)
    main.wait_stream(side)


def _check(spec, env) -> list[str]:
    """Dynamic limits: fp32 needs a half-precision attention policy; the interpreter's bf16 dot is wrong."""
    why = []
    cdt = spec.dtype
    if spec.dtype == torch.float32:
        prec = current_policy().precision.attention
        if prec not in ("fp16", "bf16"):
            why.append("float32 inputs need precision attention 'fp16' or 'bf16' "
                       "(use_backend(..., precision='bf16')); this kernel computes in half precision")
        cdt = torch.bfloat16 if prec == "bf16" else torch.float16
    return why + interpreter_bf16_reasons(spec, cdt)


# the profile's tiles are capped by the seed's tile_size; fp32 inputs run in the policy's attention dtype; the
# softmax statistics stay float32 (online softmax in registers)
HONOURS = frozenset({"tile_size", "attention"})


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.flash_attention", op="flash_attention", backend=backend, fn=flash_fwd, backward=flash_bwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), head_dims=HEAD_DIMS, min_cc=(8, 0),
        features=FEATURES, deterministic=True, requires_interpret_or_cuda=True, check=_check, memory=MEMORY_FLASH,
        honours=HONOURS, description="Triton FlashAttention-2 forward/backward (online softmax, GQA by index, bottom-right causal; "
                    "TMA on Hopper; deterministic backward without atomics: dQ by its own kernel or by a GEMM over dS "
                    "kept in a capped workspace, measured per bucket)"),
        KernelImpl(
        id=f"{backend}.triton.flash_attention.atomic_dq", op="flash_attention", backend=backend, fn=flash_fwd,
        backward=flash_bwd_atomic, priority=PRIORITY_TRITON + ATOMIC_DQ_PRIORITY_DELTA,
        device_types=triton_device_types(env), dtypes=(torch.float16, torch.bfloat16, torch.float32),
        head_dims=HEAD_DIMS, min_cc=(8, 0), features=FEATURES, deterministic=False, requires_interpret_or_cuda=True,
        experimental=True, check=_check, memory=MEMORY_FLASH, honours=HONOURS, description="the same forward; backward accumulates dQ with fp32 atomics in the dK/dV kernel "
                                  "(one kernel fewer, no recomputation for dQ; not deterministic)")]


__all__ = ["impls", "flash_fwd", "flash_bwd", "flash_bwd_atomic", "HEAD_DIMS"]
