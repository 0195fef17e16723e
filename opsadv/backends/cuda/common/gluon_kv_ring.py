"""Gluon device helpers of the FA3-style attention kernels (cuda/flash_attention/gluon_kernel.py,
gluon_bwd_kernel.py and cuda/sparse_attention/gluon_kernel.py): TMA loads of K / V rows into a ring slot, the
partition barrier + arrive that frees a slot, and the ping-pong turn barriers of two consumer warpgroups.
Imported only by those kernel modules, and only when triton.experimental.gluon imports."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, row, stage, kv_view: gl.constexpr):
    """TMA-load K and V rows [row, row + BLOCK_N) of head (b, hk) into ring slot `stage`, each on its
    own barrier so S = Q K^T can start before V has landed.  Rows past s_k arrive as zeros."""
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, row, 0], k_ready.index(stage),
                                    k_smem.index(stage)._reinterpret(k_desc.dtype, kv_view, k_desc.layout))
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [b, hk, row, 0], v_ready.index(stage),
                                    v_smem.index(stage)._reinterpret(v_desc.dtype, kv_view, v_desc.layout))


@gluon.jit
def _issue_one(desc, smem, ready, b, hk, row, stage, kv_view: gl.constexpr):
    """TMA-load rows [row, row + BLOCK_N) of head (b, hk) of one of K / V into ring slot `stage`."""
    mbarrier.expect(ready.index(stage), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [b, hk, row, 0], ready.index(stage),
                                    smem.index(stage)._reinterpret(desc.dtype, kv_view, desc.layout))


@gluon.jit
def _release(bar):
    """Every warp of this partition is done with the buffer that bar guards: one arrive."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _turn_wait(turn, step, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until it is warpgroup WG's turn to issue GEMMs for `step` (its step-th turn)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), step & 1)


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this warpgroup's GEMMs are issued; the other warpgroup may issue its own."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
