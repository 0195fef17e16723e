"""Conformance cases of swiglu (odd shapes, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

import torch

from opsadv.core.opdef import Case, rand


def _swiglu_act(shape, noncontig=False, activation=None):
    kw = {"activation": activation} if activation else {}

    def build(dtype, device, g):
        if noncontig:          # gate_up rows strided (every other row of a larger buffer)
            return (rand((2 * shape[0],) + shape[1:], dtype, device, g)[::2],), dict(kw)
        return (rand(shape, dtype, device, g),), dict(kw)
    return build


CASES = [
    Case("swiglu", "one_pair", _swiglu_act((1, 2)), (0,)),
    Case("swiglu", "odd", _swiglu_act((127, 2 * 65)), (0,)),
    Case("swiglu", "batched_wide", _swiglu_act((2, 3, 2 * 1100)), (0,), quick=False),
    Case("swiglu", "strided_rows", _swiglu_act((5, 2 * 40), noncontig=True), (0,), quick=False),
    # GeGLU (Gemma's MLP): act gelu_tanh, the call feature act_gelu_tanh
    Case("swiglu", "geglu_odd", _swiglu_act((127, 2 * 65), activation="gelu_tanh"), (0,)),
    Case("swiglu", "geglu_strided_batched", _swiglu_act((3, 2, 2 * 33), noncontig=True, activation="gelu_tanh"), (0,),
         quick=False),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: an MLP's gate_up rows."""
    m, n = (4096, 2048) if big else (100, 80)
    return (rand((m, 2 * n), dtype, device, g),), {}
