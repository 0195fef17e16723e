"""The ring's forward and backward passes over full / causal attention: K/V chunks travel around the group,
each step attends the local queries to the chunk it holds and merges the partial result by lse.

Step t on rank r holds the K/V of rank src = (r - t) mod W.  The next hop is posted before the step's compute,
so the transfer runs under it.  Backward runs the ring again with the final out and lse (the softmax of the
whole row, so each step's flash_attention_backward gives that step's exact share of dq / dk / dv); dq adds up
locally, the dk / dv accumulators travel with their K/V and reach the owner after one more hop."""
from __future__ import annotations

import torch
from torch import Tensor

from opsadv.core.op_common import carry_policy
from opsadv.ops.flash_attention import flash_attention

from .lse_merge import empty_accumulators, merge_into
from .ring_group import RingGroup, wait
from .ring_layout import RingLayout

ALL = slice(None)


def step_block(layout: RingLayout, rank: int, src: int, causal: bool) -> tuple[slice, slice, bool] | None:
    """(query rows, key columns, causal) of rank's step against src's K/V, in local positions; None: all in the
    future (skipped).  Zig-zag: the early chunk of an earlier rank is wholly in the past of both own chunks; a later
    rank's two chunks are in the past of the own late chunk only."""
    if not causal:
        return ALL, ALL, False
    if src == rank:
        return ALL, ALL, True      # own chunks: local order is global order, so plain causal is exact
    if not layout.zigzag:
        return (ALL, ALL, False) if src < rank else None
    if src < rank:
        return ALL, slice(0, layout.chunk_len(src)), False
    return slice(layout.chunk_len(rank), None), ALL, False


def _kv_buffer(like: Tensor, layout: RingLayout, rank: int, dtype=None) -> Tensor:
    shape = (*like.shape[:3], layout.local_len(rank), like.shape[-1])
    return like.new_empty(shape, dtype=dtype or like.dtype)


def _rows(t: Tensor, s: slice) -> Tensor:
    return t if s == ALL else t[:, :, s]


def forward_step(q: Tensor, kv: Tensor, block: tuple[slice, slice, bool], scale: float, acc_out: Tensor,
                 acc_lse: Tensor) -> None:
    """One step's partial attention (with lse) of q's `rows` over kv's `cols`, merged into the accumulators."""
    rows, cols, diag = block
    out, lse = flash_attention(_rows(q, rows), kv[0][:, :, cols], kv[1][:, :, cols], causal=diag, scale=scale,
                               return_lse=True)
    merge_into(_rows(acc_out, rows), _rows(acc_lse, rows), out, lse)


def backward_step(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, block: tuple[slice, slice, bool],
                  scale: float, dq: Tensor) -> tuple[Tensor, Tensor]:
    """One step's share of the gradients: dq added into dq's rows; (dk, dv) of kv's cols returned (the final out and
    lse make the step's probabilities the whole row's softmax restricted to these keys)."""
    rows, cols, diag = block
    dq_step, dk, dv = torch.ops.opsadv.flash_attention_backward(
        _rows(dout, rows), _rows(q, rows), kv[0][:, :, cols], kv[1][:, :, cols], _rows(out, rows), _rows(lse, rows),
        None, diag, scale)
    _rows(dq, rows).add_(dq_step)
    return dk, dv


def add_kv_grads(dkv: Tensor, block: tuple[slice, slice, bool], dk: Tensor, dv: Tensor) -> None:
    cols = block[1]
    dkv[0][:, :, cols].add_(dk)
    dkv[1][:, :, cols].add_(dv)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: RingGroup, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    acc_out, acc_lse = empty_accumulators(q)
    kv = torch.stack((k, v))                   # K and V travel as one message
    for t in range(ring.world):
        src = (ring.rank - t) % ring.world
        last = t + 1 == ring.world
        if not last:
            nxt = _kv_buffer(kv, ring.layout, (src - 1) % ring.world)
            hop = ring.pass_on(kv, nxt)        # posted before the compute: the transfer overlaps it
        block = step_block(ring.layout, ring.rank, src, causal)
        if block is not None:
            forward_step(q, kv, block, scale, acc_out, acc_lse)
        if not last:
            wait(hop)
            kv = nxt
    return acc_out.to(q.dtype), acc_lse


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: RingGroup,
                  causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    acc = lse.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack((k, v))
    dkv_hop, dkv_in = [], None
    for t in range(ring.world):
        src = (ring.rank - t) % ring.world
        last = t + 1 == ring.world
        if not last:
            nxt = _kv_buffer(kv, ring.layout, (src - 1) % ring.world)
            hop = ring.pass_on(kv, nxt)
        block = step_block(ring.layout, ring.rank, src, causal)
        grads = None if block is None else backward_step(dout, q, kv, out, lse, block, scale, dq)
        # src's dk / dv so far (ranks src .. r-1 added theirs): arrived during this step's compute
        if t == 0:
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        else:
            wait(dkv_hop)
            dkv = dkv_in
        if grads is not None:
            add_kv_grads(dkv, block, *grads)
        if ring.world > 1:                     # on to the rank that holds src's K/V next (after the last step:
            dkv_in = _kv_buffer(kv, ring.layout, (src - 1) % ring.world, acc)   # the owner, with all W shares)
            dkv_hop = ring.pass_on(dkv, dkv_in)
        if not last:
            wait(hop)
            kv = nxt
    if ring.world > 1:
        wait(dkv_hop)
        dkv = dkv_in
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, ring, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.ring, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


# the backward resolves its kernels under the forward's policy (autograd may run it on another thread)
_setup_context, _backward = carry_policy(_setup_context, _backward)


class RingAttentionFunction(torch.autograd.Function):
    """out, lse = ring attention of the local q over every rank's k / v (lse is not differentiable)."""

    @staticmethod
    def forward(q, k, v, ring: RingGroup, causal: bool, scale: float):
        return ring_forward(q, k, v, ring, causal, scale)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)
