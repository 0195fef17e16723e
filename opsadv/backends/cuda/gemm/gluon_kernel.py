"""Warp-specialized persistent GEMM with a fused epilogue for Hopper (sm_90), in Gluon (Triton 3.6).

    C = act(alpha * A @ B + bias) (+ residual)      A (M, K), B (K, N) or, with B_NK, B^T given as (N, K)

Every variant compiles for sm_90 with ptxas with no spills (tests/test_gluon_gemm.py; registers / shared
memory in gluon.py's docstring) and passes every check against
float64 on the H200 (pinned conformance:
docs/conformance/cuda-h200-gluon-gemm.md).

Imported only by gluon.py, and only when triton.experimental.gluon imports.

Per CTA (persistent: grid <= #SMs, each CTA walks tiles pid, pid + nprog, ... in grouped (L2-friendly)
order):
  * one producer warp (setmaxnreg low) issues every TMA load of A and B K-slices into a STAGES-deep ring
    of shared-memory slots; per slot a "ready" mbarrier (TMA transaction bytes) and an "empty" mbarrier
    (one arrive per consumer partition that read it).  K tails arrive zero-filled by TMA.
  * the consumers run async wgmma from shared memory with one wgmma group in flight, free each slot
    once the wgmma reading it has retired, then run the epilogue from registers (alpha, bias,
    activation, residual, cast) in two column halves (half the registers live at a time) and store
    through a shared-memory tile with a TMA store (clipped at the M / N edges, so any M and N are exact).
    The residual tile is TMA-loaded into that shared tile first and read back in the accumulator's
    layout.  The TMA store of tile i is waited for only before the shared tile is written again (tile
    i + 1's epilogue), so it overlaps the next main loop.

Variants (constexpr PINGPONG):
  * cooperative (PINGPONG=False): one 8-warp consumer partition (two warpgroups, warps stacked along M)
    on one BM x BN tile (128 x 256, or 256 x 128); each warpgroup owns 64-row slices of it.
  * ping-pong (PINGPONG=True): two 4-warp consumer partitions, each its own 128 x 128 tile (the CTA's
    even / odd tiles), taking turns through two "turn" mbarriers for their main loops (CUTLASS
    KernelTmaWarpSpecializedPingpong): one warpgroup's epilogue runs while the other's wgmmas hold the
    tensor cores.  Each ring slot is read by exactly one partition (empty barrier count 1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ..common.gluon_gemm_ring import (GROUP_M, TANH_FAST, _b_slot, _invalidate_ring, _producer, _release,
                                     _ring_barriers, _sigmoid, _sk_chunk, _sk_offsets, _sk_publish, _sk_range,
                                     _sk_wait, _tile_coords)

ACT_IDS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}


@gluon.jit
def _act(z, ACT: gl.constexpr):
    """The activation in float32, with the same formulas as the Triton kernels (triton_common/gemm/kernels.py's _act);
    ACT + TANH_FAST: gelu_tanh / silu with the tanh.approx sigmoid."""
    if ACT == 1:
        z = gl.where(z < 0.0, 0.0, z)       # NaN stays NaN, as torch.relu (gl.maximum would return 0)
    elif ACT == 2:
        z = 0.5 * z * (1.0 + gl.erf(z * 0.7071067811865476))
    elif ACT % TANH_FAST == 3:
        # 0.5 * (1 + tanh(y)) == sigmoid(2y), y = sqrt(2/pi) * (z + 0.044715 z^3)
        z = z * _sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z), ACT >= TANH_FAST)
    elif ACT % TANH_FAST == 4:
        z = z * _sigmoid(z, ACT >= TANH_FAST)
    return z


@gluon.jit
def _epilogue_half(acc, c_part, bias_ptr, off_n, N, alpha, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                   HAS_RES: gl.constexpr):
    """y = act(alpha * acc + bias) (+ the residual already in c_part) -> c_part, for columns
    [off_n, off_n + acc.shape[1]) of the tile; acc's layout is whatever the split gave it."""
    layout: gl.constexpr = acc.type.layout
    y = acc * alpha
    if HAS_BIAS:
        offs_n = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        y = y + gl.expand_dims(bias, 0).to(gl.float32)
    y = _act(y, ACT)
    if HAS_RES:
        y = y + c_part.load(layout).to(gl.float32)
        gl.thread_barrier()      # every warp has read its residual before any warp overwrites the tile
    c_part.store(y.to(c_part.dtype))


@gluon.jit
def _mma_slices(a_smem, b_smem, ready, empty, it, kb, ke, acc_layout: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr, STAGES: gl.constexpr, B_NK: gl.constexpr, PINGPONG: gl.constexpr, turn, WG):
    """(acc, it): one tile's sum over K-slices [kb, ke) from ring positions it, ...; every slot is freed once the
    wgmma reading it has retired.  PINGPONG: passes the tensor-core turn after the last wgmma is issued."""
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for kk in range(kb, ke):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(s), _b_slot(b_smem, s, B_NK), acc, is_async=True)
        # Keep one wgmma group in flight: the previous slice's has retired after this wait.
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        if kk > kb:
            _release(empty.index((it - 1) % STAGES))
        it += 1
    if PINGPONG:
        # Our last wgmma is issued: the other warpgroup may issue its main loop under our epilogue.
        mbarrier.arrive(turn.index(1 - WG), count=1)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    _release(empty.index((it - 1) % STAGES))
    return acc, it


@gluon.jit
def _store_tile(acc, c_desc, r_desc, c_smem, res_bar, res_phase, bias_ptr, off_m, off_n, N, alpha, ws, add_ws,
                ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr):
    """The epilogue in registers, then one TMA store of the tile (clipped at M / N); returns the next res_phase.
    add_ws: first add the partial sums another CTA left at ws (stream-K), one column half at a time (a whole
    128 x 256 workspace tile next to the accumulator would need 256 registers per thread)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    # The previous tile's TMA store has finished reading c_smem (the issuing thread waits; the
    # barrier makes every warp wait for it) before it is overwritten.
    tma.store_wait(0)
    gl.thread_barrier()
    if HAS_RES:
        # The residual tile comes in by TMA through c_smem (zero-filled past M / N) while the
        # activation runs: no per-element pointers in registers.
        mbarrier.expect(res_bar, r_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(r_desc, [off_m, off_n], res_bar, c_smem)
    # Two column halves one after the other: half the epilogue's registers live at a time.
    BN2: gl.constexpr = BN // 2
    lo, hi = gl.split(gl.permute(gl.reshape(acc, [BM, 2, BN2]), (0, 2, 1)))
    if HAS_RES:
        mbarrier.wait(res_bar, res_phase)
        res_phase ^= 1
    if add_ws:     # L2 reads (.cg): another SM wrote them
        lo += gl.load(ws + _sk_offsets(lo, BN), cache_modifier=".cg")
    _epilogue_half(lo, c_smem.slice(0, BN2, 1), bias_ptr, off_n, N, alpha, ACT, HAS_BIAS, HAS_RES)
    if add_ws:
        hi += gl.load(ws + BN2 + _sk_offsets(hi, BN), cache_modifier=".cg")
    _epilogue_half(hi, c_smem.slice(BN2, BN2, 1), bias_ptr, off_n + BN2, N, alpha, ACT, HAS_BIAS, HAS_RES)
    fence_async_shared()             # generic-proxy smem writes before the TMA (async proxy) reads them
    gl.thread_barrier()              # every warp's part is written before one thread issues the store
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)    # clipped at M / N
    return res_phase


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, r_desc, bias_ptr, ws_ptr, flags_ptr, a_smem, b_smem, c_smem, ready, empty,
              turn, res_bar, M, N, K, alpha, DP_TILES,
              ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, STAGES: gl.constexpr,
              B_NK: gl.constexpr, PINGPONG: gl.constexpr, STREAM_K: gl.constexpr, WG: gl.constexpr,
              num_warps: gl.constexpr):
    """Main loop + epilogue of this partition's tiles: every tile of the CTA (cooperative), or every
    other one starting at WG (ping-pong); then (cooperative, STREAM_K) the CTA's stream-K chunks."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    # wgmma accumulator: warps stacked along M (16 rows each), instruction N = the whole tile width.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    NWG: gl.constexpr = 2 if PINGPONG else 1                 # consumer partitions sharing the CTA's tiles
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    nprog = gl.num_programs(0)
    local = WG                                               # index of the tile among the CTA's tiles
    res_phase = 0
    it = 0
    for tile in range(gl.program_id(0) + WG * nprog, DP_TILES, NWG * nprog):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        it = local * k_tiles                                 # ring position of this tile's first K-slice
        if PINGPONG:
            # Our turn for the tensor cores: WG's (local // 2)-th turn; turn[0] is pre-arrived once.
            mbarrier.wait(turn.index(WG), (local // 2) & 1)
        acc, it = _mma_slices(a_smem, b_smem, ready, empty, it, 0, k_tiles, acc_layout, BM, BN, STAGES, B_NK,
                              PINGPONG, turn, WG)
        res_phase = _store_tile(acc, c_desc, r_desc, c_smem, res_bar, res_phase, bias_ptr, pid_m * BM, pid_n * BN,
                                N, alpha, ws_ptr, False, ACT, HAS_BIAS, HAS_RES)
        local += NWG
    if STREAM_K:      # cooperative only (gluon.VARIANTS)
        cur, end = _sk_range(num_pid_m * num_pid_n - DP_TILES, k_tiles)
        while cur < end:
            t, kb, ke = _sk_chunk(cur, end, k_tiles)
            pid_m, pid_n = _tile_coords(DP_TILES + t, num_pid_m, num_pid_n, GROUP_M)
            acc, it = _mma_slices(a_smem, b_smem, ready, empty, it, kb, ke, acc_layout, BM, BN, STAGES, B_NK,
                                  False, turn, WG)
            ws = ws_ptr + t * (BM * BN)
            if kb > 0:
                # A K-tail: the CTA holding this tile's K-head finishes it.
                gl.store(ws + _sk_offsets(acc, BN), acc)
                _sk_publish(flags_ptr + t)
            else:
                # A K-head, whole or with a tail another CTA computed (then added from ws).
                shared = ke < k_tiles
                if shared:
                    _sk_wait(flags_ptr + t)
                res_phase = _store_tile(acc, c_desc, r_desc, c_smem, res_bar, res_phase, bias_ptr, pid_m * BM,
                                        pid_n * BN, N, alpha, ws, shared, ACT, HAS_BIAS, HAS_RES)
            cur += ke - kb
    tma.store_wait(0)


@gluon.jit
def gemm_kernel(a_desc, b_desc, c_desc, r_desc, bias_ptr, M, N, K, alpha, ws_ptr, flags_ptr, DP_TILES,
                ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, STAGES: gl.constexpr,
                B_NK: gl.constexpr, PINGPONG: gl.constexpr, STREAM_K: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Persistent grid (min(tiles, #SMs),).  a_desc block (BM, BK); b_desc (BK, BN), or (BN, BK) with
    B_NK; c_desc and r_desc (the residual; c_desc when HAS_RES is off) (BM, BN) = one consumer
    partition's tile.  num_warps: 8 cooperative, 4 ping-pong (the
    default partition is then consumer warpgroup 0).  DP_TILES: the tiles walked whole (all of them without
    STREAM_K, which only the cooperative schedule takes); with STREAM_K, ws_ptr a float32 workspace of BM x BN per
    remaining tile and flags_ptr their int32 flags, zeroed (common/gluon_gemm.py stream_k_plan)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    B0: gl.constexpr = b_desc.block_type.shape[0]           # BK, or BN with B_NK
    B1: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES, B0, B1], b_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    res_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # per consumer partition
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(res_bar.index(i), count=1)
    if PINGPONG:
        c_smem = gl.allocate_shared_memory(dtype, [2, BM, BN], c_desc.layout)   # one output tile per warpgroup
        mbarrier.arrive(turn.index(0), count=1)     # warpgroup 0 issues first
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, c_desc, r_desc, bias_ptr, ws_ptr, flags_ptr, a_smem, b_smem, c_smem.index(0),
                         ready, empty, turn, res_bar.index(0), M, N, K, alpha, DP_TILES, ACT, HAS_BIAS, HAS_RES, STAGES,
                         B_NK, True, False, 0, 4)),
            (_consumer, (a_desc, b_desc, c_desc, r_desc, bias_ptr, ws_ptr, flags_ptr, a_smem, b_smem, c_smem.index(1),
                         ready, empty, turn, res_bar.index(1), M, N, K, alpha, DP_TILES, ACT, HAS_BIAS, HAS_RES, STAGES,
                         B_NK, True, False, 1, 4)),
            (_producer, (a_desc, b_desc, a_smem, b_smem, b_smem, ready, empty, M, N, K, DP_TILES, STAGES, B_NK, BM,
                         BN, False, False)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        c_smem = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, c_desc, r_desc, bias_ptr, ws_ptr, flags_ptr, a_smem, b_smem, c_smem, ready,
                         empty, turn, res_bar.index(0), M, N, K, alpha, DP_TILES, ACT, HAS_BIAS, HAS_RES, STAGES,
                         B_NK, False, STREAM_K, 0, num_warps)),
            (_producer, (a_desc, b_desc, a_smem, b_smem, b_smem, ready, empty, M, N, K, DP_TILES, STAGES, B_NK, BM,
                         BN, STREAM_K, False)),
        ], [1], [PRODUCER_REGS])
    _invalidate_ring(ready, empty, STAGES)
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
        mbarrier.invalidate(res_bar.index(i))
