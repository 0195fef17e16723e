"""Conformance cases of linear_cross_entropy (odd shapes: one token, a vocabulary that is no multiple of a chunk,
ignored tokens, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

import torch

from opsadv.core.opdef import Case, rand


def _labels(n, v, g, ignored=0.0):
    lab = torch.randint(0, v, (n,), generator=g)
    if ignored:
        lab[torch.rand(n, generator=g) < ignored] = -100
    return lab


def _lce(n, h, v, ignored=0.0, batch=None, **kw):
    def build(dtype, device, g):
        lead = (batch, n // batch) if batch else (n,)
        hidden = rand(lead + (h,), dtype, device, g)
        weight = rand((v, h), dtype, device, g, scale=h ** -0.5)
        labels = _labels(n, v, g, ignored).reshape(lead).to(device)
        extra = dict(kw)
        if extra.pop("with_bias", False):
            extra["bias"] = rand((v,), dtype, device, g, scale=0.5)
        return (hidden, weight, labels), extra
    return build


CASES = [
    Case("linear_cross_entropy", "one_token", _lce(1, 8, 5), (0, 1)),
    Case("linear_cross_entropy", "odd_vocab", _lce(127, 24, 1003, ignored=0.2), (0, 1)),
    Case("linear_cross_entropy", "batched_sum_bias", _lce(30, 16, 77, batch=3, reduction="sum", with_bias=True),
         (0, 1)),
    Case("linear_cross_entropy", "smoothing_zloss", _lce(33, 16, 129, ignored=0.1, label_smoothing=0.1, z_loss=1e-3),
         (0, 1), quick=False),
    Case("linear_cross_entropy", "softcap_none", _lce(19, 8, 300, ignored=0.3, softcap=5.0, reduction="none"),
         (0, 1), quick=False),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: a language model head's tokens against its vocabulary."""
    n, h, v = (8192, 2048, 32000) if big else (64, 32, 500)
    return _lce(n, h, v, ignored=0.1)(dtype, device, g)
