"""Conformance cases of flash_attention (odd shapes, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

from typing import Any

import torch

from opsadv.core.opdef import Case, rand


# ---- attention ---------------------------------------------------------------------------------
def _attn(b, hq, hkv, sq, sk, d, causal=False, mask=None):
    def build(dtype, device, g):
        q, k, v = rand((b, hq, sq, d), dtype, device, g), rand((b, hkv, sk, d), dtype, device, g), rand((b, hkv, sk, d), dtype, device, g)
        kw: dict[str, Any] = {"causal": causal}
        if mask == "bool":
            m = torch.rand((b, 1, sq, sk), generator=g) > 0.3
            m[:, :, 0, :] = False                 # one fully masked row: must give zeros, not NaN
            kw["attn_mask"] = m.to(device)
        elif mask == "float":
            kw["attn_mask"] = rand((1, hq, sq, sk), dtype, device, g)
        return (q, k, v), kw
    return build


CASES = [
    Case("flash_attention", "tiny", _attn(1, 1, 1, 1, 1, 32), (0, 1, 2)),
    Case("flash_attention", "odd", _attn(1, 3, 3, 127, 127, 64), (0, 1, 2)),
    Case("flash_attention", "causal", _attn(1, 2, 2, 67, 67, 64, causal=True), (0, 1, 2)),
    Case("flash_attention", "gqa", _attn(2, 4, 2, 37, 37, 64), (0, 1, 2)),
    Case("flash_attention", "mqa_causal", _attn(1, 4, 1, 45, 45, 32, causal=True), (0, 1, 2)),
    Case("flash_attention", "cross", _attn(1, 2, 2, 3, 130, 64), (0, 1, 2)),
    Case("flash_attention", "cross_causal", _attn(1, 2, 2, 17, 83, 64, causal=True), (0, 1, 2)),
    Case("flash_attention", "decode", _attn(2, 4, 2, 1, 77, 64, causal=True), (0, 1, 2)),
    Case("flash_attention", "q_longer_causal", _attn(1, 2, 2, 40, 19, 32, causal=True), (0, 1, 2)),
    Case("flash_attention", "mask_bool", _attn(1, 2, 2, 33, 47, 64, mask="bool"), (0, 1, 2)),
    Case("flash_attention", "mask_float", _attn(1, 2, 2, 29, 29, 64, mask="float"), (0, 1, 2), quick=False),
    Case("flash_attention", "d128", _attn(1, 2, 2, 65, 65, 128, causal=True), (0, 1, 2), quick=False),
    Case("flash_attention", "d96", _attn(1, 2, 1, 33, 33, 96), (0, 1, 2), quick=False),
    Case("flash_attention", "d256", _attn(1, 1, 1, 31, 31, 256, causal=True), (0, 1, 2), quick=False),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: causal GQA attention, prefill-sized on a GPU."""
    b, h, hkv, s, d = (2, 16, 4, 1024, 128) if big else (1, 4, 2, 100, 64)
    return (rand((b, h, s, d), dtype, device, g), rand((b, hkv, s, d), dtype, device, g),
            rand((b, hkv, s, d), dtype, device, g)), {"causal": True}
