"""Conformance cases of rotary_embedding (odd shapes, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

from typing import Any

import torch

from opsadv.core.opdef import Case, rand


# ---- rotary embedding ------------------------------------------------------------------------------------
def _rotary(b, hq, hk, s, d, r=None, cos_batch=False, interleaved=False, positions=0, bshd=False):
    def build(dtype, device, g):
        rr = r or d
        q = rand((b, s, hq, d), dtype, device, g).transpose(1, 2) if bshd else rand((b, hq, s, d), dtype, device, g)
        k = rand((b, hk, s, d), dtype, device, g)
        kw: dict[str, Any] = {"interleaved": interleaved}
        if positions:               # a (P, R) table and gapped position ids
            cos, sin = rand((positions, rr), dtype, device, g), rand((positions, rr), dtype, device, g)
            kw["position_ids"] = torch.randint(0, positions, (b, s), generator=g).to(device)
        else:
            shape = (b, s, rr) if cos_batch else (s, rr)
            cos, sin = rand(shape, dtype, device, g), rand(shape, dtype, device, g)
        return (q, k, cos, sin), kw
    return build


CASES = [
    Case("rotary_embedding", "one_token", _rotary(1, 1, 1, 1, 2), (0, 1)),
    Case("rotary_embedding", "odd_gqa_bshd", _rotary(2, 3, 1, 37, 24, bshd=True, cos_batch=True), (0, 1)),
    Case("rotary_embedding", "partial", _rotary(1, 4, 2, 5, 40, r=16), (0, 1)),
    Case("rotary_embedding", "interleaved", _rotary(2, 2, 2, 3, 12, interleaved=True), (0, 1), quick=False),
    Case("rotary_embedding", "position_ids", _rotary(2, 4, 4, 9, 16, positions=50), (0, 1), quick=False),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: GQA q and k, a (seq, head_dim) table."""
    b, h, hkv, s, d = (2, 16, 4, 1024, 128) if big else (1, 4, 2, 100, 64)
    return (rand((b, h, s, d), dtype, device, g), rand((b, hkv, s, d), dtype, device, g),
            rand((s, d), dtype, device, g), rand((s, d), dtype, device, g)), {}
