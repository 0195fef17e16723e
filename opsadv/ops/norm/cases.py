"""Conformance cases of layer_norm and rms_norm (odd shapes, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

from typing import Any

import torch

from opsadv.core.opdef import Case, rand


# ---- norms ---------------------------------------------------------------------------------------
def _norm(op, shape, weight=True, bias=True, residual=False, offset=0.0, noncontig=False):
    def build(dtype, device, g):
        n = shape[-1]
        x = rand(shape, dtype, device, g)
        if noncontig:
            x = rand(shape[:-1] + (2 * n,), dtype, device, g)[..., ::2]
        w = rand((n,), dtype, device, g) if weight else None
        kw: dict[str, Any] = {"residual": rand(shape, dtype, device, g)} if residual else {}
        if op == "layer_norm":
            return (x, w, rand((n,), dtype, device, g) if bias else None, 1e-5), kw
        if offset:
            kw["offset"] = offset
        return (x, w, 1e-6), kw
    return build


CASES = []
for _op in ("layer_norm", "rms_norm"):
    CASES += [
        Case(_op, "row1", _norm(_op, (1, 64)), (0, 1)),
        Case(_op, "odd", _norm(_op, (3, 100)), (0, 1)),
        Case(_op, "wide127", _norm(_op, (127, 257)), (0, 1)),
        Case(_op, "residual", _norm(_op, (2, 3, 96), residual=True), (0, 1), multi_output=True),
        Case(_op, "no_weight", _norm(_op, (5, 64), weight=False, bias=False), (0,), quick=False),
        Case(_op, "noncontig", _norm(_op, (4, 80), noncontig=True), (0, 1), quick=False),
    ]
CASES.append(Case("rms_norm", "offset", _norm("rms_norm", (7, 128), offset=1.0), (0, 1)))


def demo(op: str):
    """`opsadv demo`'s call of layer_norm / rms_norm: with the residual add."""
    def build(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
        m, n = (4096, 2048) if big else (100, 96)
        x, w, res = rand((m, n), dtype, device, g), rand((n,), dtype, device, g), rand((m, n), dtype, device, g)
        if op == "layer_norm":
            return (x, w, rand((n,), dtype, device, g), 1e-5), {"residual": res}
        return (x, w, 1e-6), {"residual": res}
    return build
