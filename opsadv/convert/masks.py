"""The forms our attention masks carry (convert/hf_attention.py's mask function builds them): a MaskForm
attribute on a causal mask, a stride-0 broadcast over queries for key padding.  Read by the attention function
and by the packed-encoder wrapper (packing.py)."""
from __future__ import annotations

from typing import NamedTuple

import torch


def key_padding_of(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The (B, s_k) key padding mask when `mask` is one broadcast over queries (our mask fn's form)."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    if causal_mask_of(mask) is not None:
        return None
    if mask.shape[2] > 1 and mask.stride(2) != 0:
        return None
    return mask[:, 0, 0, :]


class MaskForm(NamedTuple):
    """What our masks carry (attribute `_opsadv_form`).  causal: opsadv's bottom-right alignment (the queries are
    the last s_q keys).  key_padding: (B, s_k) bool, True = real token; None without padding.  block_mask: the
    (1, 1, ceil(s_q / BLOCK), ceil(s_k / BLOCK)) block mask of the layout: all True for key padding (with
    key_padding), all False for a window (the window band is the layout's allowing term).  window: a causal
    sliding window's left reach in keys (each query sees itself and the `window` keys before it: transformers'
    sliding_window w is window = w - 1), None without one; with causal False, a bidirectional window (query i sees
    keys i - window .. i + right: transformers' sliding_window_bidirectional_overlay(w) is window = right = w)."""
    causal: bool
    key_padding: torch.Tensor | None
    block_mask: torch.Tensor | None
    window: int | None = None
    right: int = 0


def form_of(mask) -> MaskForm | None:
    return getattr(mask, "_opsadv_form", None) if isinstance(mask, torch.Tensor) else None


def causal_mask_of(mask) -> MaskForm | None:
    f = form_of(mask)
    return f if f is not None and f.causal else None
