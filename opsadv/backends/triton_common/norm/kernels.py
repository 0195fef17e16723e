"""Triton LayerNorm / RMSNorm kernels (imported only when triton is installed).

Forward: a program normalizes ROWS whole rows held in registers ([ROWS, BLOCK_N] tile), float32
statistics, optional fused residual add (the sum is written in the same pass); for long rows also a looped
variant (_norm_fwd_loop_kernel: CHUNK columns at a time, the row re-read from L2 for the output pass).
Backward: a program walks a contiguous run of rows, writes dx (+ dsum) per row and keeps float32
partial sums of dweight / dbias in registers; the host sums the per-program partials (stage 2).
The next tile's loads are issued before the current tile reduces (register double buffering)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _norm_fwd_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, mean_ptr, rstd_ptr,
                     M, N, s_xm, s_rm, s_ym, s_sm, eps, offset,
                     RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STATS: tl.constexpr = True,
                     EVICT: tl.constexpr = False, F64: tl.constexpr = False):
    # STATS=False: inference, nobody reads mean / rstd (their pointers are not written).
    # EVICT: cache hints as Inductor's norm kernels carry them: rows are read once (evict first from L2), the
    # weight / bias by every program (evict last); a tuner candidate (norm.fwd_candidates)
    # F64: statistics (and the normalization) in float64 (the precision policy's norm="fp64")
    STREAM: tl.constexpr = "evict_first" if EVICT else ""
    KEEP: tl.constexpr = "evict_last" if EVICT else ""
    ACC: tl.constexpr = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]                      # element offsets can pass 2**31
    x = tl.load(x_ptr + rows64 * s_xm + cols[None, :], mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + rows64 * s_rm + cols[None, :], mask=mask, other=0.0,
                     eviction_policy=STREAM).to(tl.float32)
        tl.store(s_ptr + rows64 * s_sm + cols[None, :], x.to(s_ptr.dtype.element_ty), mask=mask)
    x = x.to(ACC)
    if RMS:
        rstd = _rsqrt(tl.sum(x * x, axis=1) / N + eps, F64)
        xhat = x * rstd[:, None]
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)           # padding columns must not count in var
        rstd = _rsqrt(tl.sum(xc * xc, axis=1) / N + eps, F64)
        xhat = xc * rstd[:, None]
        if STATS:
            tl.store(mean_ptr + rows, mean.to(tl.float32), mask=rmask)
    if STATS:
        tl.store(rstd_ptr + rows, rstd.to(tl.float32), mask=rmask)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0, eviction_policy=KEEP).to(ACC)
        xhat = xhat * (w + offset)[None, :]                  # offset: Gemma's (1 + w); 0 for LayerNorm
    if HAS_B:
        xhat += tl.load(b_ptr + cols, mask=cmask, other=0.0, eviction_policy=KEEP).to(ACC)[None, :]
    tl.store(y_ptr + rows64 * s_ym + cols[None, :], xhat.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rsqrt(v, F64: tl.constexpr):
    if F64:
        return 1.0 / tl.sqrt(v)
    return tl.rsqrt(v)


@triton.jit
def _row_chunk(x_ptr, r_ptr, rows64, s_xm, s_rm, cols, mask, HAS_RES: tl.constexpr, POLICY: tl.constexpr):
    """x (+ the residual) over one [ROWS, CHUNK] piece, in float32; masked elements 0."""
    x = tl.load(x_ptr + rows64 * s_xm + cols[None, :], mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + rows64 * s_rm + cols[None, :], mask=mask, other=0.0,
                     eviction_policy=POLICY).to(tl.float32)
    return x


@triton.jit
def _norm_fwd_loop_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, mean_ptr, rstd_ptr,
                          M, N, s_xm, s_rm, s_ym, s_sm, eps, offset,
                          RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                          ROWS: tl.constexpr, CHUNK: tl.constexpr, STATS: tl.constexpr = True,
                          N_FIXED: tl.constexpr = 0, F64: tl.constexpr = False):
    # Long rows in CHUNK-column pieces, as Inductor's looped reductions: the statistics pass streams the row
    # from HBM and asks L2 to keep it (evict_last), the output pass re-reads it from L2 (evict_first).  Fewer
    # registers per row than _norm_fwd_kernel -> more rows in flight per SM (RMSNorm 16384 x 8192: compile's
    # looped kernel 0.129 ms vs 0.135 whole-row).
    # N_FIXED (> 0: the hidden size, compiled in, as Inductor's kernel has it): constant trip counts and, when
    # CHUNK divides it, no column masks -- the loops unroll and the chunks' loads can all be in flight at once.
    # F64: statistics (and the normalization) in float64 (the precision policy's norm="fp64")
    ACC: tl.constexpr = tl.float64 if F64 else tl.float32
    if N_FIXED > 0:
        N = N_FIXED
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    acc = tl.zeros([ROWS, CHUNK], dtype=ACC)
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = rmask[:, None] & (cols < N)[None, :]
        x = _row_chunk(x_ptr, r_ptr, rows64, s_xm, s_rm, cols, mask, HAS_RES, "evict_last")
        if HAS_RES:
            tl.store(s_ptr + rows64 * s_sm + cols[None, :], x.to(s_ptr.dtype.element_ty), mask=mask)
        x = x.to(ACC)
        acc += x * x if RMS else x                          # masked columns loaded as 0: they add nothing
    if RMS:
        mean = tl.zeros([ROWS], dtype=ACC)
        rstd = _rsqrt(tl.sum(acc, axis=1) / N + eps, F64)
    else:
        mean = tl.sum(acc, axis=1) / N
        acc = tl.zeros([ROWS, CHUNK], dtype=ACC)
        for c0 in range(0, N, CHUNK):                       # variance around the mean (not E[x^2] - mean^2)
            cols = c0 + tl.arange(0, CHUNK)
            mask = rmask[:, None] & (cols < N)[None, :]
            x = _row_chunk(x_ptr, r_ptr, rows64, s_xm, s_rm, cols, mask, HAS_RES, "evict_last").to(ACC)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            acc += xc * xc
        rstd = _rsqrt(tl.sum(acc, axis=1) / N + eps, F64)
        if STATS:
            tl.store(mean_ptr + rows, mean.to(tl.float32), mask=rmask)
    if STATS:
        tl.store(rstd_ptr + rows, rstd.to(tl.float32), mask=rmask)
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        x = _row_chunk(x_ptr, r_ptr, rows64, s_xm, s_rm, cols, mask, HAS_RES, "evict_first").to(ACC)
        xhat = (x - mean[:, None]) * rstd[:, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0, eviction_policy="evict_last").to(ACC)
            xhat = xhat * (w + offset)[None, :]
        if HAS_B:
            xhat += tl.load(b_ptr + cols, mask=cmask, other=0.0, eviction_policy="evict_last").to(ACC)[None, :]
        tl.store(y_ptr + rows64 * s_ym + cols[None, :], xhat.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_rows(x_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, rmask, cols, cmask, s_xm, s_dym, RMS: tl.constexpr):
    """Loads one [ROWS, BLOCK_N] tile of x and dy (input dtype) and the rows' saved statistics."""
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]                      # element offsets can pass 2**31
    x = tl.load(x_ptr + rows64 * s_xm + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows64 * s_dym + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    mean = rstd
    if not RMS:
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
    return x, dy, mean, rstd


@triton.jit(do_not_specialize=["M", "rows_per_prog"])
def _norm_bwd_kernel(dy_ptr, ds_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr,
                     M, N, s_dym, s_dsm, s_xm, s_dxm, offset, rows_per_prog,
                     RMS: tl.constexpr, HAS_DSUM: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    # [ROWS, BLOCK_N] accumulators: the sum over the tile's rows waits for the end (no per-row
    # cross-warp reduction)
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    first = pid * rows_per_prog                              # this program's contiguous run of rows
    last = tl.minimum(first + rows_per_prog, M)
    rows = first + tl.arange(0, ROWS)
    # the next tile's loads are issued before the current tile reduces, so each program keeps a
    # tile of reads in flight through its reductions and stores (register double buffering)
    x_nx, dy_nx, mean_nx, rstd_nx = _bwd_rows(x_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, rows < last, cols, cmask,
                                              s_xm, s_dym, RMS)
    for start in range(first, last, ROWS):
        rows = start + tl.arange(0, ROWS)
        rmask = rows < last
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x, dy, mean, rstd = x_nx, dy_nx, mean_nx, rstd_nx
        nxt = rows + ROWS
        x_nx, dy_nx, mean_nx, rstd_nx = _bwd_rows(x_ptr, dy_ptr, mean_ptr, rstd_ptr, nxt, nxt < last, cols, cmask,
                                                  s_xm, s_dym, RMS)
        if HAS_DSUM:                                         # gradient flowing into the residual sum
            ds = tl.load(ds_ptr + rows64 * s_dsm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        if RMS:
            xhat = x * rstd[:, None]
        else:
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
        if HAS_DSUM:
            dx += ds
        tl.store(dx_ptr + rows64 * s_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += dy * xhat
        if HAS_DB:
            db_acc += dy
    if HAS_W:                                                # stage 1: per-program partial sums
        tl.store(dw_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_DB:
        tl.store(db_ptr + pid * N + cols, tl.sum(db_acc, axis=0), mask=cmask)


@triton.jit
def _norm_bwd_reduce_kernel(dw_part_ptr, db_part_ptr, dw_ptr, db_ptr, P, N,
                            HAS_W: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stage 2: dweight / dbias = column sums of the (P, N) float32 partials, cast to the output dtype.
    One launch for both (the host cost of four torch ops was the backward's bottleneck); each program
    sums a BLOCK_N-wide column strip over the partials in a fixed order, so the result is deterministic."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc_w = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < P) & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_W:
            acc_w += tl.load(dw_part_ptr + offs, mask=mask, other=0.0)
        if HAS_DB:
            acc_b += tl.load(db_part_ptr + offs, mask=mask, other=0.0)
    if HAS_W:
        tl.store(dw_ptr + cols, tl.sum(acc_w, axis=0).to(dw_ptr.dtype.element_ty), mask=cmask)
    if HAS_DB:
        tl.store(db_ptr + cols, tl.sum(acc_b, axis=0).to(db_ptr.dtype.element_ty), mask=cmask)
