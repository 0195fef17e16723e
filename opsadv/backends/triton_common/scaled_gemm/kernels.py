"""Triton kernels of scaled_gemm (imported only when triton is installed).

scaled_gemm_kernel: one output tile per program (grouped order, gemm's _group_ids), fp8 x fp8 tl.dot with float32
accumulation over K in BLOCK_K steps, operands through pointer loads (any strides, sm_89+) or host-built TMA
descriptors (TMA, Hopper; b read as (N, K) rows under B_NK, the K-major layout fp8 wgmma wants).
Scales: per tensor / row / column scales are applied once in the epilogue (acc * sa[m] * sb[n]); block scales
(A_BLOCK: a's 1x128 along K, B_BLOCK: b's 128x128) multiply each BLOCK_K step's partial product before it joins
the accumulator (BLOCK_K divides 128, so a step lies in one scale block).  Then gemm's epilogue (bias, activation,
residual) in float32, and either the store in out's dtype or, OUT_FP8, the float32 value into a workspace and the
tile's amax (finite |y|) into amax_ptr by an atomic max; quantize_kernel then scales and rounds the workspace into
fp8 once the amax of every tile is known.

SWIGLU (scaled_swiglu_gemm): b is [W_g | W_u] (K, 2N) and the output has N columns; each program keeps a second
accumulator for the up columns N + j of its gate columns j (b read at column offset N: pointer loads, or the TMA box
N rows / columns further), scales them with the up columns' scales, and its epilogue is act(g + b_g) * (u + b_u)
(ACT 4 silu, 3 gelu_tanh; no residual) before the same store or fp8 workspace."""
from __future__ import annotations

import triton
import triton.language as tl

from ..gemm.kernels import _act, _group_ids

FLT_MAX = tl.constexpr(3.4028234663852886e38)      # a jit function reads only constexpr globals


@triton.jit
def scaled_gemm_kernel(a_ptr, b_ptr, a_desc, b_desc, out_ptr, bias_ptr, res_ptr, sa_ptr, sb_ptr, amax_ptr,
                       M, N, K, M_BUCKET,
                       s_am, s_ak, s_bk, s_bn, s_om, s_on, s_rm, s_rn, s_sam, s_sak, s_sbk, s_sbn,
                       TMA: tl.constexpr, B_NK: tl.constexpr, A_BLOCK: tl.constexpr, B_BLOCK: tl.constexpr,
                       ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, OUT_FP8: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       SWIGLU: tl.constexpr = False):
    """sa / sb strides: s_sam (per a row), s_sak (per 128 of K), s_sbk (per 128 of K), s_sbn (per b column
    (B_BLOCK: per 128 columns)); 0 where the scale is broadcast (per tensor).  N: the output's columns (with SWIGLU
    half of b's)."""
    pid_m, pid_n = _group_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm = rm < M
    nm = rn < N
    rm64 = rm.to(tl.int64)
    sa_rows = sa_ptr + rm64 * s_sam                       # this tile's rows of a_scale
    if B_BLOCK:
        sb_cols = sb_ptr + (rn // 128) * s_sbn            # this tile's column blocks of b_scale
        sb_up = sb_ptr + ((rn + N) // 128) * s_sbn        # (SWIGLU) those of the matching up columns
    else:
        sb_cols = sb_ptr + rn * s_sbn
        sb_up = sb_ptr + (rn + N) * s_sbn
    a_ptrs = a_ptr + rm64[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # the up columns (SWIGLU only; dead otherwise)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        off_k = ki * BLOCK_K
        # (SWIGLU: b's columns >= N of a gate tile are up columns, never stored: the masks below keep columns < N)
        if TMA:
            a = a_desc.load([off_m, off_k])               # out-of-bounds rows / columns read as zero
            if B_NK:
                b = b_desc.load([off_n, off_k]).T
                if SWIGLU:
                    bu = b_desc.load([off_n + N, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
                if SWIGLU:
                    bu = b_desc.load([off_k, off_n + N])
        else:
            km = rk < K - off_k                           # K tail
            a = tl.load(a_ptrs, mask=mm[:, None] & km[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
            if SWIGLU:
                bu = tl.load(b_ptrs + N * s_bn, mask=km[:, None] & nm[None, :], other=0.0)
            a_ptrs += BLOCK_K * s_ak
            b_ptrs += BLOCK_K * s_bk
        if A_BLOCK or B_BLOCK:
            kb = off_k // 128                             # the scale block of this step
            if A_BLOCK:
                sa_k = tl.load(sa_rows + kb * s_sak, mask=mm, other=0.0)[:, None]
            part = tl.dot(a, b)
            if A_BLOCK:
                part = part * sa_k
            if B_BLOCK:
                part = part * tl.load(sb_cols + kb * s_sbk, mask=nm, other=0.0)[None, :]
            acc += part
            if SWIGLU:
                part_u = tl.dot(a, bu)
                if A_BLOCK:
                    part_u = part_u * sa_k
                if B_BLOCK:
                    part_u = part_u * tl.load(sb_up + kb * s_sbk, mask=nm, other=0.0)[None, :]
                acc_u += part_u
        else:
            acc = tl.dot(a, b, acc)
            if SWIGLU:
                acc_u = tl.dot(a, bu, acc_u)
    # the scales constant over K
    if not A_BLOCK:
        sa_m = tl.load(sa_rows, mask=mm, other=0.0)[:, None]
        acc = acc * sa_m
        if SWIGLU:
            acc_u = acc_u * sa_m
    if not B_BLOCK:
        acc = acc * tl.load(sb_cols, mask=nm, other=0.0)[None, :]
        if SWIGLU:
            acc_u = acc_u * tl.load(sb_up, mask=nm, other=0.0)[None, :]
    y = acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = _act(y, ACT)
    if SWIGLU:
        if HAS_BIAS:
            acc_u += tl.load(bias_ptr + N + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        y = y * acc_u
    mask = mm[:, None] & nm[None, :]
    if HAS_RES:
        y += tl.load(res_ptr + rm64[:, None] * s_rm + rn[None, :] * s_rn, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rm64[:, None] * s_om + rn[None, :] * s_on
    if OUT_FP8:
        tl.store(out_ptrs, y, mask=mask)                  # the float32 workspace
        ay = tl.abs(y)
        ay = tl.where(mask & (ay <= FLT_MAX), ay, 0.0)    # finite values only (NaN compares false)
        tl.atomic_max(amax_ptr, tl.max(tl.max(ay, axis=1), axis=0))
    else:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_fp8(y, FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """clamp(y, -FMAX, FMAX) rounded to nearest even onto the fp8 grid of MANT mantissa bits and smallest normal
    exponent EMIN, as float32 values the cast to fp8 keeps exactly (torch's cast bit for bit).  Rounded here, not
    by the cast: triton 3.6's interpreter casts float32 -> fp8 wrongly (ties away from zero, carries lost; the
    paged_attention append kernel's _quantize_e4m3 is this for e4m3)."""
    y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF                                            # biased float32 exponent of |y|
    ulp = ((tl.maximum(e, 127 + EMIN) - MANT) << 23).to(tl.float32, bitcast=True)   # the fp8 spacing there
    r = tl.abs(y) / ulp                                                # exact: a power of two
    r = (r + 12582912.0) - 12582912.0                                  # round half to even (1.5 * 2^23)
    a = (r * ulp).to(tl.int32, bitcast=True)
    return (a | (bits & -2147483648)).to(tl.float32, bitcast=True)    # y's sign back (-0.0 too)


@triton.jit
def quantize_kernel(y_ptr, q_ptr, amax_ptr, scale_ptr, numel, FMAX: tl.constexpr, MANT: tl.constexpr,
                    EMIN: tl.constexpr, BLOCK: tl.constexpr):
    """q = round(clamp(y / scale)), scale = amax / FMAX (1 for amax 0), over a contiguous float32 workspace;
    program 0 also writes the scale."""
    amax = tl.load(amax_ptr)
    scale = tl.where(amax > 0.0, tl.div_rn(amax, FMAX), 1.0)     # torch's float32 division
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    q = _round_fp8(tl.div_rn(y, scale), FMAX, MANT, EMIN)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=m)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)


@triton.jit
def _cast_tile(x_ptr, q_ptr, qt_ptr, scale, pid_m, pid_n, M, N, s_xm, s_xn, FMAX: tl.constexpr, MANT: tl.constexpr,
               EMIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of x read once, q = round(clamp(x / scale)) stored to q (M, N) and, with
    TRANSPOSE, to qt (N, M); returns the tile's max |x| as float32 bits (an int32: NaN's bits order above +inf's,
    so an integer max propagates a NaN)."""
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    x = tl.load(x_ptr + rm[:, None] * s_xm + rn[None, :] * s_xn, mask=mask, other=0.0).to(tl.float32)
    q = _round_fp8(tl.div_rn(x, scale), FMAX, MANT, EMIN).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)
    return _amax_bits(x)


@triton.jit
def _amax_bits(x):
    """max |x| over a tile as float32 bits (int32): |x|'s bits order as its values, and a NaN's above +inf's."""
    bits = tl.abs(x).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(tl.max(bits, axis=1), axis=0)


@triton.jit
def cast_kernel(x_ptr, q_ptr, qt_ptr, part_ptr, scale_ptr, M, N, s_xm, s_xn, FMAX: tl.constexpr,
                MANT: tl.constexpr, EMIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                TRANSPOSE: tl.constexpr):
    """cast_to_fp8 (cast.py): one (BLOCK_M, BLOCK_N) tile of x read once; q = round(clamp(x / scale)) written to
    q (M, N) and, with TRANSPOSE, to qt (N, M); the tile's max |x| (NaN if it holds one) to part[tile]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bits = _cast_tile(x_ptr, q_ptr, qt_ptr, tl.load(scale_ptr), pid_m, pid_n, M, N, s_xm, s_xn, FMAX, MANT, EMIN,
                      BLOCK_M, BLOCK_N, TRANSPOSE)
    tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_n, bits.to(tl.float32, bitcast=True))


@triton.jit
def history_amax_kernel(x_ptr, hist_ptr, hist_bits_ptr, M, N, s_xm, s_xn, SLOTS, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """cast_to_fp8_delayed's first pass (cast_delayed.py), which does work only where the cast needs this call's
    own amax (the history's first call, or L = 0): max |x| into the current amax slot, an atomic integer max of
    float bits (NaN-propagating).  Grid-stride over x's tiles, so a started history costs one load per program."""
    pos = tl.load(hist_ptr + SLOTS).to(tl.int32)
    started = tl.load(hist_ptr + SLOTS + 1)
    if (started == 0.0) | (SLOTS == 1):
        tiles_n = tl.cdiv(N, BLOCK_N)
        best = tl.zeros((), tl.int32)
        for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
            rm = ((t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            rn = ((t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            mask = (rm < M)[:, None] & (rn < N)[None, :]
            x = tl.load(x_ptr + rm[:, None] * s_xm + rn[None, :] * s_xn, mask=mask, other=0.0).to(tl.float32)
            best = tl.maximum(best, _amax_bits(x))
        tl.atomic_max(hist_bits_ptr + pos, best)


@triton.jit
def cast_delayed_kernel(x_ptr, q_ptr, qt_ptr, hist_ptr, hist_bits_ptr, scale_ptr, M, N, s_xm, s_xn, SLOTS,
                        FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, TRANSPOSE: tl.constexpr):
    """cast_to_fp8_delayed (cast_delayed.py): the scale from the history (the max of every amax slot but the
    current one; this call's amax, left in the current slot by history_amax_kernel, on a first call and with one
    slot), then cast_kernel's tile cast, the tile's max |x| recorded into the current slot (atomic max of float
    bits), and the ring advanced by the program that arrives last (an atomic counter: every other program has read
    the window and recorded its amax by then): on a first call every window slot gets the current amax, then the
    next slot is cleared and becomes the current one.  Program (0, 0) writes the scale."""
    h = tl.arange(0, BLOCK_H)
    pos = tl.load(hist_ptr + SLOTS).to(tl.int32)
    started = (tl.load(hist_ptr + SLOTS + 1) != 0.0) & (SLOTS > 1)
    window = tl.max(tl.load(hist_bits_ptr + h, mask=(h < SLOTS) & (h != pos), other=0), axis=0)
    m_bits = tl.where(started, window, tl.load(hist_bits_ptr + pos))
    m = m_bits.to(tl.float32, bitcast=True)
    scale = tl.where(m > 0.0, tl.div_rn(m, FMAX), 1.0)                  # (NaN: 1, as scale_from_amax)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bits = _cast_tile(x_ptr, q_ptr, qt_ptr, scale, pid_m, pid_n, M, N, s_xm, s_xn, FMAX, MANT, EMIN, BLOCK_M,
                      BLOCK_N, TRANSPOSE)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_ptr, scale)
    if started:
        tl.atomic_max(hist_bits_ptr + pos, bits)
    total = tl.num_programs(0) * tl.num_programs(1)
    arrived = tl.atomic_add(hist_ptr + SLOTS + 2, 1.0)                  # (acq_rel: after this program's record)
    if arrived == (total - 1).to(tl.float32):                           # the last program
        nxt = (pos + 1) % SLOTS
        if not started:
            cur = tl.load(hist_ptr + pos)
            tl.store(hist_ptr + h, tl.zeros([BLOCK_H], tl.float32) + cur, mask=(h < SLOTS) & (h != pos))
        tl.store(hist_ptr + nxt, 0.0)
        tl.store(hist_ptr + SLOTS, nxt.to(tl.float32))
        tl.store(hist_ptr + SLOTS + 1, tl.where(SLOTS > 1, 1.0, 0.0))
        tl.store(hist_ptr + SLOTS + 2, 0.0)
