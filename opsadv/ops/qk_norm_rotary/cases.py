"""Conformance cases of qk_norm_rotary (odd shapes, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

from typing import Any

import torch

from opsadv.core.opdef import Case, rand


def _qknr(b, hq, hk, s, d, r=None, cos_batch=False, interleaved=False, positions=0, bshd=False, offset=0.0):
    def build(dtype, device, g):
        rr = r or d
        q = rand((b, s, hq, d), dtype, device, g).transpose(1, 2) if bshd else rand((b, hq, s, d), dtype, device, g)
        k = rand((b, s, hk, d), dtype, device, g).transpose(1, 2) if bshd else rand((b, hk, s, d), dtype, device, g)
        qw, kw_ = rand((d,), dtype, device, g, 0.5), rand((d,), dtype, device, g, 0.5)
        kw: dict[str, Any] = {"interleaved": interleaved, "weight_offset": offset}
        if positions:               # a (P, R) table and gapped position ids
            cos, sin = rand((positions, rr), dtype, device, g), rand((positions, rr), dtype, device, g)
            kw["position_ids"] = torch.randint(0, positions, (b, s), generator=g).to(device)
        else:
            shape = (b, s, rr) if cos_batch else (s, rr)
            cos, sin = rand(shape, dtype, device, g), rand(shape, dtype, device, g)
        return (q, k, cos, sin, qw, kw_), kw
    return build


_G = (0, 1, 4, 5)        # q, k and both weights get gradients
CASES = [
    Case("qk_norm_rotary", "one_token", _qknr(1, 1, 1, 1, 2), _G),
    Case("qk_norm_rotary", "odd_gqa_bshd", _qknr(2, 3, 1, 37, 24, bshd=True, cos_batch=True), _G),
    Case("qk_norm_rotary", "partial", _qknr(1, 4, 2, 5, 40, r=16), _G),
    Case("qk_norm_rotary", "gemma_offset", _qknr(1, 2, 1, 3, 64, offset=1.0), _G),
    Case("qk_norm_rotary", "interleaved", _qknr(2, 2, 2, 3, 12, interleaved=True), _G, quick=False),
    Case("qk_norm_rotary", "position_ids", _qknr(2, 4, 4, 9, 16, r=10, positions=50), _G, quick=False),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: Qwen3's shape, GQA q and k, a (seq, head_dim) table."""
    b, h, hkv, s, d = (2, 16, 4, 1024, 128) if big else (1, 4, 2, 100, 64)
    return (rand((b, h, s, d), dtype, device, g), rand((b, hkv, s, d), dtype, device, g),
            rand((s, d), dtype, device, g), rand((s, d), dtype, device, g), rand((d,), dtype, device, g),
            rand((d,), dtype, device, g)), {}
