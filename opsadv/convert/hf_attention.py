"""transformers' own seams: an attention function registered as "opsadv" in AttentionInterface
(and a mask function under the same name in AttentionMaskInterface), selected per model with
`set_attn_implementation("opsadv")`.  No modeling code is edited or copied.

The mask function keeps transformers' sdpa masks, except for a plain bidirectional padding mask
(BERT-style encoders), which it hands over as a stride-0 expanded view of the 2-D padding mask,
so the attention function can see it is key padding only and take the varlen/sparse path."""
from __future__ import annotations

import warnings

import torch

from opsadv import ops
from opsadv.core.layout import SparseLayout, capturing

from .modules import _exporting
from .packing import pack_of
from .state import scope_of

NAME = "opsadv"
_registered = False


def key_padding_of(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The (B, s_k) key padding mask when `mask` is one broadcast over queries (our mask fn's form)."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    if mask.shape[2] > 1 and mask.stride(2) != 0:
        return None
    return mask[:, 0, 0, :]


_last: tuple = (None, None)      # (mask tensor, its layout): all layers of one forward share the mask object


def _varlen_layout(mask: torch.Tensor, kpm: torch.Tensor, s_q: int):
    """SparseLayout for a key-padding mask, built once per forward (layers share the mask object).
    None while tracing for export/compile (the layout is built from the mask's values); the dense
    kernel with the same key padding mask serves then."""
    global _last
    if s_q != kpm.shape[1] or _exporting():
        return None
    m, lay = _last
    if m is mask:
        return lay
    if capturing(kpm):
        # CUDA graph capture: no host read of the mask; the kernel's tile lists are computed on the
        # device from it (recomputed on every replay), see layout._build_tile_index
        lay = SparseLayout(s_q, s_q, BLOCK, _dense_block_mask(s_q, kpm.device), key_padding_mask=kpm.contiguous())
    else:
        lay = SparseLayout.from_padding_mask(kpm, block_size=BLOCK)
    _last = (mask, lay)
    return lay


BLOCK = 128


def _dense_block_mask(s: int, device) -> torch.Tensor:
    # the same cached all-True block mask eager key-padding layouts use (the runner's eager warm-up
    # creates it outside capture)
    return SparseLayout.dense(s, block_size=BLOCK, device=device).block_mask


def opsadv_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             position_bias=None, **kwargs):
    """Same contract as transformers' sdpa_attention_forward: (b, h, s, d) inputs, returns
    ((b, s, h, d) output, None)."""
    st = getattr(module, "_opsadv_state", None)
    if dropout and dropout > 0 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        # Attention dropout (training) / softcapping / sinks have no opsadv kernel: use transformers' sdpa,
        # said once and counted in the model's state (visible in the report), never silently.
        why = "dropout" if dropout else "softcap/sinks"
        if st is not None:
            st.note_fallback(f"attention {why} -> sdpa")
        _warn_once(why)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, **kwargs)
    s_q = query.shape[2]
    causal_flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask
        mask = create_position_bias_mask(position_bias, mask, bool(causal_flag) and s_q > 1, query, key)
        causal = False
    elif mask is None:
        causal = bool(causal_flag) and s_q > 1
        if causal and key.shape[2] > s_q:         # empty static-cache slots: transformers' sdpa crops them too
            key, value = key[:, :, :s_q], value[:, :, :s_q]
    else:
        causal = False
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    with scope_of(module):
        pack = pack_of(attention_mask)
        if pack is not None:                      # packed encoder rows (see packing.py): (1, h, N, d)
            out = ops.sparse_attention(query, key, value, pack.layout, scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        kpm = key_padding_of(mask)
        layout = _varlen_layout(mask, kpm, s_q) if kpm is not None else None
        if layout is not None:
            out = ops.sparse_attention(query, key, value, layout, scale=scaling)
        else:
            if kpm is not None:
                mask = kpm[:, None, None, :]      # (B, 1, 1, s_k): broadcast, never materialized
            out = ops.flash_attention(query, key, value, causal=causal, scale=scaling, attn_mask=mask)
    return out.transpose(1, 2).contiguous(), None


_warned: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"opsadv attention: {why} has no opsadv kernel; these calls use transformers' sdpa "
                      "(see model.opsadv_report / state fallbacks)", RuntimeWarning, stacklevel=3)


def opsadv_mask(*args, **kwargs):
    """transformers' sdpa mask, except a plain bidirectional padding mask, returned as a stride-0
    expansion of the 2-D padding mask (same values, recognizable as key padding).  Takes whatever
    arguments this transformers version passes and forwards them unchanged."""
    from transformers import masking_utils as mu
    pad = kwargs.get("attention_mask")
    kv_length = kwargs.get("kv_length")
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = kwargs["cache_position"].shape[0]
    plain = (not args and kwargs.get("mask_function") is getattr(mu, "bidirectional_mask_function", None)
             and isinstance(pad, torch.Tensor) and pad.dim() == 2 and kv_length is not None and q_length is not None
             and pad.shape[-1] == kv_length and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
             and kwargs.get("local_size") is None)
    if not plain:
        return mu.sdpa_mask(*args, **kwargs)
    pad = pad.to(device=kwargs.get("device", pad.device), dtype=torch.bool)
    skip = getattr(mu, "_ignore_bidirectional_mask_sdpa", None)
    if kwargs.get("allow_is_bidirectional_skip") and skip is not None:
        try:
            if skip(pad, kv_length, None):
                return None
        except TypeError:                          # another transformers version's helper: just do not skip
            pass
    return pad[:, None, None, :].expand(kwargs["batch_size"], 1, q_length, kv_length)


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, opsadv_attention_forward)
    AttentionMaskInterface.register(NAME, opsadv_mask)
    _registered = True


def is_transformers_model(model) -> bool:
    import sys
    if "transformers" not in sys.modules:         # nothing of it is loaded: cannot be one (and stay light)
        return False
    from transformers import PreTrainedModel
    return isinstance(model, PreTrainedModel)


def attention_pass(model, report, undo, state) -> bool:
    """Point the model (and its sub-models) at the "opsadv" attention function."""
    register()
    before = model.config._attn_implementation
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        report.add("skipped", "", f"{type(model).__name__} attention",
                   "the model does not use transformers' AttentionInterface")
        return False
    model.set_attn_implementation(NAME)
    n = 0
    for path, m in model.named_modules():
        if hasattr(m, "is_causal") and any(hasattr(m, a) for a in ("q_proj", "query", "c_attn", "qkv_proj")):
            m._opsadv_state = state
            n += 1
    undo.attn.append((model, before))
    report.add("attention", "", f"{type(model).__name__}: attention implementation {before!r} -> 'opsadv' "
               f"(opsadv.flash_attention; padded encoders -> varlen sparse_attention when available; {n} layers)")
    return True
