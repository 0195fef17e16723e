"""Triton LayerNorm / RMSNorm kernels (imported only when triton is installed).

Forward: a program normalizes ROWS whole rows held in registers ([ROWS, BLOCK_N] tile), float32
statistics, optional fused residual add (the sum is written in the same pass).
Backward: a program walks a contiguous run of rows, writes dx (+ dsum) per row and keeps float32
partial sums of dweight / dbias in registers; the host sums the per-program partials (stage 2).
The row loop is software-pipelined (tl.range num_stages) so loads overlap the row reductions."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _norm_fwd_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, mean_ptr, rstd_ptr,
                     M, N, s_xm, s_rm, s_ym, s_sm, eps, offset,
                     RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]                      # element offsets can pass 2**31
    x = tl.load(x_ptr + rows64 * s_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + rows64 * s_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(s_ptr + rows64 * s_sm + cols[None, :], x.to(s_ptr.dtype.element_ty), mask=mask)
    if RMS:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        xhat = x * rstd[:, None]
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)           # padding columns must not count in var
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        xhat = xc * rstd[:, None]
        tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        xhat = xhat * (w + offset)[None, :]                  # offset: Gemma's (1 + w); 0 for LayerNorm
    if HAS_B:
        xhat += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64 * s_ym + cols[None, :], xhat.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(dy_ptr, ds_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr,
                     M, N, s_dym, s_dsm, s_xm, s_dxm, offset, rows_per_prog,
                     RMS: tl.constexpr, HAS_DSUM: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_prog                              # this program's contiguous run of rows
    # NUM_STAGES > 1: the next rows' loads are issued (cp.async) while the current rows reduce
    for i in tl.range(0, rows_per_prog, ROWS, num_stages=NUM_STAGES):
        rows = first + i + tl.arange(0, ROWS)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * s_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * s_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        if RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy
        if HAS_W:
            wdy = dy * w[None, :]                            # gradient w.r.t. xhat
        c1 = tl.sum(xhat * wdy, axis=1) / N                  # mean(xhat * dxhat)
        if RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N                     # mean(dxhat)
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DSUM:                                         # gradient flowing into the residual sum
            dx += tl.load(ds_ptr + rows64 * s_dsm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64 * s_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_DB:
            db_acc += tl.sum(dy, axis=0)
    if HAS_W:
        tl.store(dw_ptr + pid * N + cols, dw_acc, mask=cmask)   # stage 1: per-program partial sums
    if HAS_DB:
        tl.store(db_ptr + pid * N + cols, db_acc, mask=cmask)
