"""Triton kernels of the swiglu op (swiglu.py): y = silu(g) * u over gate_up rows [g | u], and its backward.
One program per (row, column block): each element of gate_up is read once and each output written once,
in float32 registers whatever the storage dtype."""
import triton
import triton.language as tl


@triton.jit
def swiglu_fwd_kernel(GU, Y, N, s_gu, s_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)          # int64: rows * stride can pass 2^31 elements
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    g = tl.load(GU + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_gu + N + cols, mask=ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * s_y + cols, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_bwd_kernel(GU, DY, DGU, N, s_gu, s_dy, s_dgu, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    g = tl.load(GU + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_gu + N + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * s_dy + cols, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * (sig + silu * (1.0 - sig))
    tl.store(DGU + row * s_dgu + cols, dg.to(DGU.dtype.element_ty), mask=ok)
    tl.store(DGU + row * s_dgu + N + cols, (dy * silu).to(DGU.dtype.element_ty), mask=ok)
