"""Triton kernels of the swiglu op (swiglu.py): y = act(g) * u over gate_up rows [g | u], and its backward; act silu
(ACT 4, SwiGLU) or gelu_tanh (ACT 3, GeGLU), a constexpr switch: gelu_tanh and its derivative are the GEMM
epilogue's functions (gemm/kernels.py _act / _act_grad, ids as its ACT_IDS).
Each element of gate_up is read once and each output written once, in float32 registers whatever the storage
dtype.  A program covers one (ROWS rows, BLOCK_N columns) tile, or with ROWS == 0 BLOCK_N consecutive elements
of the flattened (M, N) output (no ragged last column block per row; one division per element, in int32 when
M * N fits: IDX64 otherwise).  The tile shape is measured per shape bucket (swiglu.CONFIGS)."""
import triton
import triton.language as tl

from ..gemm.kernels import _act, _act_grad


@triton.jit
def _rows_cols(M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, IDX64: tl.constexpr):
    """(rows[:, None], cols[None, :], in-bounds mask) of this program's elements, as 2-D index tensors."""
    if ROWS == 0:
        if IDX64:
            idx = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = idx < M.to(tl.int64) * N                # M * N passes int32 here
        else:
            idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = idx < M * N
        r = idx // N
        rr, cc, mask = r.to(tl.int64)[None, :], (idx - r * N)[None, :], ok[None, :]
    else:   # (no early return: Triton traces the code after a constexpr-if's return too)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)    # int64: rows * stride can pass 2^31
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr, cc, mask = rows[:, None], cols[None, :], (rows[:, None] < M) & (cols[None, :] < N)
    return rr, cc, mask


@triton.jit
def swiglu_fwd_kernel(GU, Y, M, N, s_gu, s_y, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, IDX64: tl.constexpr,
                      ACT: tl.constexpr = 4):
    r, c, ok = _rows_cols(M, N, ROWS, BLOCK_N, IDX64)
    gp = GU + r * s_gu + c
    g = tl.load(gp, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gp + N, mask=ok, other=0.0).to(tl.float32)                # u: the row's second half
    if ACT == 4:
        y = g * tl.sigmoid(g) * u
    else:
        y = _act(g, ACT) * u
    tl.store(Y + r * s_y + c, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_bwd_kernel(GU, DY, DGU, M, N, s_gu, s_dy, s_dgu, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      IDX64: tl.constexpr, ACT: tl.constexpr = 4):
    r, c, ok = _rows_cols(M, N, ROWS, BLOCK_N, IDX64)
    gp = GU + r * s_gu + c
    g = tl.load(gp, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gp + N, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + r * s_dy + c, mask=ok, other=0.0).to(tl.float32)
    if ACT == 4:
        sig = tl.sigmoid(g)
        a = g * sig
        # d silu / dg = sig * (1 + g * (1 - sig))
        da = sig + a * (1.0 - sig)
    else:
        a = _act(g, ACT)
        da = _act_grad(g, ACT)
    dp = DGU + r * s_dgu + c
    tl.store(dp, (dy * u * da).to(DGU.dtype.element_ty), mask=ok)
    tl.store(dp + N, (dy * a).to(DGU.dtype.element_ty), mask=ok)
