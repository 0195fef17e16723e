"""Gluon device helpers of the warp-specialized persistent GEMMs (cuda/gemm/gluon_kernel.py and
cuda/swiglu_gemm/gluon_kernel.py): the grouped tile order, stream-K segments and their fix-up flags, the TMA
producer warp that fills the A / B ring, the ring's barriers, and the tanh.approx sigmoid of the epilogues.
Imported only by those kernel modules, and only when triton.experimental.gluon imports."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

GROUP_M = gl.constexpr(8)   # row-tiles per group of the L2-friendly tile order
LOG2E = gl.constexpr(1.4426950408889634)
TANH_FAST = gl.constexpr(8)   # added to ACT: gelu_tanh / silu through one tanh.approx (see _sigmoid)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP: gl.constexpr):
    """Grouped order: GROUP row-tiles share each sweep over the columns, so B stays in L2."""
    per_group = GROUP * num_pid_n
    first_m = (tile // per_group) * GROUP
    size_m = gl.minimum(num_pid_m - first_m, GROUP)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


# ---- stream-K: the last waves' K-slices shared evenly by every CTA (gluon_gemm.py stream_k_plan) ----
# A persistent launch of T tiles on P CTAs takes ceil(T / P) tile-times while the work is T / P: at 4096 tiles on
# 132 SMs (8192^3 with 128x128 output tiles) 32 vs 31.03, 3% idle.  With STREAM_K the first DP_TILES tiles (whole
# waves) run as before; the K-slices of the other P + T % P tiles are cut into P equal contiguous segments, one
# per CTA, each at least one tile long, so a tile is shared by at most two CTAs.  A segment's first chunk is the
# K-tail of a tile whose K-head ends the previous CTA's segment: it stores its float32 partial sums to a workspace
# and releases the tile's flag; the CTA holding the K-head (its segment's last chunk) acquires the flag, adds the
# partial sums and runs the epilogue.  A CTA waits only at its segment's end, and only for the next CTA's first
# chunk, which that CTA publishes before it waits on anything: no cycle, and the waits resolve even where fewer SMs
# than CTAs are free (a CTA that has not started yet starts once an earlier one exits).  Deterministic: one partial
# per tile, added in a fixed order.  Cooperative schedule only (PINGPONG off).


@gluon.jit
def _sk_range(sk_tiles, k_tiles):
    """This CTA's stream-K segment [start, end) of the sk_tiles * k_tiles K-slices: equal shares, the first
    (total % nprog) CTAs one slice more."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    total = sk_tiles * k_tiles
    per = total // nprog
    extra = total % nprog
    start = pid * per + gl.minimum(pid, extra)
    return start, start + per + (pid < extra).to(gl.int32)


@gluon.jit
def _sk_chunk(cur, end, k_tiles):
    """The chunk of a segment at slice cur: (stream-K tile index t, first K-slice kb, end K-slice ke)."""
    t = cur // k_tiles
    kb = cur - t * k_tiles
    return t, kb, gl.minimum(k_tiles, kb + (end - cur))


@gluon.jit
def _sk_offsets(like, ROW: gl.constexpr):
    """Offsets of a block of a row-major workspace tile (rows ROW apart) in the shape and layout of tensor like."""
    layout: gl.constexpr = like.type.layout
    rows = gl.arange(0, like.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, like.shape[1], layout=gl.SliceLayout(0, layout))
    return gl.expand_dims(rows, 1) * ROW + gl.expand_dims(cols, 0)


@gluon.jit
def _sk_publish(flag_ptr):
    """The partition's partial-sum stores are issued (barrier), then the tile's flag is set with release
    semantics at GPU scope: the finisher's acquire sees every store (CUTLASS's stream-K fixup barrier)."""
    gl.thread_barrier()
    gl.atomic_xchg(flag_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _sk_wait(flag_ptr):
    """Spin until the tile's partial sums are published (acquire at GPU scope), then let every warp read them."""
    while gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu") == 0:
        pass
    gl.thread_barrier()


@gluon.jit
def _sigmoid(x, FAST: gl.constexpr):
    """FAST: 0.5 * tanh(x / 2) + 0.5 with PTX tanh.approx.f32, one MUFU operation per element instead of
    two (ex2, then the reciprocal of the division): the epilogue's MUFU work is ~6% of a 128x256x4096
    tile's main loop on an H100/H200, so this halves it.  tanh.approx's relative error is ~2^-11."""
    if FAST:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * x], dtype=gl.float32,
                                      is_pure=True, pack=1)
        y = 0.5 * t + 0.5
    else:
        y = 1.0 / (1.0 + gl.exp2(-LOG2E * x))
    return y


@gluon.jit
def _load_slices(a_desc, b_desc, a_smem, b_smem, b2_smem, ready, empty, it, off_m, off_n, off_n2, kb, ke,
                 STAGES: gl.constexpr, B_NK: gl.constexpr, TWO_B: gl.constexpr):
    """Fill ring positions it, it + 1, ... with K-slices [kb, ke) of one tile's A and B boxes; returns the next.
    TWO_B (the SwiGLU kernel): a second B box of the same weight at column (or, with B_NK, row) off_n2 into b2_smem."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    B_BOXES: gl.constexpr = 2 if TWO_B else 1
    for kk in range(kb, ke):
        s = it % STAGES
        # Parity of the slot's previous use: on the first lap, parity 1 of a fresh barrier passes at once.
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + B_BOXES * b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], ready.index(s), a_smem.index(s))
        if B_NK:
            tma.async_copy_global_to_shared(b_desc, [off_n, kk * BK], ready.index(s), b_smem.index(s))
            if TWO_B:
                tma.async_copy_global_to_shared(b_desc, [off_n2, kk * BK], ready.index(s), b2_smem.index(s))
        else:
            tma.async_copy_global_to_shared(b_desc, [kk * BK, off_n], ready.index(s), b_smem.index(s))
            if TWO_B:
                tma.async_copy_global_to_shared(b_desc, [kk * BK, off_n2], ready.index(s), b2_smem.index(s))
        it += 1
    return it


@gluon.jit
def _producer(a_desc, b_desc, a_smem, b_smem, b2_smem, ready, empty, M, N, K, DP_TILES,
              STAGES: gl.constexpr, B_NK: gl.constexpr, TILE_M: gl.constexpr, TILE_N: gl.constexpr,
              STREAM_K: gl.constexpr, TWO_B: gl.constexpr):
    """1 warp: walks the CTA's tiles (then its stream-K chunks) in the consumers' order, K-slice by K-slice.
    TWO_B (the SwiGLU kernel): each slot also holds the up columns N + n0.. of the [W_g | W_u] weight (b2_smem)."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    num_pid_m = gl.cdiv(M, TILE_M)
    num_pid_n = gl.cdiv(N, TILE_N)
    k_tiles = gl.cdiv(K, BK)
    it = 0                                                   # ring position (counts every K-slice)
    for tile in range(gl.program_id(0), DP_TILES, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        it = _load_slices(a_desc, b_desc, a_smem, b_smem, b2_smem, ready, empty, it, pid_m * TILE_M,
                          pid_n * TILE_N, N + pid_n * TILE_N, 0, k_tiles, STAGES, B_NK, TWO_B)
    if STREAM_K:
        cur, end = _sk_range(num_pid_m * num_pid_n - DP_TILES, k_tiles)
        while cur < end:
            t, kb, ke = _sk_chunk(cur, end, k_tiles)
            pid_m, pid_n = _tile_coords(DP_TILES + t, num_pid_m, num_pid_n, GROUP_M)
            it = _load_slices(a_desc, b_desc, a_smem, b_smem, b2_smem, ready, empty, it, pid_m * TILE_M,
                              pid_n * TILE_N, N + pid_n * TILE_N, kb, ke, STAGES, B_NK, TWO_B)
            cur += ke - kb


@gluon.jit
def _release(bar):
    """Every warp of this partition is past its wgmma wait for the slot bar guards: one arrive."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _b_slot(b_smem, s, B_NK: gl.constexpr):
    """Ring slot s of B as the wgmma's K x N operand: a (N, K) slot (B_NK) is read transposed."""
    if B_NK:
        return b_smem.index(s).permute((1, 0))
    else:
        return b_smem.index(s)


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """(ready, empty) mbarriers of a STAGES-deep TMA ring: ready completes on the TMA transaction bytes, empty on
    one arrive by the one consumer partition that read the slot."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _invalidate_ring(ready, empty, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
