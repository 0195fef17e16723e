"""Triton GEMM kernels with fused epilogues (imported only when triton is installed).

One kernel body serves four jobs, chosen by constexpr flags:
  forward           out = act(alpha * (a @ b) + bias) + residual
  forward, SWIGLU   out = silu(a @ b_g + bias_g) * (a @ b_u + bias_u)   (two accumulators per tile)
  backward (BWD)    out = grad * act'(alpha * (a @ b) + bias)           (recomputes the pre-activation)
  backward, SWIGLU  out[:, :N] = dgate, out[:, N:] = dup                  (recomputes gate and up)
`_gemm_kernel` loads tiles through pointers (any strides, any arch); `_gemm_tma_kernel` loads them
through host-built TMA tensor descriptors (Hopper+, 16-byte aligned rows), zero-padded out of bounds.
`_gemm_persistent_kernel` is the TMA kernel made persistent: a grid of about one program per SM walks
the tiles, its tile and K loops flattened into one software-pipelined loop so the next tile's loads
are in flight during this tile's epilogue; the forward can store through a TMA descriptor too."""
from __future__ import annotations

import triton
import triton.language as tl

ACT_IDS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}


@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 1:
        z = tl.where(z < 0.0, 0.0, z)       # NaN stays NaN, as torch.relu (GPU tl.maximum would return 0)
    elif ACT == 2:
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACT == 3:
        # 0.5 * (1 + tanh(y)) == sigmoid(2y), y = sqrt(2/pi) * (z + 0.044715 z^3)
        z = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif ACT == 4:
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    """d act / dz in float32."""
    if ACT == 0:
        g = tl.full(z.shape, 1.0, tl.float32)
    elif ACT == 1:
        g = tl.where(z > 0, 1.0, 0.0)
    elif ACT == 2:
        g = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACT == 3:
        s = tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
        # d/dz [z * s(2y)] = s + z * s (1 - s) * 2 y'
        g = s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z)
    else:
        s = tl.sigmoid(z)
        g = s * (1.0 + z * (1.0 - s))
    return g


@triton.jit
def _group_ids(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles share each column sweep so b stays in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    return _group_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit
def _fwd_values(acc, acc_u, rm, rn, M, N, bias_ptr, res_ptr, s_rm, s_rn, alpha,
                ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr):
    """The forward epilogue in float32 for rows rm, columns rn: act(alpha acc + bias) + residual,
    or silu(acc + bias_g) * (acc_u + bias_u)."""
    nm = rn < N
    z = acc * alpha
    if HAS_BIAS:
        z += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        zu = acc_u
        if HAS_BIAS:
            zu += tl.load(bias_ptr + N + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        y = z * tl.sigmoid(z) * zu
    else:
        y = _act(z, ACT)
        if HAS_RES:
            mask = (rm < M)[:, None] & nm[None, :]
            y += tl.load(res_ptr + rm.to(tl.int64)[:, None] * s_rm + rn[None, :] * s_rn,
                         mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _epilogue(acc, acc_u, rm, rn, M, N, out_ptr, bias_ptr, res_ptr, grad_ptr,
              s_om, s_on, s_rm, s_rn, s_gm, s_gn, alpha,
              ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              SWIGLU: tl.constexpr, BWD: tl.constexpr):
    mm = rm < M
    nm = rn < N
    mask = mm[:, None] & nm[None, :]
    rm64 = rm.to(tl.int64)                    # row offsets can pass 2**31 elements
    out_ptrs = out_ptr + rm64[:, None] * s_om + rn[None, :] * s_on
    if BWD:
        z = acc * alpha
        if HAS_BIAS:
            z += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        go = tl.load(grad_ptr + rm64[:, None] * s_gm + rn[None, :] * s_gn, mask=mask, other=0.0).to(tl.float32)
        if SWIGLU:
            zu = acc_u
            if HAS_BIAS:
                zu += tl.load(bias_ptr + N + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
            sg = tl.sigmoid(z)
            dg = go * zu * sg * (1.0 + z * (1.0 - sg))     # d/dg silu(g) * u
            du = go * z * sg                                # silu(g)
            tl.store(out_ptrs, dg.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out_ptrs + N * s_on, du.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptrs, (go * _act_grad(z, ACT)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        y = _fwd_values(acc, acc_u, rm, rn, M, N, bias_ptr, res_ptr, s_rm, s_rn, alpha,
                        ACT, HAS_BIAS, HAS_RES, SWIGLU)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, out_ptr, bias_ptr, res_ptr, grad_ptr, M, N, K, M_BUCKET,
                 s_am, s_ak, s_bk, s_bn, s_om, s_on, s_rm, s_rn, s_gm, s_gn, alpha,
                 ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                 SWIGLU: tl.constexpr, BWD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm = rm < M
    nm = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # the up half (SWIGLU only; dead otherwise)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        km = rk < K - k * BLOCK_K                               # K tail
        a = tl.load(a_ptrs, mask=mm[:, None] & km[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if SWIGLU:
            bu = tl.load(b_ptrs + N * s_bn, mask=km[:, None] & nm[None, :], other=0.0)   # matching up tile
            acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    _epilogue(acc, acc_u, rm, rn, M, N, out_ptr, bias_ptr, res_ptr, grad_ptr,
              s_om, s_on, s_rm, s_rn, s_gm, s_gn, alpha, ACT, HAS_BIAS, HAS_RES, SWIGLU, BWD)


@triton.jit
def _gemm_tma_kernel(a_desc, b_desc, out_ptr, bias_ptr, res_ptr, grad_ptr, M, N, K, M_BUCKET,
                     s_om, s_on, s_rm, s_rn, s_gm, s_gn, alpha,
                     ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     SWIGLU: tl.constexpr, BWD: tl.constexpr, B_NK: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        off_k = k * BLOCK_K
        a = a_desc.load([off_m, off_k])                # out-of-bounds rows/cols read as zero
        if B_NK:                                       # b given as (N, K) rows: nn.Linear weight
            acc = tl.dot(a, b_desc.load([off_n, off_k]).T, acc)
            if SWIGLU:
                acc_u = tl.dot(a, b_desc.load([off_n + N, off_k]).T, acc_u)
        else:
            acc = tl.dot(a, b_desc.load([off_k, off_n]), acc)
            if SWIGLU:
                acc_u = tl.dot(a, b_desc.load([off_k, off_n + N]), acc_u)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    _epilogue(acc, acc_u, rm, rn, M, N, out_ptr, bias_ptr, res_ptr, grad_ptr,
              s_om, s_on, s_rm, s_rn, s_gm, s_gn, alpha, ACT, HAS_BIAS, HAS_RES, SWIGLU, BWD)


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N) of a tile, as two register tiles."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _gemm_persistent_kernel(a_desc, b_desc, c_desc, out_ptr, bias_ptr, res_ptr, grad_ptr, M, N, K, M_BUCKET,
                            s_om, s_on, s_rm, s_rn, s_gm, s_gn, alpha,
                            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                            SWIGLU: tl.constexpr, BWD: tl.constexpr, B_NK: tl.constexpr, TMA_STORE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr, PER_SM: tl.constexpr):
    """Program p of P computes tiles p, p + P, p + 2P, ... (grouped order).  TMA_STORE (forward only):
    the tile leaves through c_desc (rows >= M / columns >= N are clipped by the copy engine), in two
    column halves under EPI_SPLIT (half the epilogue registers and staging buffer).  PER_SM only sizes
    the host's grid (programs per SM)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    step = tl.num_programs(0)
    # the epilogue's own tile counter: recomputing (pid_m, pid_n) from it keeps the flattened
    # loop's epilogue from depending on the values the pipeliner hoists for the next tile's loads
    tile_c = tl.program_id(0) - step
    for tile in tl.range(tl.program_id(0), num_m * num_n, step, flatten=True):
        pid_m, pid_n = _group_ids(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # the up half (SWIGLU only; dead otherwise)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])                      # out-of-bounds rows/cols read as zero
            if B_NK:
                acc = tl.dot(a, b_desc.load([off_n, off_k]).T, acc)
                if SWIGLU:
                    acc_u = tl.dot(a, b_desc.load([off_n + N, off_k]).T, acc_u)
            else:
                acc = tl.dot(a, b_desc.load([off_k, off_n]), acc)
                if SWIGLU:
                    acc_u = tl.dot(a, b_desc.load([off_k, off_n + N]), acc_u)
        tile_c += step
        pid_m, pid_n = _group_ids(tile_c, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rm = off_m + tl.arange(0, BLOCK_M)
        if TMA_STORE and EPI_SPLIT:
            HALF: tl.constexpr = BLOCK_N // 2
            acc0, acc1 = _halves(acc, BLOCK_M, BLOCK_N)
            u0, u1 = acc0, acc1                                 # placeholders when not SWIGLU (never read)
            if SWIGLU:
                u0, u1 = _halves(acc_u, BLOCK_M, BLOCK_N)
            rn = off_n + tl.arange(0, HALF)
            y = _fwd_values(acc0, u0, rm, rn, M, N, bias_ptr, res_ptr, s_rm, s_rn, alpha, ACT, HAS_BIAS, HAS_RES, SWIGLU)
            c_desc.store([off_m, off_n], y.to(c_desc.dtype))
            y = _fwd_values(acc1, u1, rm, rn + HALF, M, N, bias_ptr, res_ptr, s_rm, s_rn, alpha,
                            ACT, HAS_BIAS, HAS_RES, SWIGLU)
            c_desc.store([off_m, off_n + HALF], y.to(c_desc.dtype))
        elif TMA_STORE:
            rn = off_n + tl.arange(0, BLOCK_N)
            y = _fwd_values(acc, acc_u, rm, rn, M, N, bias_ptr, res_ptr, s_rm, s_rn, alpha, ACT, HAS_BIAS, HAS_RES, SWIGLU)
            c_desc.store([off_m, off_n], y.to(c_desc.dtype))
        else:
            rn = off_n + tl.arange(0, BLOCK_N)
            _epilogue(acc, acc_u, rm, rn, M, N, out_ptr, bias_ptr, res_ptr, grad_ptr,
                      s_om, s_on, s_rm, s_rn, s_gm, s_gn, alpha, ACT, HAS_BIAS, HAS_RES, SWIGLU, BWD)
