"""FA3-style flash-attention backward for Hopper (sm_90) in Gluon (triton.experimental.gluon, Triton 3.6).

Imported only by gluon_bwd.py, and only when triton.experimental.gluon imports.  Same tensor
conventions as the forward (gluon_kernel.py): 4-D TMA descriptors over (b, h, s, d) strided views
with block (1, 1, rows, d); rows past a head's s are zero-filled on load and clipped on store; GQA by
index (q head h reads kv head h // GROUP); causal is bottom-right aligned (query i sees keys
j <= i + s_k - s_q).  Inputs from the host: lse2 = the forward's natural-log lse in log2 units with +inf
for a row that saw no key (so every p of that row is exactly 0), and delta = rowsum(dO * O), both
float32 (b, h_q, s_q) contiguous, made by attention._bwd_pre_kernel.

One CTA per K/V tile (BLOCK_N = 128 keys) of one kv head, 8 warps (2 warpgroups).  K and V stay in
shared memory, dK and dV accumulate in registers (float32), and the CTA walks every Q/dO tile (BLOCK_M = 64
query rows) of every q head of its GQA group that sees at least one of its keys, so dK/dV are summed over
the group in registers and K/V are never repeated.  Per Q/dO tile (every GEMM an async wgmma):
    S  = Q K^T, dP = dO V^T   [64 q, 128 keys]; the warpgroups split the keys, so a query row's lse2 and
                               delta cost 2 registers per thread (S^T would need 16 each: it spilled)
    P  = exp2(S * scale*log2e - lse2)  (masked)      dS = P * (dP - delta)
    P, dS -> shared memory (bf16/fp16), then
    dV += P^T dO,  dK += dS^T Q   (A read transposed from shared memory) [128 keys, d]
    dQ_part = dS K                [64 q, d] -> float32 atomic adds (pre-multiplied by the softmax scale)
                                  into a zeroed (b, h_q, s_q, d) float32 buffer; the host casts it.
dQ by atomics (FA2/FA3 style) rather than a separate dQ pass: the dQ pass would recompute S and dP,
7 GEMMs per (Q tile, K tile) pair instead of 5 (+40% tensor-core work), while the atomics are
fire-and-forget reductions (red.global.add.v2.f32 in the SASS) that do not stall the issuing warps.  The
price: a non-deterministic float32 summation order across K tiles, a zeroed float32 buffer, one cast.

Q/dO tiles stream through a STAGES-deep TMA ring (one "ready" mbarrier per slot each for Q and dO,
expect-tx), loaded by the consumer warps themselves STAGES-1 tiles ahead; the slot being refilled was
last read by the previous iteration, whose wgmmas every warp has waited for before the barrier at the top
of the iteration.  Masks are applied only on tiles that can hold a masked element: with CAUSAL the q
tiles below the diagonal band's end, and every tile of the CTA that holds the s_k tail (keys past s_k
are zero rows of K, whose p would be exp2(-lse2) != 0, and inf * 0 could reach dQ).

Schedules (constexpr; the host's gluon_bwd.VARIANTS names them).  The 8 GEMM warps already
split the key rows FA3's way: each warpgroup holds 64 of the 128 keys of dK and dV (64 x d float32),
S/dP split along the keys and dQ_part along d, so they exchange P and dS through shared memory.
  * default ("inline"): as above, the GEMM warps issue their own TMA loads.
  * WARP_SPEC: gl.warp_specialize with the 8 GEMM warps as the default partition (240 registers,
    setmaxnreg) and a 1-warp producer (PRODUCER_REGS) that loads K/V and fills the Q/dO ring, waiting
    on one "empty" mbarrier per slot; the GEMM warps free a slot after the tile's last wgmma retired
    (thread barrier + one arrive, which also guards P/dS for the next tile).
  * DQ_FIRST: dQ_part = dS K is issued before dV and dK and waited for alone, so its atomics are issued
    while dV/dK still run on the tensor cores.
  * DQ_WRITER (with WARP_SPEC, DQ_FIRST): dQ_part goes into a float32 shared buffer (rows padded by
    32 B against bank conflicts) instead of atomics from the GEMM warps; the producer warp adds it to
    global memory (red.global.add.v4.f32, a few rows at a time) STAGES tiles behind its loads, between
    the tile's release (qd_empty) and a dq_empty mbarrier.  FA3 does this with a TMA reduce-add, which
    Gluon 3.6 lacks."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ..common.gluon_kv_ring import _release      # partition barrier + arrive
# the forward's two-descriptor TMA issue (each tile on its own barrier), here for Q and dO rows of q head
# (b, h): S^T = K Q^T can start before dO has landed
from ..common.gluon_kv_ring import _issue_kv as _issue_q_do
from .gluon_kernel import _sreg                 # a CTA-id read LLVM cannot hoist

BLOCK_M = 64        # query rows per Q/dO tile
BLOCK_N = 128       # keys per CTA
NUM_WARPS = 8       # 2 consumer warpgroups, each owning 64 of the CTA's keys in every accumulator
DQ_PAD = gl.constexpr(8)   # DQ_WRITER: float32 padding after each row of the dQ_part buffer (32 B)


@gluon.jit
def _tile_coords(t, n_m, m_lo, hk, GROUP):
    """Flattened iteration t -> (q head, q tile index): the group's heads one after the other, each over
    its q tiles m_lo .. m_lo + n_m - 1."""
    g = t // n_m
    return hk * GROUP + g, m_lo + (t - g * n_m)


@gluon.jit
def _opaque_zero(t):
    """0, computed from the loop counter t in a way LLVM cannot see through.  Indexing the fixed shared
    buffers (K, V, P, dS) with it keeps their wgmma smem descriptors (one 64-bit value per k-step and
    operand) inside the loop: hoisted as loop invariants they held ~40 registers for the whole loop and
    the d128 kernel spilled 72-95 STL/LDL; recomputed they cost a few integer adds per iteration."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _drain_dq(j, dq_smem, dq_empty, dq_ptr, b, H, hk, GROUP, n_m, m_lo, SQ):
    """DQ_WRITER: add tile j's dQ_part (float32, already scaled; the caller has seen tile j's release)
    in dq_smem to dq_ptr with float32 reductions from this one warp (ROWS rows of 4 floats per lane at a
    time, so a few registers suffice), then free the buffer."""
    BM: gl.constexpr = dq_smem.shape[0]
    D: gl.constexpr = dq_smem.shape[1]
    ROWS: gl.constexpr = 128 // D
    blk: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[ROWS, D // 4],
                                         warps_per_cta=[1, 1], order=[1, 0])
    h, mt = _tile_coords(j, n_m, m_lo, hk, GROUP)
    m0 = mt * BM
    base = dq_ptr + ((b * H + h).to(gl.int64) * SQ + m0) * D
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    offs = gl.expand_dims(r, 1) * D + gl.expand_dims(c, 0)
    rows_left = SQ - m0
    # The same bytes seen as BM // ROWS chunks of ROWS rows, walked by a runtime loop: unrolled, LLVM
    # hoisted every chunk's shared load ahead of the atomics and the d64 kernel spilled 140 STL/LDL.
    chunks = dq_smem._reinterpret(gl.float32, [BM // ROWS, ROWS, D], gl.PaddedSharedLayout.with_identity_for(
        [[D, DQ_PAD]], [ROWS, D], [1, 0]))
    for i in range(BM // ROWS):
        vals = chunks.index(i).load(blk)
        gl.atomic_add(base + i * (ROWS * D) + offs, vals, mask=gl.expand_dims(r, 1) < rows_left - i * ROWS,
                      sem="relaxed")
    _release(dq_empty)


@gluon.jit
def _bwd_producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready,
                  qd_empty, b, hk, n0, n_m, m_lo, GROUP, n_iter, STAGES: gl.constexpr,
                  DQ_WRITER: gl.constexpr, dq_smem, dq_empty, dq_ptr, H, SQ):
    """WARP_SPEC loader (1 warp): K/V once, then every Q/dO tile of the CTA into the ring as soon as the
    consumers free a slot (qd_empty: one arrive per use, after the last wgmma reading the slot retired).
    DQ_WRITER: the same warp also adds each tile's dQ_part to global memory, STAGES tiles behind the
    loads: the wait for the slot of tile t returns once tile t - STAGES is released, and the GEMM warps
    store a tile's dQ_part before that release, so qd_empty doubles as "dQ ready"."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    qd_view: gl.constexpr = q_desc.block_type.shape
    kv_view: gl.constexpr = k_desc.block_type.shape
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_bar, k_smem._reinterpret(dtype, kv_view, k_desc.layout))
    tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_bar, v_smem._reinterpret(dtype, kv_view, v_desc.layout))
    for t in range(n_iter):
        stage = t % STAGES
        # Parity of the slot's previous use; on the first lap a fresh barrier's parity 1 returns at once.
        mbarrier.wait(qd_empty.index(stage), ((t // STAGES) & 1) ^ 1)
        h, mt = _tile_coords(t, n_m, m_lo, hk, GROUP)
        _issue_q_do(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, b, h, mt * BM, stage, qd_view)
        if DQ_WRITER:
            if t >= STAGES:
                _drain_dq(t - STAGES, dq_smem, dq_empty, dq_ptr, b, H, hk, GROUP, n_m, m_lo, SQ)
    if DQ_WRITER:
        for j in range(gl.maximum(n_iter - STAGES, 0), n_iter):
            # The last tiles: wait for their release (the phase tile j completes; no later tile uses
            # the slot, so the barrier stays there).
            mbarrier.wait(qd_empty.index(j % STAGES), (j // STAGES) & 1)
            _drain_dq(j, dq_smem, dq_empty, dq_ptr, b, H, hk, GROUP, n_m, m_lo, SQ)


@gluon.jit
def _bwd_step(t, h, mt, dk, dv, q_smem, do_smem, q_ready, do_ready, k_smem1, v_smem1, p_smem1, ds_smem1, sp_zero, dq_zero,
              dq_rows, dq_offs, dq_ptr, lse2_ptr, delta_ptr, b, H, hk, GROUP, n_m, m_lo, m_mid, n0, SQ, SK,
              OFFSET, qk_scale, scale, sp_layout: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
              DQ_FIRST: gl.constexpr, DQ_WRITER: gl.constexpr, dq_smem, dq_empty):
    """One Q/dO tile (iteration t: q head h, q tile mt) against the CTA's K/V tile: returns the updated
    (dk, dv) with every wgmma retired.  The caller guarantees P/dS are free (no warp still reads the
    previous tile's)."""
    BM: gl.constexpr = q_smem.shape[1]
    BN: gl.constexpr = p_smem1.shape[2]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    row_sp: gl.constexpr = gl.SliceLayout(1, sp_layout)     # one value per query row
    key_sp: gl.constexpr = gl.SliceLayout(0, sp_layout)     # one value per key
    cur = t % STAGES
    phase = (t // STAGES) & 1
    z = _opaque_zero(t)
    k_cur = k_smem1.index(z)
    v_cur = v_smem1.index(z)
    p_cur = p_smem1.index(z)
    ds_cur = ds_smem1.index(z)
    m0 = mt * BM
    row0 = (b * H + h).to(gl.int64) * SQ
    rows = m0 + gl.arange(0, BM, layout=row_sp)
    # Rows past s_q: lse2 = +inf gives p = 0 and delta = 0 gives dS = 0 (Q/dO rows there are zeros).
    lse2 = gl.load(lse2_ptr + row0 + rows, mask=rows < SQ, other=float("inf"))
    delta = gl.load(delta_ptr + row0 + rows, mask=rows < SQ, other=0.0)

    mbarrier.wait(q_ready.index(cur), phase)
    s_tok = warpgroup_mma(q_smem.index(cur), k_cur.permute((1, 0)), sp_zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(cur), phase)
    dp_tok = warpgroup_mma(do_smem.index(cur), v_cur.permute((1, 0)), sp_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))                   # S done; dP still running
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if mt < m_mid:
        # Built here (through z) rather than once before the loop: 16 loop-invariant registers
        # per thread were the difference between 0 and 5-9 spills at d128.
        keys = (n0 + z) + gl.arange(0, BN, layout=key_sp)
        keep = gl.expand_dims(keys < SK, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows + OFFSET, 1))
        p = gl.where(keep, p, 0.0)
    p_cur.store(p.to(dtype))
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = p * (dp - gl.expand_dims(delta, 1))
    ds_cur.store(ds.to(dtype))
    # Every key's P and dS must be in shared memory (and visible to the async proxy) before any
    # warpgroup's dV/dK/dQ wgmma reads them.
    fence_async_shared()
    gl.thread_barrier()
    if DQ_WRITER:
        # dQ_part first, then into dq_smem (once the writer warp has drained the previous tile's) under
        # dV and dK; the caller's release (after its thread barrier) publishes it to the writer.
        dq_tok = warpgroup_mma(ds_cur, k_cur, dq_zero, use_acc=False, is_async=True)          # dQ_part = dS K
        dv_tok = warpgroup_mma(p_cur.permute((1, 0)), do_smem.index(cur), dv, is_async=True)     # dV += P^T dO
        dk_tok = warpgroup_mma(ds_cur.permute((1, 0)), q_smem.index(cur), dk, is_async=True)    # dK += dS^T Q
        dq = warpgroup_mma_wait(2, deps=(dq_tok, ))
        mbarrier.wait(dq_empty, (t & 1) ^ 1)
        dq_smem.store(dq * scale)
        dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
    elif DQ_FIRST:
        # dQ_part first: its atomics (scale, address math, 16 red.v2 per thread at d128) are issued
        # while dV and dK, queued behind it, still run on the tensor cores.
        dq_tok = warpgroup_mma(ds_cur, k_cur, dq_zero, use_acc=False, is_async=True)          # dQ_part = dS K
        dv_tok = warpgroup_mma(p_cur.permute((1, 0)), do_smem.index(cur), dv, is_async=True)     # dV += P^T dO
        dk_tok = warpgroup_mma(ds_cur.permute((1, 0)), q_smem.index(cur), dk, is_async=True)    # dK += dS^T Q
        dq = warpgroup_mma_wait(2, deps=(dq_tok, ))
        gl.atomic_add(dq_ptr + (row0 + m0) * D + dq_offs, dq * scale,
                      mask=gl.expand_dims(dq_rows, 1) < SQ - m0, sem="relaxed")
        dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
    else:
        dv_tok = warpgroup_mma(p_cur.permute((1, 0)), do_smem.index(cur), dv, is_async=True)     # dV += P^T dO
        dk_tok = warpgroup_mma(ds_cur.permute((1, 0)), q_smem.index(cur), dk, is_async=True)    # dK += dS^T Q
        dq_tok = warpgroup_mma(ds_cur, k_cur, dq_zero, use_acc=False, is_async=True)          # dQ_part = dS K
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
        gl.atomic_add(dq_ptr + (row0 + m0) * D + dq_offs, dq * scale,
                      mask=gl.expand_dims(dq_rows, 1) < SQ - m0, sem="relaxed")
    return dk, dv


@gluon.jit
def _bwd_consumer(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_ptr, lse2_ptr, delta_ptr,
                  k_smem1, v_smem1, q_smem, do_smem, p_smem1, ds_smem1, kv_bar, q_ready, do_ready, qd_empty,
                  b, H, hk, GROUP, n0, n_m, m_lo, m_mid, n_iter, SQ, SK, OFFSET, qk_scale, scale,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr, PRODUCE: gl.constexpr, DQ_FIRST: gl.constexpr,
                  DQ_WRITER: gl.constexpr, dq_smem, dq_empty, num_warps: gl.constexpr):
    """The 8 GEMM warps: every Q/dO tile of the CTA, then the dK/dV epilogue.  PRODUCE: no producer warp,
    these warps issue the K/V load and the Q/dO ring loads (STAGES-1 tiles ahead) themselves; else
    they free each ring slot on qd_empty once its last wgmma has retired."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    qd_view: gl.constexpr = q_desc.block_type.shape
    kv_view: gl.constexpr = k_desc.block_type.shape
    # S, dP [BM, BN]: 64 query rows = one warpgroup's M, so the two warpgroups split the keys; a query
    # row's lse2/delta then take 2 registers per thread (the transposed S^T would need 16 each).
    sp_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                        instr_shape=[16, BN * 4 // num_warps, 16])
    # dK, dV [BN, D]: warps stacked along the keys.
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, D, 16])
    # dQ_part [BM, D]: the two warpgroups split d.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                        instr_shape=[16, D * 4 // num_warps, 16])
    k_smem = k_smem1.index(0)
    v_smem = v_smem1.index(0)
    if PRODUCE:
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_bar, k_smem._reinterpret(dtype, kv_view, k_desc.layout))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_bar, v_smem._reinterpret(dtype, kv_view, v_desc.layout))
        for t in gl.static_range(STAGES - 1):
            if t < n_iter:
                h, mt = _tile_coords(t, n_m, m_lo, hk, GROUP)
                _issue_q_do(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, b, h, mt * BM, t, qd_view)

    dk = gl.zeros([BN, D], gl.float32, kv_layout)
    dv = gl.zeros([BN, D], gl.float32, kv_layout)
    sp_zero = gl.zeros([BM, BN], gl.float32, sp_layout)
    dq_zero = gl.zeros([BM, D], gl.float32, dq_layout)
    dq_rows = gl.arange(0, BM, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
    dq_offs = gl.expand_dims(dq_rows, 1) * D + gl.expand_dims(dq_cols, 0)             # within one tile
    mbarrier.wait(kv_bar, 0)

    for t in range(n_iter):
        h, mt = _tile_coords(t, n_m, m_lo, hk, GROUP)
        if PRODUCE:
            # Every warp is past iteration t-1 (its wgmmas waited): slot (t-1) % STAGES, P and dS are free.
            gl.thread_barrier()
            t_load = t + STAGES - 1
            if t_load < n_iter:
                h_l, mt_l = _tile_coords(t_load, n_m, m_lo, hk, GROUP)
                _issue_q_do(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, b, h_l, mt_l * BM,
                            t_load % STAGES, qd_view)
        dk, dv = _bwd_step(t, h, mt, dk, dv, q_smem, do_smem, q_ready, do_ready, k_smem1, v_smem1, p_smem1, ds_smem1,
                           sp_zero, dq_zero, dq_rows, dq_offs, dq_ptr, lse2_ptr, delta_ptr, b, H, hk, GROUP, n_m,
                           m_lo, m_mid, n0, SQ, SK, OFFSET, qk_scale, scale, sp_layout, CAUSAL, STAGES, DQ_FIRST,
                           DQ_WRITER, dq_smem, dq_empty)
        if not PRODUCE:
            # Every warp's wgmmas of tile t retired (the barrier in _release): the producer may refill
            # its Q/dO slot, and the next iteration may overwrite P and dS.
            # Every warp's wgmmas of tile t retired (the barrier in _release): the producer may refill
            # its Q/dO slot, and the next iteration may overwrite P and dS.  With DQ_WRITER the same
            # arrive tells the writer that tile t's dQ_part is in dq_smem (stored before the barrier).
            _release(qd_empty.index(t % STAGES))

    if not PRODUCE:
        # Under the consumer partition's 240 registers (setmaxnreg), the store's coordinates held through
        # the loop were spilled at d128 (14 STL/LDL, 24 B of stack): read them again from the CTA id.
        bhk = _sreg(n_iter, "%ctaid.y")
        b = bhk // (H // GROUP)
        hk = bhk % (H // GROUP)
        n0 = _sreg(n_iter, "%ctaid.x") * BN
    # Epilogue: dK (scaled) and dV out through the K/V slots once every warp's last wgmma has read them;
    # the TMA store clips rows past s_k.
    gl.thread_barrier()
    k_smem.store((dk * scale).to(dtype))
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, 0], k_smem._reinterpret(dtype, kv_view, dk_desc.layout))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, 0], v_smem._reinterpret(dtype, kv_view, dv_desc.layout))
    tma.store_wait(0)


@gluon.jit
def fa_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_ptr, lse2_ptr, delta_ptr,
                  H, GROUP, SQ, SK, OFFSET, qk_scale, scale,
                  kv_smem_layout: gl.constexpr, qd_smem_layout: gl.constexpr, ps_smem_layout: gl.constexpr,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr, WARP_SPEC: gl.constexpr, DQ_FIRST: gl.constexpr,
                  DQ_WRITER: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(SK, BLOCK_N), b * H_kv).  q/do descriptors: block (1, 1, BLOCK_M, d) over (b, H, SQ, d);
    k/v/dk/dv: block (1, 1, BLOCK_N, d) over (b, H_kv, SK, d).  dq_ptr: float32 (b, H, SQ, d) contiguous,
    zeroed; receives scale * dS K by atomic adds.  lse2/delta: float32 (b, H, SQ) contiguous.
    WARP_SPEC: a 1-warp producer partition issues every TMA load (PRODUCER_REGS registers, setmaxnreg);
    DQ_FIRST: the dQ wgmma is issued before dV/dK and its atomics run under them (see _bwd_step).
    DQ_WRITER (needs WARP_SPEC): the GEMM warps leave dQ_part (float32) in shared memory and the producer
    warp issues its atomics (see _drain_dq)."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype

    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    HKV = H // GROUP
    b = bhk // HKV
    hk = bhk % HKV
    n0 = pid_n * BN
    n_qtiles = gl.cdiv(SQ, BM)
    if CAUSAL:   # query i sees key j iff j <= i + OFFSET
        m_lo = gl.minimum(gl.maximum(n0 - OFFSET, 0) // BM, n_qtiles)              # first tile seeing key n0
        m_mid = gl.cdiv(gl.maximum(n0 + BN - 1 - OFFSET, 0), BM)                     # from here: all keys seen
        m_mid = gl.minimum(gl.maximum(m_mid, m_lo), n_qtiles)
    else:
        m_lo = 0
        m_mid = 0
    if n0 + BN > SK:                          # this CTA holds the s_k tail: every tile takes the mask
        m_mid = n_qtiles
    n_m = n_qtiles - m_lo                     # q tiles per q head of the group
    n_iter = n_m * GROUP

    # K, V, P, dS: fixed buffers, allocated with a leading dim of 1 for _opaque_zero indexing.
    k_smem1 = gl.allocate_shared_memory(dtype, [1, BN, D], kv_smem_layout)
    v_smem1 = gl.allocate_shared_memory(dtype, [1, BN, D], kv_smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], qd_smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], qd_smem_layout)
    p_smem1 = gl.allocate_shared_memory(dtype, [1, BM, BN], ps_smem_layout)
    ds_smem1 = gl.allocate_shared_memory(dtype, [1, BM, BN], ps_smem_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
    if WARP_SPEC:
        qd_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(qd_empty.index(i), count=1)      # one arrive: the consumer partition's
        # "dQ ready" is qd_empty (see _bwd_producer): a separate "full" barrier's arrive cost a second
        # bar.sync per iteration (Triton put one between the two consecutive arrives).
        dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(dq_empty, count=1)                   # arrived by the writer warp
        if DQ_WRITER:
            # fp32 dQ_part, each row padded by 32 bytes: the accumulator layout stores 8 rows at a time,
            # which unpadded (rows 512 B apart at d128) would all hit the same banks
            dq_smem = gl.allocate_shared_memory(gl.float32, [BM, D], gl.PaddedSharedLayout.with_identity_for(
                [[D, DQ_PAD]], [BM, D], [1, 0]))
        else:
            dq_smem = p_smem1                               # not used
        gl.warp_specialize([
            (_bwd_consumer, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_ptr, lse2_ptr, delta_ptr,
                             k_smem1, v_smem1, q_smem, do_smem, p_smem1, ds_smem1, kv_bar, q_ready, do_ready,
                             qd_empty, b, H, hk, GROUP, n0, n_m, m_lo, m_mid, n_iter, SQ, SK, OFFSET, qk_scale,
                             scale, CAUSAL, STAGES, False, DQ_FIRST, DQ_WRITER, dq_smem, dq_empty, num_warps)),
            (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, k_smem1.index(0), v_smem1.index(0), q_smem, do_smem,
                             kv_bar, q_ready, do_ready, qd_empty, b, hk, n0, n_m, m_lo, GROUP, n_iter, STAGES,
                             DQ_WRITER, dq_smem, dq_empty, dq_ptr, H, SQ)),
        ], [1], [PRODUCER_REGS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(qd_empty.index(i))
        mbarrier.invalidate(dq_empty)
    else:
        _bwd_consumer(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_ptr, lse2_ptr, delta_ptr,
                      k_smem1, v_smem1, q_smem, do_smem, p_smem1, ds_smem1, kv_bar, q_ready, do_ready, kv_bar,
                      b, H, hk, GROUP, n0, n_m, m_lo, m_mid, n_iter, SQ, SK, OFFSET, qk_scale, scale,
                      CAUSAL, STAGES, True, DQ_FIRST, False, p_smem1, kv_bar, num_warps)
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(do_ready.index(i))
