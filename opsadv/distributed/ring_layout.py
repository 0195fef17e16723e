"""How a sequence is split over the ranks of a context-parallel group, and the zig-zag helpers.

The sequence of N tokens is cut into n chunks by `torch.tensor_split` (the first N % n chunks one token longer,
so odd lengths need no padding).  Contiguous layout: n = W chunks, rank r holds chunk r.  Zig-zag (load-balanced
causal) layout: n = 2W chunks, rank r holds chunks r and 2W-1-r, concatenated in that order, so every rank has as
much past to attend to as any other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from opsadv.core.errors import InvalidArgumentError


@dataclass(frozen=True)
class RingLayout:
    """Which chunks of an N-token sequence each of `world` ranks holds (see the module docstring)."""
    seq_len: int
    world: int
    zigzag: bool

    @property
    def n_chunks(self) -> int:
        return 2 * self.world if self.zigzag else self.world

    def chunk_len(self, c: int) -> int:
        n = self.n_chunks
        return self.seq_len // n + (c < self.seq_len % n)

    def chunk_start(self, c: int) -> int:
        n = self.n_chunks
        return c * (self.seq_len // n) + min(c, self.seq_len % n)

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices rank holds, in the order its local sequence concatenates them."""
        return (rank, 2 * self.world - 1 - rank) if self.zigzag else (rank,)

    def owner(self, c: int) -> int:
        return c if c < self.world else 2 * self.world - 1 - c

    def local_offset(self, rank: int, c: int) -> int:
        """Where chunk c starts in rank's local sequence."""
        off = 0
        for x in self.chunks_of(rank):
            if x == c:
                return off
            off += self.chunk_len(x)
        raise ValueError(f"chunk {c} is not on rank {rank}")

    def local_len(self, rank: int) -> int:
        return sum(self.chunk_len(c) for c in self.chunks_of(rank))

    def describe(self) -> str:
        kind = f"zig-zag (chunks r and {2 * self.world - 1}-r of {self.n_chunks})" if self.zigzag else "contiguous"
        return f"{self.seq_len} tokens over {self.world} ranks, {kind}"


def _check_rank(op: str, rank, world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(op, "world_size", "an int >= 1", repr(world_size))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(op, "rank", f"an int in [0, {world_size})", repr(rank))


def zigzag_shard(x: Tensor, rank: int, world_size: int, *, dim: int = 2) -> Tensor:
    """Rank `rank`'s share of the full sequence x in the zig-zag layout ring_attention(load_balance=True) reads:
    chunks rank and 2W-1-rank of 2W (torch.tensor_split's chunks) along `dim` (2: the s of (b, h, s, d); shard
    position ids the same way for RoPE: zigzag_shard(torch.arange(N), rank, W, dim=0))."""
    op = "distributed.zigzag_shard"
    _check_rank(op, rank, world_size)
    if not isinstance(x, Tensor):
        raise InvalidArgumentError(op, "x", "a tensor", type(x).__name__)
    n = x.shape[dim]
    if n < 2 * world_size:
        raise InvalidArgumentError(op, "x", f"at least 2 * world_size = {2 * world_size} tokens along dim {dim} "
                                   "(one per zig-zag chunk)", f"{n} tokens")
    parts = torch.tensor_split(x, 2 * world_size, dim=dim)
    return torch.cat((parts[rank], parts[2 * world_size - 1 - rank]), dim=dim)


def zigzag_unshard(shards: Sequence[Tensor], *, dim: int = 2) -> Tensor:
    """The full sequence from every rank's zig-zag share (shards[r] from rank r, e.g. after an all_gather):
    the inverse of zigzag_shard."""
    op = "distributed.zigzag_unshard"
    if not isinstance(shards, (list, tuple)) or not shards or not all(isinstance(s, Tensor) for s in shards):
        raise InvalidArgumentError(op, "shards", "a non-empty list of tensors, rank order", type(shards).__name__)
    world = len(shards)
    n = sum(s.shape[dim] for s in shards)
    if n < 2 * world:
        raise InvalidArgumentError(op, "shards", f"at least 2 * {world} tokens in all (one per zig-zag chunk)",
                                   f"{n} tokens")
    layout = RingLayout(n, world, True)
    firsts, seconds = [], []
    for r, s in enumerate(shards):
        a, b = layout.chunks_of(r)
        if s.shape[dim] != layout.local_len(r):
            raise InvalidArgumentError(op, f"shards[{r}]", f"{layout.local_len(r)} tokens along dim {dim} "
                                       f"(zigzag_shard's share of {n} over {world} ranks)", f"{s.shape[dim]} tokens")
        la = layout.chunk_len(a)
        firsts.append(s.narrow(dim, 0, la))
        seconds.append(s.narrow(dim, la, s.shape[dim] - la))
    return torch.cat(firsts + seconds[::-1], dim=dim)
