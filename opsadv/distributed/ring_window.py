"""Sliding-window (local, causal) attention over a context-parallel group: query i sees keys i - window .. i.

With window <= the shortest chunk, a chunk's queries reach back into the previous chunk only, so each chunk needs
the last `window` keys / values of its predecessor and nothing else: one exchange between neighbours (contiguous
layout: from rank r-1; zig-zag: the early chunk's from rank r-1, the late chunk's from rank r+1, or locally on the
middle rank), no ring.  Each chunk then runs sparse_attention on [predecessor tail, own chunk] with a
SparseLayout.sliding_window (bottom-right aligned, so the tail sits exactly `window` keys before the queries):
its kernels skip the key blocks outside the band, where flash_attention with a mask would read them all."""
from __future__ import annotations

import torch
from torch import Tensor

from opsadv.ops.sparse_attention import sparse_attention
from opsadv.ops.sparse_attention.layout import SparseLayout

from .ring_group import RingGroup, wait


class _TailExchange(torch.autograd.Function):
    """kv (2, b, h, s, d) in; kv again (passed through, so that every rank runs this backward, which the peers'
    gradients need) and the received tails out.  Backward sends each tail's gradient back to where it came from."""

    @staticmethod
    def forward(ctx, kv: Tensor, ring: RingGroup, sends: tuple, recvs: tuple):
        # sends: (peer, start, length) slices of the local sequence; recvs: (peer, length)
        bufs = [kv.new_empty((*kv.shape[:3], n, kv.shape[-1])) for _, n in recvs]
        wait(ring.post([(p, kv[:, :, :, a:a + n]) for p, a, n in sends], [(p, b) for (p, _), b in zip(recvs, bufs)]))
        ctx.ring, ctx.sends, ctx.recvs = ring, sends, recvs
        return (kv.view_as(kv), *bufs)

    @staticmethod
    def backward(ctx, dkv, *dtails):
        back = [dkv.new_empty((*dkv.shape[:3], n, dkv.shape[-1])) for _, _, n in ctx.sends]
        dtails = [torch.zeros_like(dkv[:, :, :, :n]) if g is None else g for g, (_, n) in zip(dtails, ctx.recvs)]
        wait(ctx.ring.post([(p, g) for g, (p, _) in zip(dtails, ctx.recvs)],
                           [(p, b) for (p, _, _), b in zip(ctx.sends, back)]))
        dkv = dkv.clone()
        for (_, a, n), g in zip(ctx.sends, back):
            dkv[:, :, :, a:a + n] += g
        return dkv, None, None, None


def window_attention(q: Tensor, k: Tensor, v: Tensor, ring: RingGroup, window: int, scale: float
                     ) -> tuple[Tensor, Tensor]:
    """(out, lse) of the local queries; differentiable through sparse_attention's autograd and _TailExchange."""
    layout, rank = ring.layout, ring.rank
    mine = layout.chunks_of(rank)
    last = layout.n_chunks - 1
    kv = torch.stack((k, v))
    # each pair of ranks exchanges at most one tail per direction, so the posting order cannot mismatch
    sends = tuple((layout.owner(c + 1), layout.local_offset(rank, c) + layout.chunk_len(c) - window, window)
                  for c in sorted(mine) if window and c < last and layout.owner(c + 1) != rank)
    recvs = tuple((layout.owner(c - 1), window) for c in sorted(mine) if window and c > 0
                  and layout.owner(c - 1) != rank)
    kv, *tails = _TailExchange.apply(kv, ring, sends, recvs) if sends or recvs else (kv,)
    received = dict(zip((c for c in sorted(mine) if window and c > 0 and layout.owner(c - 1) != rank), tails))
    outs, lses = [], []
    for c in mine:
        a, n = layout.local_offset(rank, c), layout.chunk_len(c)
        keys = kv[:, :, :, a:a + n]
        if window and c > 0:
            if c in received:
                tail = received[c]
            else:                              # the predecessor is local (the zig-zag's middle rank)
                p = layout.local_offset(rank, c - 1) + layout.chunk_len(c - 1)
                tail = kv[:, :, :, p - window:p]
            keys = torch.cat((tail, keys), dim=3)
        band = SparseLayout.sliding_window(n, window, seq_k=keys.shape[3], causal=True, device=q.device)
        o, lse = sparse_attention(q[:, :, a:a + n], keys[0], keys[1], band, scale=scale, return_lse=True)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
