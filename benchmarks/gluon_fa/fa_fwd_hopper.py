"""FA3-style flash-attention forward for Hopper (sm_90) in Gluon (triton.experimental.gluon, Triton 3.6).

A probe for issue #3, not a registered opsadv impl.  Non-causal, q/k/v (b, h, s, d) contiguous bf16/fp16,
d in {64, 128}, s a multiple of BLOCK_M and BLOCK_N (128): tiles must not straddle two heads, because the
TMA descriptors see q/k/v/o flattened to (b*h*s, d).  Returns out (b, h, s, d) in the input dtype and
lse (b, h, s) float32, natural log.

Per CTA: BLOCK_M=128 query rows, 8 warps = 2 warpgroups (64 rows each, wgmma warps_per_cta [8, 1]).
  * K/V tiles (BLOCK_N=128 rows) stream through a STAGES-deep shared-memory ring filled by TMA, one
    mbarrier per stage and operand ("ready"), plus one per stage the consumers arrive on ("empty").
  * S = Q K^T is an async wgmma from shared memory; P stays in registers as the A operand of O += P V.
  * Intra-warpgroup overlap (FA3 section 3.2): iteration j issues S_{j+1} = Q K_{j+1}^T and then
    O += P_j V_j, waits for S_{j+1} only (wgmma groups retire in order), runs the online softmax of
    S_{j+1} while P_j V_j is still on the tensor cores, then waits for P_j V_j and rescales O.
  * WARP_SPEC=True: one producer warp issues all K/V TMA loads (gl.warp_specialize); the 8 consumer
    warps only wait on "ready" and arrive on "empty".  WARP_SPEC=False: the consumer warps issue the
    loads themselves, STAGES-1 tiles ahead.
Not done: ping-pong scheduling of the two warpgroups (named barriers so one warpgroup's softmax runs
under the other's GEMMs), causal masking, ragged s, backward.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 128       # query rows per CTA (2 warpgroups x 64)
BLOCK_N = 128       # key/value rows per pipeline stage
NUM_WARPS = 8       # consumer warps (2 warpgroups)
LOG2E = 1.4426950408889634


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, row, stage):
    """TMA-load K and V rows [row, row + BLOCK_N) into ring slot `stage`, each on its own barrier so
    S = Q K^T can start before V has landed."""
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(stage), k_smem.index(stage))
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0, n_tiles,
              STAGES: gl.constexpr, BN: gl.constexpr):
    """Warp-specialized loader (1 warp): fills the ring as fast as the consumers free slots."""
    for j in range(n_tiles):
        stage = j % STAGES
        # Parity of the slot's previous use; on the first lap (j < STAGES) waiting on parity 1 of a
        # fresh barrier returns at once, so the first STAGES loads go out without waiting.
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_row0 + j * BN, stage)


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
              kv_empty, q_row, kv_row0, n_tiles, qk_scale,
              STAGES: gl.constexpr, PRODUCE: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    # wgmma accumulator layouts: warps stacked along M (each warp owns 16 rows, so row reductions stay
    # inside a warp); instr N = the whole tile width, K = 16 for 16-bit inputs.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    # P as the register A operand of P V: k_width = 32 bits / 16-bit element.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    if PRODUCE:     # no producer warp: prefetch the first STAGES-1 tiles ourselves
        for t in gl.static_range(STAGES - 1):
            if t < n_tiles:
                _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_row0 + t * BN, t)
    mbarrier.wait(q_bar, 0)

    # Prologue: S_0, its row max and P_0 (no PV yet).
    mbarrier.wait(k_ready.index(0), 0)
    s_acc = gl.zeros([BM, BN], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_acc, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    m_i = gl.max(s, axis=1) * qk_scale                      # running max, log2 units (scale folded in)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))      # one FMA + ex2 per element
    l_i = gl.sum(p, axis=1)
    o = gl.zeros([BM, D], gl.float32, o_layout)

    for j in range(0, n_tiles - 1):
        cur = j % STAGES
        nxt = (j + 1) % STAGES
        if PRODUCE:
            # Slot (j-1) % STAGES held tile j-1, whose wgmmas all retired at the end of iteration j-1.
            t_load = j + STAGES - 1
            if t_load < n_tiles:
                _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_row0 + t_load * BN,
                          t_load % STAGES)
        # 1) S_{j+1} = Q K_{j+1}^T, async.
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_acc, use_acc=False, is_async=True)
        # 2) O += P_j V_j, async, queued behind S_{j+1} (O already holds the rescale for m_j).
        mbarrier.wait(v_ready.index(cur), (j // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(cur), o, is_async=True)
        # 3) Wait for S_{j+1} only: groups retire in issue order, so 1 outstanding = the PV.
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        # 4) Online softmax of S_{j+1} while P_j V_j runs.
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        # 5) P_j V_j done (p_op must stay alive until then: it is a wgmma register operand).
        o = warpgroup_mma_wait(0, deps=(o_tok, p_op))[0]
        o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if not PRODUCE:
            # Tile j is fully consumed by every warp of both warpgroups; only then free its slot.
            gl.thread_barrier()
            mbarrier.arrive(kv_empty.index(cur), count=1)

    # Epilogue: the last P V.
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    o_tok = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o_tok, p_op))[0]
    o = o / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)

    # lse in natural log: m_i and log2(l_i) are in log2 units.
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    rows = q_row + gl.arange(0, BM, layout=row_s)
    gl.store(lse_ptr + rows, lse)
    # O goes out through Q's slot (same shape, dtype and layout; every wgmma reading Q has retired).
    q_smem.store(o.to(dtype))
    fence_async_shared()            # order the generic-proxy smem writes before the TMA (async proxy) read
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    tma.store_wait(0)


@gluon.jit
def fa_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, seq_len, qk_scale,
                  STAGES: gl.constexpr, WARP_SPEC: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    q_row = bh * seq_len + pid_m * BM
    kv_row0 = bh * seq_len
    n_tiles = seq_len // BN

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)        # completed by the TMA transaction bytes
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)       # one arrive from the consumer partition

    if WARP_SPEC:
        gl.warp_specialize([
            (_consumer, (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready,
                         v_ready, kv_empty, q_row, kv_row0, n_tiles, qk_scale, STAGES, False, num_warps)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row0, n_tiles,
                         STAGES, BN)),
        ], [1], [24])   # 1 producer warp, register budget 24 (it only issues TMA)
    else:
        _consumer(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                  kv_empty, q_row, kv_row0, n_tiles, qk_scale, STAGES, True, num_warps)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))


def default_stages(d: int) -> int:
    """Ring depth that fits 227 KB of shared memory: Q/O 128xd + STAGES x (K + V) 128xd, 16-bit."""
    return 2 if d == 128 else 3      # d128: 32K + 2 x 64K = 160K (3 stages = 224K + barriers: too tight)


def make_descs(q, k, v, o):
    """Host TMA descriptors over (b*h*s, d) views; validates the probe's restrictions."""
    b, h, s, d = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fa_fwd_hopper: q.dtype must be bfloat16 or float16, got {q.dtype}")
    if d not in (64, 128):
        raise ValueError(f"fa_fwd_hopper: head dim must be 64 or 128, got {d}")
    if s % BLOCK_M or s % BLOCK_N:
        raise ValueError(f"fa_fwd_hopper: seq len must be a multiple of {max(BLOCK_M, BLOCK_N)}, got {s}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape != q.shape or t.dtype != q.dtype or not t.is_contiguous():
            raise ValueError(f"fa_fwd_hopper: {name} must be contiguous {tuple(q.shape)} {q.dtype}, "
                             f"got {tuple(t.shape)} {t.dtype} contiguous={t.is_contiguous()}")
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    descs = []
    for t, blk in ((q, BLOCK_M), (k, BLOCK_N), (v, BLOCK_N), (o, BLOCK_M)):
        flat = t.view(b * h * s, d)
        lay = gl.NVMMASharedLayout.get_default_for([blk, d], gdt)
        descs.append(TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [blk, d], lay))
    return descs


def launch_args(q, k, v, sm_scale=None, warp_spec=True, stages=None):
    """(grid, args, kwargs) of one launch; out and lse are allocated here and are args[3].base / args[4]."""
    b, h, s, d = q.shape
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    if not sm_scale > 0:    # the kernel takes the row max before scaling: only valid for a positive scale
        raise ValueError(f"fa_fwd_hopper: sm_scale must be > 0, got {sm_scale}")
    o = torch.full_like(q, float("nan"))     # poisoned: rows the kernel fails to write stay NaN
    lse = torch.full((b, h, s), float("nan"), dtype=torch.float32, device=q.device)
    qd, kd, vd, od = make_descs(q, k, v, o)
    grid = (s // BLOCK_M, b * h)
    kw = dict(STAGES=stages or default_stages(d), WARP_SPEC=warp_spec, num_warps=NUM_WARPS)
    return grid, (qd, kd, vd, od, lse, s, sm_scale * LOG2E), kw, o, lse


def attention(q, k, v, sm_scale=None, warp_spec=True, stages=None):
    """out, lse = softmax(q k^T * scale) v, logsumexp; q/k/v (b, h, s, d) on a Hopper GPU."""
    grid, args, kw, o, lse = launch_args(q, k, v, sm_scale, warp_spec, stages)
    fa_fwd_kernel[grid](*args, **kw)
    return o, lse


def flops(b, h, s, d):
    """Non-causal forward: two GEMMs of 2*s*s*d each per head."""
    return 4.0 * b * h * s * s * d


__all__ = ["attention", "fa_fwd_kernel", "launch_args", "flops", "default_stages"]
