"""The conformance case catalogue, derived from the registered ops (core.opdef): each OpDef carries its cases
(shape classes: odd sizes 1, 3, 127, non-powers of two; causal, GQA, cross-length, masks ...) and a tolerance
row per dtype; a plugin's op (opsadv_register_ops) brings its own.

A case builds fresh random inputs from a seed, calls the public op, and names the inputs that
receive gradients.  The runner compares every impl with the reference backend in float64."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from opsadv.core.opdef import BASELINE_FACTOR, DTYPES, TOLERANCE, Case, get_op, op_defs
from opsadv.registry import get_registry

__all__ = ["BASELINE_FACTOR", "CATALOGUE", "DTYPES", "TOLERANCE", "Case", "call", "catalogue"]


def catalogue() -> list[Case]:
    """Every registered op's cases, in registration order (plugins' ops after discovery: the registry loads first)."""
    get_registry()
    return [c for d in op_defs() for c in d.cases]


class _Catalogue(Sequence):
    """CATALOGUE: catalogue() read at each use."""

    def __getitem__(self, i):
        return catalogue()[i]

    def __len__(self) -> int:
        return len(catalogue())

    def __iter__(self):
        return iter(catalogue())

    def __repr__(self) -> str:
        return f"<conformance catalogue: {len(self)} cases>"


CATALOGUE: Sequence[Case] = _Catalogue()


def fresh(t):
    """A copy of t in its own storage with t's strides and storage offset (a view of a bigger buffer stays one)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


def call(case: Case, args: tuple, kwargs: dict):
    """The case's op through its public function.  Arguments the op writes in place (case.mutates) are fresh
    copies each call, so the runner's calls (impl, oracle, baseline, no-grad, determinism) all start from the built
    values; inside torch.compile / export tracing (the graph checks) the traced arguments are used as given."""
    if case.mutates and not torch.compiler.is_compiling():
        args = tuple(fresh(a) if i in case.mutates and isinstance(a, torch.Tensor) else a
                     for i, a in enumerate(args))
    return get_op(case.op).fn(*args, **kwargs)
