"""Triton kernels of the swiglu op (swiglu.py): y = silu(g) * u over gate_up rows [g | u], and its backward.
One program per (ROWS rows, BLOCK_N columns) tile: each element of gate_up is read once and each output written
once, in float32 registers whatever the storage dtype.  The tile shape is measured per shape bucket (swiglu.CONFIGS)."""
import triton
import triton.language as tl


@triton.jit
def swiglu_fwd_kernel(GU, Y, M, N, s_gu, s_y, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)    # int64: rows * stride can pass 2^31
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    gp = GU + rows[:, None] * s_gu + cols[None, :]
    g = tl.load(gp, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gp + N, mask=ok, other=0.0).to(tl.float32)                # u: the row's second half
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * s_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_bwd_kernel(GU, DY, DGU, M, N, s_gu, s_dy, s_dgu, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    gp = GU + rows[:, None] * s_gu + cols[None, :]
    g = tl.load(gp, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gp + N, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * s_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * (sig + silu * (1.0 - sig))
    dp = DGU + rows[:, None] * s_dgu + cols[None, :]
    tl.store(dp, dg.to(DGU.dtype.element_ty), mask=ok)
    tl.store(dp + N, (dy * silu).to(DGU.dtype.element_ty), mask=ok)
