"""SwiGLU GEMM for Hopper (sm_90) in Gluon (Triton 3.6): one GEMM over the concatenated gate|up weight with
silu(g) * u in the epilogue, so gate_up never reaches memory.

    out = silu(x @ W_g + b_g) * (x @ W_u + b_u)      W = [W_g | W_u] (K, 2N), or its transpose given as (2N, K) rows

The cooperative schedule of gemm/gluon_kernel.py (its producer with TWO_B, tile order, ring barriers, slot release,
stream-K helpers and sigmoid are reused): a
persistent grid, one producer warp filling a STAGES-deep ring of TMA slots, one 8-warp consumer partition (two
warpgroups stacked along M) on a BM x BN output tile.  What differs:
  * each ring slot holds the A slice and *two* B slices of the same weight: the gate columns [n0, n0 + BN) and
    the up columns [N + n0, N + n0 + BN).  Two boxes of one descriptor, so a weight stays one tensor (no repack).
    In the last column tile the gate box may run past column N into the up half: those output columns are
    past N and the TMA store clips them; each output column reads only its own gate and up columns.
  * two float32 accumulators (gate, up), two async wgmmas per K-slice; the wait keeps the previous slice's
    pair in flight (num_outstanding=2: each async wgmma is one group).
  * the epilogue adds the biases (b_g at n, b_u at N + n), computes silu(g) * u in float32 and stores a
    BM x BN tile by TMA, in two column halves (half the epilogue's registers live at a time).
  * STREAM_K: the last waves' K-slices split evenly over the CTAs (see common/gluon_gemm_ring.py's stream-K notes); a
    shared tile's two partial sums (gate and up) meet in a float32 workspace before the SwiGLU epilogue.
Imported only by gluon.py, and only when triton.experimental.gluon imports."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ..common.gluon_gemm_ring import (GROUP_M, _b_slot, _invalidate_ring, _producer, _release, _ring_barriers,
                                     _sigmoid, _sk_chunk, _sk_offsets, _sk_publish, _sk_range, _sk_wait, _tile_coords)


@gluon.jit
def _mma_slices(a_smem, bg_smem, bu_smem, ready, empty, it, kb, ke, acc_layout: gl.constexpr,
                BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, B_NK: gl.constexpr):
    """(acc_g, acc_u, it): the gate and up sums over K-slices [kb, ke) of one tile from ring positions it, ...;
    every slot is freed once the wgmma pair reading it has retired."""
    acc_g = gl.zeros([BM, BN], gl.float32, acc_layout)
    acc_u = gl.zeros([BM, BN], gl.float32, acc_layout)
    for kk in range(kb, ke):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc_g = warpgroup_mma(a_smem.index(s), _b_slot(bg_smem, s, B_NK), acc_g, is_async=True)
        acc_u = warpgroup_mma(a_smem.index(s), _b_slot(bu_smem, s, B_NK), acc_u, is_async=True)
        # Two wgmma groups in flight: after this wait the previous slice's pair has retired.
        acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))
        if kk > kb:
            _release(empty.index((it - 1) % STAGES))
        it += 1
    acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
    _release(empty.index((it - 1) % STAGES))
    return acc_g, acc_u, it


@gluon.jit
def _swiglu_half(g, u, c_part, bias_ptr, off_n, N, HAS_BIAS: gl.constexpr, TANH: gl.constexpr):
    """silu(g + b_g) * (u + b_u) -> c_part for output columns [off_n, off_n + g.shape[1])."""
    layout: gl.constexpr = g.type.layout
    if HAS_BIAS:
        offs_n = off_n + gl.arange(0, g.shape[1], layout=gl.SliceLayout(0, layout))
        inside = offs_n < N
        g = g + gl.expand_dims(gl.load(bias_ptr + offs_n, mask=inside, other=0.0), 0).to(gl.float32)
        u = u + gl.expand_dims(gl.load(bias_ptr + N + offs_n, mask=inside, other=0.0), 0).to(gl.float32)
    y = g * _sigmoid(g, TANH) * u
    c_part.store(y.to(c_part.dtype))


@gluon.jit
def _swiglu_store(acc_g, acc_u, c_desc, c_smem, bias_ptr, off_m, off_n, N, HAS_BIAS: gl.constexpr,
                  TANH: gl.constexpr):
    """The epilogue in registers, then one TMA store of the BM x BN tile (clipped at M / N)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    # The previous tile's TMA store has finished reading c_smem before it is overwritten.
    tma.store_wait(0)
    gl.thread_barrier()
    BN2: gl.constexpr = BN // 2
    g_lo, g_hi = gl.split(gl.permute(gl.reshape(acc_g, [BM, 2, BN2]), (0, 2, 1)))
    u_lo, u_hi = gl.split(gl.permute(gl.reshape(acc_u, [BM, 2, BN2]), (0, 2, 1)))
    _swiglu_half(g_lo, u_lo, c_smem.slice(0, BN2, 1), bias_ptr, off_n, N, HAS_BIAS, TANH)
    _swiglu_half(g_hi, u_hi, c_smem.slice(BN2, BN2, 1), bias_ptr, off_n + BN2, N, HAS_BIAS, TANH)
    fence_async_shared()             # generic-proxy smem writes before the TMA (async proxy) reads them
    gl.thread_barrier()              # every warp's part is written before one thread issues the store
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, bias_ptr, ws_ptr, flags_ptr, a_smem, bg_smem, bu_smem, c_smem, ready, empty,
              M, N, K, DP_TILES, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, B_NK: gl.constexpr,
              TANH: gl.constexpr, STREAM_K: gl.constexpr, num_warps: gl.constexpr):
    """Main loop (two accumulators) + the SwiGLU epilogue of every tile of the CTA, then its stream-K chunks."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    # wgmma accumulators: warps stacked along M (16 rows each), instruction N = the whole tile width.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    it = 0
    for tile in range(gl.program_id(0), DP_TILES, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc_g, acc_u, it = _mma_slices(a_smem, bg_smem, bu_smem, ready, empty, it, 0, k_tiles, acc_layout,
                                       BM, BN, STAGES, B_NK)
        _swiglu_store(acc_g, acc_u, c_desc, c_smem, bias_ptr, pid_m * BM, pid_n * BN, N, HAS_BIAS, TANH)
    if STREAM_K:
        offs = _sk_offsets(gl.zeros([BM, BN], gl.int32, acc_layout), BN)
        cur, end = _sk_range(num_pid_m * num_pid_n - DP_TILES, k_tiles)
        while cur < end:
            t, kb, ke = _sk_chunk(cur, end, k_tiles)
            pid_m, pid_n = _tile_coords(DP_TILES + t, num_pid_m, num_pid_n, GROUP_M)
            acc_g, acc_u, it = _mma_slices(a_smem, bg_smem, bu_smem, ready, empty, it, kb, ke, acc_layout,
                                           BM, BN, STAGES, B_NK)
            ws = ws_ptr + t * (2 * BM * BN)                  # the tile's gate partial, then its up partial
            if kb > 0:
                # A K-tail: the CTA holding this tile's K-head finishes it.
                gl.store(ws + offs, acc_g)
                gl.store(ws + BM * BN + offs, acc_u)
                _sk_publish(flags_ptr + t)
            else:
                if ke < k_tiles:
                    # A K-head whose tail another CTA computed: add its partial sums (L2 reads: .cg).
                    _sk_wait(flags_ptr + t)
                    acc_g += gl.load(ws + offs, cache_modifier=".cg")
                    acc_u += gl.load(ws + BM * BN + offs, cache_modifier=".cg")
                _swiglu_store(acc_g, acc_u, c_desc, c_smem, bias_ptr, pid_m * BM, pid_n * BN, N, HAS_BIAS, TANH)
            cur += ke - kb
    tma.store_wait(0)


@gluon.jit
def swiglu_gemm_kernel(a_desc, b_desc, c_desc, bias_ptr, M, N, K, ws_ptr, flags_ptr, DP_TILES,
                       HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, B_NK: gl.constexpr, TANH: gl.constexpr,
                       STREAM_K: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Persistent grid (min(tiles, #SMs),).  a_desc block (BM, BK); b_desc (BK, BN) over the whole (K, 2N)
    weight, or (BN, BK) over its (2N, K) rows with B_NK; c_desc (BM, BN) over the (M, N) output.
    DP_TILES: the tiles walked whole (all of them without STREAM_K); with STREAM_K, ws_ptr a float32 workspace of
    2 x BM x BN per remaining tile and flags_ptr their int32 flags, zeroed (common/gluon_gemm.py stream_k_plan)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    B0: gl.constexpr = b_desc.block_type.shape[0]           # BK, or BN with B_NK
    B1: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
    bg_smem = gl.allocate_shared_memory(dtype, [STAGES, B0, B1], b_desc.layout)
    bu_smem = gl.allocate_shared_memory(dtype, [STAGES, B0, B1], b_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    c_smem = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)
    gl.warp_specialize([
        (_consumer, (a_desc, b_desc, c_desc, bias_ptr, ws_ptr, flags_ptr, a_smem, bg_smem, bu_smem, c_smem, ready,
                     empty, M, N, K, DP_TILES, HAS_BIAS, STAGES, B_NK, TANH, STREAM_K, num_warps)),
        (_producer, (a_desc, b_desc, a_smem, bg_smem, bu_smem, ready, empty, M, N, K, DP_TILES, STAGES, B_NK, BM,
                     BN, STREAM_K, True)),
    ], [1], [PRODUCER_REGS])
    _invalidate_ring(ready, empty, STAGES)
