"""The training step autotune times per op (CallSpec.train buckets).  The ops register their step
makers here (opsadv/ops); tuning reads them without importing the ops."""
from __future__ import annotations

from typing import Any, Callable

_TRAIN_STEPS: dict[str, Callable] = {}


def register_train_step(op: str, make: Callable) -> None:
    """`make(impl, ctx, args)` returns a callable running one forward + backward of `op` through
    `impl` (impl.train where it has one, else opsadv's autograd Function around impl.fn)."""
    _TRAIN_STEPS[op] = make


def train_step(op: str, impl, ctx, args: tuple) -> Callable[[], Any]:
    """What autotune times for a CallSpec.train bucket: forward and backward together, the cost a
    training step pays (a forward-only time would hide the backward's host and device cost)."""
    return _TRAIN_STEPS[op](impl, ctx, args)
