"""A rank's place in a context-parallel group and its point-to-point transfers (torch.distributed's
batch_isend_irecv / P2POp only: no communication layer of our own)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist
from torch import Tensor

from .ring_layout import RingLayout


@dataclass(frozen=True)
class RingGroup:
    """rank / world are ranks in `group` (None: the default group); `layout` says which chunks each holds."""
    group: Any
    rank: int
    world: int
    layout: RingLayout

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    def _global(self, r: int) -> int:
        # P2POp takes a global rank (group_peer only exists from torch 2.6 on)
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def post(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> list:
        """Start the sends (peer, tensor) and receives (peer, buffer), peers as group ranks; returns the works to
        wait on.  Messages between two ranks match in posting order, so both sides post them in the same order."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), self._global(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for p, t in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def pass_on(self, send: Tensor, recv: Tensor) -> list:
        """One ring hop: send to the next rank, receive from the previous one."""
        return self.post([(self.next, send)], [(self.prev, recv)])


def wait(works: list) -> None:
    for w in works:
        w.wait()
