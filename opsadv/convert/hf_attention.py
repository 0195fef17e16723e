"""transformers' own seams: an attention function registered as "opsadv" in AttentionInterface
(and a mask function under the same name in AttentionMaskInterface), selected per model with
`set_attn_implementation("opsadv")`.  No modeling code is edited or copied.

The mask function keeps transformers' sdpa masks except for the forms it hands over recognizably,
so the attention function takes the key-padding kernels (sparse_attention with key padding, and its
own backward; packed encoders: varlen) instead of a dense masked one:
- a plain bidirectional padding mask (BERT-style encoders, and an encoder-decoder's cross-attention over the
  padded encoder batch): a stride-0 expanded view of the 2-D padding mask (key_padding_of);
- a plain causal mask (decoders: causal, optionally with a 2-D padding mask, the queries at the end
  of the keys as with a DynamicCache): the materialized bool mask (the values transformers' sdpa
  mask has, for any other reader) carrying a MaskForm: causal, the key padding mask it was built
  from (causal_mask_of).  The attention then knows the call is causal + key padding; it never
  infers it;
- a plain sliding-window causal mask (transformers' sliding_window_causal_mask_function(w): Mistral,
  Qwen2 with use_sliding_window, Gemma-2/3 local layers): the same causal form with the window
  (w - 1 keys before each query) where it excludes a key, else the plain causal form.  The attention
  runs causal + window (+ key padding) sparse_attention over the keys the window reaches; a one-query
  step without padding, the dense kernel over the last w keys.  Windowed masks with a static cache's
  tensor offset, an overlay, packed sequences or symbolic lengths stay transformers' (counted);
- a plain bidirectional sliding-window mask (transformers' sliding_window_bidirectional_mask_function(w):
  ModernBERT's local layers): transformers' values carrying a non-causal MaskForm with the window both ways
  (window = right = w) and the key padding; the attention runs that sparse_attention layout.
The forms hold under torch.compile / export and CUDA-graph capture as well: there they are built without reading
mask values (eager calls read "any padding?" once per forward).  Their MaskForm also carries the layout's
all-True block mask, made once per forward with the mask, so every layer's layout shares it (and the kernel's
tile index, cached on it and the key padding mask, is built once per forward), traced or not.

Calls opsadv has no kernel for (attention dropout, softcapping, sinks) run the model's original
attention implementation (the one before conversion), counted in the model's state."""
from __future__ import annotations

import copy
import inspect
import sys
import warnings

import torch
from torch._subclasses.fake_tensor import is_fake

from opsadv import ops
from opsadv.ops.fp8_attention import fp8_attention_from_bf16
from opsadv.ops.sparse_attention.layout import SparseLayout, capturing

from .masks import MaskForm, causal_mask_of, form_of, key_padding_of
from .modules import _exporting
from opsadv.ops.sparse_attention.packed_segments import packed_segments
from .packing import Pack, pack_of, packed_mask
from .state import scope_of

NAME = "opsadv"
BLOCK = 128
_registered = False
# an opsadv.PagedKVCache's update that no attention has consumed yet: (cache, layer_idx, key, value)
# (convert/paged_cache.py; kept here so this module does not import transformers' cache code)
paged_pending: list = [None]


def pending_for(key):
    """The PagedKVCache whose pending update `key` is (the attention then runs through it), else None."""
    p = paged_pending[0]
    return p[0] if p is not None and p[2] is key else None


def _block_mask(s_q, s_k, like: torch.Tensor) -> torch.Tensor | None:
    """The layout's all-True block mask: the cached one where values can be read (eager, CUDA-graph capture after
    an eager warm-up), else one made in the traced graph (once per forward: the mask function runs once)."""
    if not (isinstance(s_q, int) and isinstance(s_k, int)):
        return None     # symbolic lengths (export with dynamic shapes): no layout is built, and a (1, 1, nb, nb)
        #                 tensor of symbolic nb made torch.export specialize nb (its channels-last check)
    if _values_unreadable(like):
        return torch.ones(1, 1, -(-s_q // BLOCK), -(-s_k // BLOCK), dtype=torch.bool, device=like.device)
    return SparseLayout.dense(s_q, s_k, block_size=BLOCK, device=like.device).block_mask


def _window_block_mask(s_q: int, s_k: int, left: int, like: torch.Tensor) -> torch.Tensor:
    """The window layout's all-False block mask (the band allows): the cached one where values can be read, else
    one made in the traced graph (once per forward)."""
    if _values_unreadable(like):
        return torch.zeros(1, 1, -(-s_q // BLOCK), -(-s_k // BLOCK), dtype=torch.bool, device=like.device)
    return SparseLayout.sliding_window(s_q, (left, 0), seq_k=s_k, causal=True, block_size=BLOCK,
                                       device=like.device).block_mask


def _values_unreadable(t: torch.Tensor | None) -> bool:
    """Mask values cannot be read on the host now: compile / export tracing, fake tensors, jit / fx tracing."""
    if _exporting() or torch.jit.is_tracing():
        return True
    if t is None:
        return False
    return is_fake(t) or isinstance(t, torch.fx.Proxy)


# (mask tensor, its version, its layout): all layers of one forward share the mask object; the version tells a
# mask refilled in place (a CUDA-graph runner's static input) from the one the layout was built for
_last: tuple = (None, -1, None)


def _padding_layout(mask: torch.Tensor, kpm: torch.Tensor, s_q, s_k, causal: bool, block_mask=None):
    """SparseLayout for key padding (with causal), built once per mask (layers share the mask object).
    Eager: cached on the mask's content.  CUDA-graph capture: no host read (the kernel's tile lists are
    computed on the device, on every replay).  Tracing: the key padding tensor and the form's block mask
    (made once per forward in the graph), no value read; None without one (the dense kernel with the same
    key padding, and causal, serves then)."""
    global _last
    if _values_unreadable(kpm):
        if block_mask is None or not (isinstance(s_q, int) and isinstance(s_k, int)):
            return None         # (symbolic lengths: an export with dynamic shapes; a layout takes ints)
        # (the forms' block masks are _block_mask's all-True ones: dense_blocks as the eager layout has it, so a
        # compiled call resolves in the same bucket as eager, to the same kernel and tuned config)
        return SparseLayout(s_q, s_k, BLOCK, block_mask, causal, key_padding_mask=kpm, dense_blocks=True)
    m, version, lay = _last
    if m is mask and version == _version(mask):
        return lay
    if capturing(kpm):
        lay = SparseLayout(s_q, s_k, BLOCK, _dense_block_mask(s_q, s_k, kpm.device), causal,
                           key_padding_mask=kpm.contiguous(), dense_blocks=True)
    else:
        lay = SparseLayout.key_padding(kpm, seq_q=s_q, causal=causal, block_size=BLOCK)
    _last = (mask, _version(mask), lay)
    return lay


def _version(t: torch.Tensor) -> int:
    return -2 if t.is_inference() else t._version    # inference tensors keep no version counter


def _dense_block_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    # the same cached all-True block mask eager key-padding layouts use (the runner's eager warm-up
    # creates it outside capture)
    return SparseLayout.dense(s_q, s_k, block_size=BLOCK, device=device).block_mask


# (mask tensor, its version, (s_q, s_k, window), its window layout): as _last, for the sliding-window layers (a
# model mixing local and global layers keeps one entry of each kind per forward)
_last_window: tuple = (None, -1, None, None)


def _window_layout(mask, kpm, s_q: int, s_k: int, left: int, block_mask, device, right: int = 0,
                   causal: bool = True):
    """SparseLayout for a causal (or, causal False, bidirectional) window (+ key padding), built once per mask and
    lengths (layers share the mask).  Tracing / CUDA-graph capture: from the tensors (the form's block mask, made
    once per forward), no value read."""
    global _last_window
    if _values_unreadable(mask):
        if block_mask is None or tuple(block_mask.shape[2:]) != (-(-s_q // BLOCK), -(-s_k // BLOCK)):
            block_mask = torch.zeros(1, 1, -(-s_q // BLOCK), -(-s_k // BLOCK), dtype=torch.bool, device=device)
        return SparseLayout(s_q, s_k, BLOCK, block_mask, causal, (left, right),
                            key_padding_mask=None if kpm is None else kpm.contiguous())
    key = (s_q, s_k, left, right, causal)
    m, version, k, lay = _last_window
    if m is mask and version == _version(mask) and k == key:
        return lay
    lay = SparseLayout.sliding_window(s_q, (left, right), seq_k=s_k, causal=causal, block_size=BLOCK, device=device)
    if kpm is not None:
        lay = lay.with_(key_padding_mask=kpm.contiguous())
    _last_window = (mask, _version(mask), key, lay)
    return lay


def _attend_window(mask, cm: MaskForm, query, key, value, scaling):
    """A call with our sliding-window form: causal + window (+ key padding) sparse_attention; one query without
    padding (decode): the dense kernel over the last window + 1 keys.  A bidirectional window (an encoder's local
    layers, s_q == s_k): window both ways (+ key padding)."""
    s_q, s_k = query.shape[2], key.shape[2]
    left, kpm = cm.window, cm.key_padding
    if not cm.causal:
        layout = _window_layout(mask, kpm, s_q, s_k, left, cm.block_mask, query.device, cm.right, causal=False)
        return ops.sparse_attention(query, key, value, layout, scale=scaling)
    reach = s_q + left                            # the keys any query's window reaches: the last s_q + left
    if s_k > reach:                               # a cache holding more (a DynamicCache without sliding layers)
        key, value = key[:, :, s_k - reach:], value[:, :, s_k - reach:]
        kpm = None if kpm is None else kpm[:, s_k - reach:]
        s_k = reach
    if s_q == 1 and kpm is None:                  # the one query sees all the keys left: no mask, no layout
        return ops.flash_attention(query, key, value, causal=False, scale=scaling)
    layout = _window_layout(mask, kpm, s_q, s_k, left, cm.block_mask, query.device)
    return ops.sparse_attention(query, key, value, layout, scale=scaling)


# set on an attention module whose block convert_model(precision="fp8") keeps in FP8 (convert/fp8.py): its no-grad
# calls without key padding or a window run fp8_attention_from_bf16; padded / windowed calls and training calls keep
# the bf16 kernels (the FP8 attention's backward is not the recipe's yet: docs/fp8.md)
FP8_FLAG = "_opsadv_fp8_attention"


def _dense(module, query, key, value, causal: bool, scaling):
    """Attention with no mask: FP8 where the module's block is in FP8 (no-grad calls), else flash_attention."""
    if getattr(module, FP8_FLAG, False) and not (torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad)):
        return fp8_attention_from_bf16(query, key, value, causal=causal, scale=scaling)
    return ops.flash_attention(query, key, value, causal=causal, scale=scaling)


def _attend_causal(mask, cm: MaskForm, query, key, value, scaling, module=None):
    """A call with our causal mask: causal (bottom-right) + key padding kernels (+ a window: _attend_window)."""
    if cm.window is not None:
        return _attend_window(mask, cm, query, key, value, scaling)
    s_q, s_k = query.shape[2], key.shape[2]
    causal = bool(s_q > 1)                        # one query sees every key either way (bool: s_q may be symbolic)
    kpm = cm.key_padding
    if kpm is None:
        return _dense(module, query, key, value, causal, scaling)
    layout = _padding_layout(mask, kpm, s_q, s_k, causal, cm.block_mask)
    if layout is not None:
        return ops.sparse_attention(query, key, value, layout, scale=scaling)
    # no layout (symbolic lengths while tracing): the dense kernel with the key padding broadcast, and causal
    # where the lengths are equal (the masked vendor kernels align causal top-left); else the mask's values
    if s_q == s_k:
        return ops.flash_attention(query, key, value, causal=causal, scale=scaling, attn_mask=kpm[:, None, None, :])
    return ops.flash_attention(query, key, value, scale=scaling, attn_mask=mask)


def opsadv_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             position_bias=None, **kwargs):
    """Same contract as transformers' sdpa_attention_forward: (b, h, s, d) inputs, returns
    ((b, s, h, d) output, None)."""
    paged = pending_for(key)
    if paged is not None:                         # key is an opsadv.PagedKVCache's new tokens: it appends and attends
        return paged.attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias,
                            kwargs)
    d_qk, d_v = key.shape[-1], value.shape[-1]
    if d_v != d_qk:
        # multi-head latent attention (DeepSeek-V2 / V3: q/k 192, v 128): our kernels take one head dim, so the
        # narrower side is zero-padded (zero columns change neither the scores nor the kept output columns), as
        # transformers' flash-attention path pads V; the scale stays the caller's, 1/sqrt(d_qk) by default
        scaling = d_qk ** -0.5 if scaling is None else scaling
        if d_v < d_qk:
            value = torch.nn.functional.pad(value, (0, d_qk - d_v))
        else:
            query = torch.nn.functional.pad(query, (0, d_v - d_qk))
            key = torch.nn.functional.pad(key, (0, d_v - d_qk))
        out, weights = _attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                          position_bias, **kwargs)
        return out[..., :d_v], weights
    return _attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias,
                              **kwargs)


def _attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias,
                       **kwargs):
    why = _unserved(dropout, kwargs)
    if why is not None:
        return _fallback(module, why, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias,
                         kwargs)
    s_q = query.shape[2]
    causal_flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    cm = causal_mask_of(mask)
    if cm is not None and position_bias is None and (cm.key_padding is None
                                                     or cm.key_padding.shape[-1] == key.shape[2]):
        with scope_of(module):
            out = _attend_causal(mask, cm, query, key, value, scaling, module)
        return out.transpose(1, 2).contiguous(), None
    bw = form_of(mask)
    if (bw is not None and not bw.causal and bw.window is not None and position_bias is None
            and tuple(mask.shape[-2:]) == (s_q, key.shape[2])):
        with scope_of(module):                    # our bidirectional window form (an encoder's local layers)
            out = _attend_window(mask, bw, query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    if kwargs.get("sliding_window") is not None and isinstance(mask, torch.Tensor) and form_of(mask) is None \
            and pack_of(mask) is None and not _exporting():
        _note_window_mask(module)
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
        if pack is not None and pack.layout.seq_q == query.shape[0] * s_q == key.shape[0] * key.shape[2]:
            # packed rows: (1, h, N, d) from the packed encoder (packing.py) or a packed decoder batch; (b, h, s, d)
            # from a compiled packed form (_traced_packed_mask): the rows laid end to end
            b = query.shape[0]
            flat = (lambda t: t) if b == 1 else (lambda t: t.transpose(0, 1).reshape(1, t.shape[1], -1, t.shape[3]))
            out = ops.sparse_attention(flat(query), flat(key), flat(value), pack.layout, scale=scaling)
            if b > 1:
                out = out.reshape(out.shape[1], b, s_q, out.shape[3]).transpose(0, 1)
            return out.transpose(1, 2).contiguous(), None
        kpm = key_padding_of(mask)
        f = form_of(mask)
        # a mask of one query row is key padding too (a static-cache decode step, a cross-attention decode step):
        # the dense kernel takes it; cross-attention over a padded encoder batch (s_q != s_k): key padding too
        layout = (_padding_layout(mask, kpm, s_q, key.shape[2], False, f.block_mask if f is not None else None)
                  if kpm is not None and (s_q == key.shape[2] or (isinstance(s_q, int) and s_q > 1 and not causal))
                  else None)
        if layout is not None:
            out = ops.sparse_attention(query, key, value, layout, scale=scaling)
        elif mask is None:
            out = _dense(module, query, key, value, causal, scaling)
        else:
            if kpm is not None:
                mask = kpm[:, None, None, :]      # (B, 1, 1, s_k): broadcast, never materialized
            out = ops.flash_attention(query, key, value, causal=causal, scale=scaling, attn_mask=mask)
    return out.transpose(1, 2).contiguous(), None


WINDOW_MASK_NOTE = "sliding window with transformers' mask (static cache / overlay / packed) -> masked flash_attention"


def _note_window_mask(module) -> None:
    """A windowed call whose mask our mask function left to transformers (a static cache's tensor offset, an
    overlay, packed sequences, symbolic lengths): the dense masked kernel serves it; counted, warned once."""
    st = getattr(module, "_opsadv_state", None)
    if st is not None:
        st.note_fallback(WINDOW_MASK_NOTE)
    if ("window", "mask") not in _warned and not torch.compiler.is_compiling():       # (as _warn_once)
        _warned.add(("window", "mask"))
        warnings.warn(f"opsadv attention: {WINDOW_MASK_NOTE} (counted in the model's state fallbacks)",
                      RuntimeWarning, stacklevel=5)


# ---- calls without an opsadv kernel: the model's original attention implementation --------------------------
def _unserved(dropout, kwargs) -> str | None:
    if dropout and dropout > 0:
        return "dropout"
    if kwargs.get("softcap") is not None:
        return "softcapping"
    if kwargs.get("s_aux") is not None:
        return "sinks"
    return None


def _model_eager(module):
    """The modeling file's own eager attention function (it implements what the model needs: softcapping,
    sinks, position bias), None where the file has none."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def fallback_target(module, why: str) -> tuple[str, object]:
    """(name, function) serving a call opsadv cannot: the model's original implementation where it serves
    the call, else the model's eager attention.  Transformers' sdpa serves dropout but not softcapping or
    sinks (transformers 5.24 raises for softcap, 5.17 ignores it: wrong numbers); implementations whose masks
    take another form (flash / flex) are served by the model's eager attention, which takes any mask here."""
    before = getattr(module, "_opsadv_attn_before", None) or "sdpa"
    if before == "sdpa" and why == "dropout":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return "sdpa", sdpa_attention_forward
    eager = _model_eager(module)
    if eager is not None:
        return "eager", eager
    if why == "dropout":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return "sdpa", sdpa_attention_forward
    raise NotImplementedError(
        f"opsadv attention: {why} has no opsadv kernel, transformers' sdpa cannot compute it and "
        f"{type(module).__module__} has no eager_attention_forward (the model's original implementation was "
        f"{before!r}); convert without attention (opt_level=0) or use a model implementation that has one")


def _exact_mask(module, mask, query, key, value, is_causal):
    """(bool / float mask or None, key, value) with exactly the call's semantics, for another implementation:
    our forms are materialized (packed encoder rows: the block-diagonal mask over the packed rows; a packed decoder
    batch's mask is transformers' own, shaped as the call), None stays None except a causal call, which gets its
    mask (keys cropped to the queries as transformers' sdpa does)."""
    pack = pack_of(mask)
    if pack is not None and not (mask.shape[-2:] == (query.shape[2], key.shape[2])
                                 and mask.shape[0] in (1, query.shape[0])):
        return pack.layout.dense_mask(device=query.device), key, value
    if mask is not None:
        return mask, key, value
    s_q = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal or s_q == 1:
        return None, key, value
    if key.shape[2] > s_q:
        key, value = key[:, :, :s_q], value[:, :, :s_q]
    return torch.ones(s_q, s_q, dtype=torch.bool, device=query.device).tril()[None, None], key, value


def _fallback(module, why, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias, kwargs):
    name, fn = fallback_target(module, why)
    st = getattr(module, "_opsadv_state", None)
    if st is not None:
        st.note_fallback(f"attention {why} -> {name}")
    _warn_once(why, name)
    extra = dict(kwargs)
    if position_bias is not None:
        extra["position_bias"] = position_bias
    if name == "sdpa":                            # takes bool masks (ours have the values) and None + is_causal
        mask = attention_mask
        if pack_of(mask) is not None:
            mask = _exact_mask(module, mask, query, key, value, is_causal)[0]
        if is_causal is not None:
            extra["is_causal"] = is_causal
        return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **extra)
    mask, key, value = _exact_mask(module, attention_mask, query, key, value, is_causal)
    if mask is not None and mask.dtype == torch.bool:    # eager adds its mask to the scores
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **extra)


_warned: set[tuple[str, str]] = set()


def _warn_once(why: str, name: str) -> None:
    # (not from a graph being compiled: warnings.warn breaks it; the conversion report names these calls too)
    if (why, name) not in _warned and not torch.compiler.is_compiling():
        _warned.add((why, name))
        warnings.warn(f"opsadv attention: {why} has no opsadv kernel; these calls use the model's {name!r} attention "
                      "(counted in the model's state fallbacks)", RuntimeWarning, stacklevel=5)


# ---- the mask function ---------------------------------------------------------------------------------------
def _plain_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _causal_form(mu, kwargs, window: int | None = None):
    """Our causal mask for a plain causal call (no overlay, int offsets with the queries at the end of the keys: no
    cache or a DynamicCache, sliding-window layers' included), with transformers' sliding window `window` (w keys:
    each query sees itself and the w - 1 before it) when given, else NotImplemented (transformers' sdpa mask
    serves).  The materialized values are those of transformers' sdpa mask (other readers: fallbacks, eager)."""
    global _last
    b, q_len, kv_len = kwargs.get("batch_size"), kwargs.get("q_length"), kwargs.get("kv_length")
    q_off, kv_off = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    pad = kwargs.get("attention_mask")
    if not all(_plain_int(x) for x in (b, q_len, kv_len, q_off, kv_off)):
        return NotImplemented                     # a tensor q_offset (static cache): transformers' mask
    if window is None and kwargs.get("local_size") is not None:
        return NotImplemented                     # a local pattern we did not recognise (chunks)
    if q_off + q_len != kv_off + kv_len:
        return NotImplemented                     # queries not at the end of the keys: no bottom-right form
    if window is not None:
        if not all(isinstance(x, int) for x in (q_len, kv_len, q_off, kv_off)):
            return NotImplemented                 # symbolic lengths: a window layout takes ints (transformers' mask)
        if window >= kv_len:
            window = None                         # every key is within every query's window: plain causal
    if pad is not None and (not isinstance(pad, torch.Tensor) or pad.dim() != 2 or pad.shape[0] != b):
        return NotImplemented
    device = kwargs.get("device", pad.device if pad is not None else "cpu")
    kpm = lay = None
    if pad is not None:                           # transformers indexes the padding mask by absolute key position
        kpm = mu.prepare_padding_mask(pad.to(device=device, dtype=torch.bool), kv_len, kv_off)
        kpm = kpm[:, kv_off:kv_off + kv_len].contiguous()
        if not capturing(kpm) and not _values_unreadable(kpm):
            if bool(kpm.all()):
                kpm = None                        # no padding: plain causal (transformers reads the mask here too)
            elif q_len == kv_len > 1:
                # (training, prefill) the layout's copy, cached on the content: a compiled layer stack (regional
                # compilation) then gets the same tensor every step, and the kernels' tile index (cached on it) is
                # built once, not per step; eager layers get this layout (_last below) without reading the mask again
                lay = SparseLayout.key_padding(kpm, seq_q=q_len, causal=True, block_size=BLOCK)
                kpm = lay.key_padding_mask
    if window is None and kpm is None and kwargs.get("allow_is_causal_skip", True) and (q_len == 1 or q_len == kv_len):
        return None                               # the attention's is_causal says it (as transformers' sdpa)
    rows = torch.arange(q_len, device=device) + q_off
    cols = torch.arange(kv_len, device=device) + kv_off
    allowed = cols[None, :] <= rows[:, None]
    if window is not None:
        allowed = allowed & (cols[None, :] > rows[:, None] - window)     # transformers' sliding_window_overlay
    allowed = allowed[None, None]
    left = None if window is None else window - 1
    if kpm is None:
        m = allowed.expand(b, 1, q_len, kv_len)
        bm = None if left is None else _window_block_mask(q_len, kv_len, left, m)
        m._opsadv_form = MaskForm(True, None, bm, left)
    else:
        m = allowed & kpm[:, None, None, :]
        bm = _block_mask(q_len, kv_len, kpm) if left is None else _window_block_mask(q_len, kv_len, left, kpm)
        m._opsadv_form = MaskForm(True, kpm, bm, left)
        if lay is not None and left is None:
            _last = (m, _version(m), lay)         # what _padding_layout would build for this mask's calls
    return m


def _may_be_sliding_window(mu, fn, kwargs) -> bool:
    """Whether `fn` may be transformers' plain sliding-window causal function (_sliding_window_of decides).  While
    dynamo traces, only a call of create_sliding_window_causal_mask's plain path gets that far: dynamo cannot make a
    constant of a closure holding a traced tensor (chunks' left padding, packed positions, block ids: a graph break)."""
    if fn is None or not hasattr(mu, "and_masks"):
        return False
    if not torch.compiler.is_compiling():
        return True                               # eager: the closures are read exactly
    return (getattr(fn, "__code__", None) is mu.and_masks(mu.causal_mask_function).__code__
            and not kwargs.get("use_vmap") and bool(kwargs.get("allow_is_causal_skip", True))
            and _config_window(kwargs))


def _config_window(kwargs) -> bool:
    """The mask call's local_size is the config's sliding window (not its attention chunk size)."""
    cfg, local = kwargs.get("config"), kwargs.get("local_size")
    return (isinstance(local, int) and local >= 1 and local == getattr(cfg, "sliding_window", None)
            and local != getattr(cfg, "attention_chunk_size", None))


def _window_and(fn, base: str, overlay: str, least: int) -> int | None:
    """w when `fn` is transformers' and_masks(<overlay>(w), <base>) (masking_utils function names), read from the
    closures, w >= least; None for anything else or where this transformers lacks those functions."""
    from transformers import masking_utils as mu
    if not all(hasattr(mu, n) for n in ("and_masks", base, overlay)):
        return None                               # another transformers: its masks serve
    base_fn = getattr(mu, base)
    cells = _cells(fn, mu.and_masks(base_fn).__code__)
    fns = None if cells is None else cells.get("mask_functions")
    if not isinstance(fns, tuple) or len(fns) != 2 or fns[1] is not base_fn:
        return None
    cl = _cells(fns[0], getattr(mu, overlay)(1).__code__)
    w = None if cl is None else cl.get("sliding_window")
    return w if isinstance(w, int) and not isinstance(w, bool) and w >= least else None


@torch.compiler.assume_constant_result
def _sliding_window_of(fn) -> int | None:
    """w when `fn` is transformers' sliding_window_causal_mask_function(w) (and_masks(sliding_window_overlay(w),
    causal_mask_function)), read from the closures; None for anything else (overlays on it, chunks, packing).
    A constant while dynamo traces: closure cells are not traceable, and w is the config's (which dynamo guards)."""
    return _window_and(fn, "causal_mask_function", "sliding_window_overlay", 1)


@torch.compiler.assume_constant_result
def _bidirectional_window_of(fn) -> int | None:
    """w when `fn` is transformers' sliding_window_bidirectional_mask_function(w) (and_masks(
    sliding_window_bidirectional_overlay(w), bidirectional_mask_function)); None for anything else.  A constant
    while dynamo traces (as _sliding_window_of)."""
    return _window_and(fn, "bidirectional_mask_function", "sliding_window_bidirectional_overlay", 0)


def _bidirectional_window_form(mu, fn, kwargs):
    """transformers' bidirectional sliding-window mask (ModernBERT's local layers) carrying our form (window both
    ways + the key padding: sparse_attention skips the tiles outside the band), or NotImplemented where the call is
    not that plain form (an overlay, offsets, symbolic lengths: transformers' mask serves as it is)."""
    if fn is None or not hasattr(mu, "and_masks"):
        return NotImplemented
    if torch.compiler.is_compiling() and (
            getattr(fn, "__code__", None) is not mu.and_masks(mu.bidirectional_mask_function).__code__
            or kwargs.get("use_vmap") or not _config_window(kwargs)):
        return NotImplemented                     # (only create_bidirectional_sliding_window_mask's plain call)
    w = _bidirectional_window_of(fn)
    b, q_len, kv_len = kwargs.get("batch_size"), kwargs.get("q_length"), kwargs.get("kv_length")
    pad = kwargs.get("attention_mask")
    if (w is None or kwargs.get("local_size") not in (None, w)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in (b, q_len, kv_len))
            or q_len != kv_len or kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0
            or (pad is not None and (not isinstance(pad, torch.Tensor) or tuple(pad.shape) != (b, kv_len)))):
        return NotImplemented
    m = mu.sdpa_mask(**kwargs)                    # the values, for any other reader (fallbacks, eager)
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (b, 1, q_len, kv_len):
        return m                                  # (None: no padding and every key within the window)
    kpm = None if pad is None else pad.to(device=m.device, dtype=torch.bool)
    if kpm is not None and not capturing(kpm) and not _values_unreadable(kpm) and bool(kpm.all()):
        kpm = None
    bm = (torch.zeros(1, 1, -(-q_len // BLOCK), -(-kv_len // BLOCK), dtype=torch.bool, device=m.device)
          if _values_unreadable(m) else None)
    m._opsadv_form = MaskForm(False, None if kpm is None else kpm.contiguous(), bm, w, w)
    return m


def _packed_sequences(mu, fn, kwargs) -> tuple[list[int], int | None] | None:
    """(sequence lengths, window's left reach or None) of a padding-free packed batch (one row of several sequences,
    each with its own position ids: transformers' DataCollatorWithFlattening, TRL's padding_free), when `fn` is
    create_causal_mask's (or create_sliding_window_causal_mask's) exact form for it:
    and_masks(f, packed_sequence_mask_function(sequence ids)) with f causal_mask_function or
    sliding_window_causal_mask_function(w), as such (transformers 5.17) or under
    remap_positions_for_packed_sequence(f, position_ids) (5.25); else None (transformers' mask serves).  Within a
    sequence the positions step by 1, so causal (and a window) by position is causal by index: a causal varlen
    layout computes that mask.  Eager only (the lengths are a host read, as transformers' own packing check is)."""
    need = ("and_masks", "packed_sequence_mask_function", "causal_mask_function")
    if fn is None or not all(hasattr(mu, n) for n in need) or torch.compiler.is_compiling():
        return None
    b, q_len, kv_len = kwargs.get("batch_size"), kwargs.get("q_length"), kwargs.get("kv_length")
    if (b != 1 or not isinstance(q_len, int) or q_len != kv_len or kwargs.get("attention_mask") is not None
            or kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0):
        return None
    cells = _cells(fn, mu.and_masks(mu.causal_mask_function).__code__)
    fns = None if cells is None else cells.get("mask_functions")
    if not isinstance(fns, tuple) or len(fns) != 2:
        return None
    same = _cells(fns[1], mu.packed_sequence_mask_function(None).__code__)
    if same is None:
        return None
    # transformers >= 5.2x wraps the causal function in position remapping; earlier 5.x applies it by index (the
    # same mask here: within a sequence, index and position differ by a constant)
    remap = (_cells(fns[0], mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None).__code__)
             if hasattr(mu, "remap_positions_for_packed_sequence") else None)
    inner, left = (remap.get("mask_function") if remap is not None else fns[0]), None
    if inner is not mu.causal_mask_function:
        w = _sliding_window_of(inner) if inner is not None else None
        if w is None or kwargs.get("local_size") not in (None, w):
            return None
        left = w - 1
    ids = same.get("packed_sequence_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or tuple(ids.shape) != (1, q_len) \
            or _values_unreadable(ids) or capturing(ids):
        return None
    return torch.unique_consecutive(ids[0], return_counts=True)[1].tolist(), left


def _traced_packed_window(mu, fn, kwargs):
    """While dynamo traces: the window's left reach (None without a window) when `fn` has the shape of
    create_causal_mask's (or create_sliding_window_causal_mask's) packed form, and_masks(<causal or window
    function>, <same-sequence function>) built without a cache or an attention mask, else NotImplemented.  The
    closures cannot be read while tracing (they hold traced tensors), so this is the call's structure only; the
    mask's values are checked when the graph runs (packed_segments)."""
    b, q_len, kv_len = kwargs.get("batch_size"), kwargs.get("q_length"), kwargs.get("kv_length")
    if (fn is None or not hasattr(mu, "and_masks") or not torch.compiler.is_compiling()
            or getattr(fn, "__code__", None) is not mu.and_masks(mu.causal_mask_function).__code__
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in (b, q_len, kv_len))
            or q_len != kv_len or q_len < 2 or kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0
            or kwargs.get("attention_mask") is not None or kwargs.get("use_vmap")
            or kwargs.get("allow_is_causal_skip", True)):
        return NotImplemented                     # (a packed form always turns the is_causal skip off)
    local = kwargs.get("local_size")
    if local is None:
        return None
    return local - 1 if _config_window(kwargs) else NotImplemented     # (chunked attention: not a window)


def _traced_packed_mask(m, b: int, s: int, left: int | None):
    """transformers' materialized packed mask `m`, carrying the varlen layout of its segments over the b rows laid
    end to end (segments of at most s tokens: max_seqlen = s without a host read)."""
    n = b * s
    cu = packed_segments(m, left)
    nb = -(-n // BLOCK)
    bm = torch.full((1, 1, nb, nb), left is None, dtype=torch.bool, device=m.device)
    lay = SparseLayout(n, n, BLOCK, bm, True, None if left is None else (left, 0), cu_seqlens=cu,
                       dense_blocks=left is None, max_seqlen=s)
    return packed_mask(Pack(None, None, lay, b, s), m)


def _cells(fn, code) -> dict | None:
    """The closure variables of `fn` when it is a closure of `code`."""
    if getattr(fn, "__code__", None) is not code or getattr(fn, "__closure__", None) is None:
        return None
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}


def opsadv_mask(*args, **kwargs):
    """transformers' sdpa mask, except a plain bidirectional padding mask (a stride-0 expansion of the 2-D
    padding mask) and a plain causal one (the materialized mask); both carry a MaskForm, see the module
    docstring.  Takes whatever arguments this transformers version passes and forwards them unchanged."""
    global _last
    from transformers import masking_utils as mu
    fn = kwargs.get("mask_function")
    packed = None if args else _packed_sequences(mu, fn, kwargs)
    if packed is not None:
        m = mu.sdpa_mask(*args, **kwargs)         # the values, for any other reader (fallbacks)
        if isinstance(m, torch.Tensor):
            seqlens, left = packed
            lay = SparseLayout.varlen(seqlens, causal=True, window=left, block_size=BLOCK, device=m.device)
            m = packed_mask(Pack(None, None, lay, 1, sum(seqlens)), m)
        return m
    left = NotImplemented if args else _traced_packed_window(mu, fn, kwargs)
    if left is not NotImplemented:
        m = mu.sdpa_mask(*args, **kwargs)
        if isinstance(m, torch.Tensor) and m.dtype == torch.bool and tuple(m.shape) == (
                kwargs["batch_size"], 1, kwargs["q_length"], kwargs["kv_length"]):
            m = _traced_packed_mask(m, kwargs["batch_size"], kwargs["q_length"], left)
        return m
    if not args and fn is getattr(mu, "causal_mask_function", None):
        m = _causal_form(mu, kwargs)
        if m is not NotImplemented:
            return m
        return mu.sdpa_mask(*args, **kwargs)
    window = _sliding_window_of(fn) if not args and _may_be_sliding_window(mu, fn, kwargs) else None
    if window is not None and kwargs.get("local_size") in (None, window):
        m = _causal_form(mu, kwargs, window)
        if m is not NotImplemented:
            return m
        return mu.sdpa_mask(*args, **kwargs)
    if not args and kwargs.get("local_size") is not None:
        m = _bidirectional_window_form(mu, fn, kwargs)
        if m is not NotImplemented:
            return m
    pad = kwargs.get("attention_mask")
    kv_length = kwargs.get("kv_length")
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = kwargs["cache_position"].shape[0]
    plain = (not args and fn is getattr(mu, "bidirectional_mask_function", None)
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
    lay = None
    if isinstance(q_length, int) and q_length > 1 and not capturing(pad) and not _values_unreadable(pad):
        # (as _causal_form) the layout's content-cached copy: a compiled layer stack (regional compilation) gets the
        # same tensor every step with the same padding, so the kernels' tile index (cached on it) is built once, not
        # per step; eager layers take this layout (_last below) without reading the mask again
        lay = SparseLayout.key_padding(pad, seq_q=q_length, block_size=BLOCK)
        pad = lay.key_padding_mask
    m = pad[:, None, None, :].expand(kwargs["batch_size"], 1, q_length, kv_length)
    m._opsadv_form = MaskForm(False, pad, _block_mask(q_length, kv_length, pad))
    if lay is not None:
        _last = (m, _version(m), lay)             # what _padding_layout would build for this mask's calls
    return m


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
    if "transformers" not in sys.modules:         # nothing of it is loaded: cannot be one (and stay light)
        return False
    from transformers import PreTrainedModel
    return isinstance(model, PreTrainedModel)


# ---- the pass ------------------------------------------------------------------------------------------------
_PROJ_ATTRS = ("q_proj", "query", "c_attn", "qkv_proj", "query_key_value", "Wqkv", "q")


def _forward_code(m):
    """The code object of m's class forward under its decorators, or None."""
    fwd = getattr(type(m), "forward", None)
    if fwd is None:
        return None
    try:
        return getattr(inspect.unwrap(fwd), "__code__", None)
    except ValueError:
        return None


def _calls_attention_interface(m) -> bool:
    """m's class forward looks up transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS), as every attention
    class of the interface does (T5Attention, GPTNeoXAttention, LlamaAttention, ...)."""
    code = _forward_code(m)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def attention_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """The modules that call the attention function: by the interface lookup in their forward, else by
    structure (is_causal and a q / qkv projection)."""
    found = []
    for path, m in model.named_modules():
        if _calls_attention_interface(m) or (hasattr(m, "is_causal") and any(hasattr(m, a) for a in _PROJ_ATTRS)):
            found.append((path, m))
    return found


def _own_configs(model, undo) -> None:
    """Give `model` private copies of the configs its modules reference (the model's, its sub-configs', its
    sub-models'): set_attn_implementation writes the config, and transformers 5 shares one config object
    between models built from it (from_config keeps it), whose modules read `_attn_implementation` at call
    time.  Recorded as swaps, so reverting puts the original objects back (they are never written)."""
    from transformers import PretrainedConfig
    olds: dict[int, PretrainedConfig] = {}
    for m in model.modules():
        for val in vars(m).values():
            if isinstance(val, PretrainedConfig):
                olds.setdefault(id(val), val)
    if not olds:
        return
    originals = list(olds.values())
    copies = copy.deepcopy(originals)          # one deepcopy: configs shared between them stay shared
    pairs: dict[int, PretrainedConfig] = {}

    def pair(a, b):
        if id(a) in pairs:
            return
        pairs[id(a)] = b
        for name, val in vars(a).items():
            if isinstance(val, PretrainedConfig):
                pair(val, getattr(b, name))
    for a, b in zip(originals, copies):
        pair(a, b)
    for m in model.modules():
        for name, val in list(vars(m).items()):
            if isinstance(val, PretrainedConfig) and id(val) in pairs:
                undo.swap(m, name, pairs[id(val)])


def _set_attr(undo, obj, name, value) -> None:
    obj.__dict__[name] = value
    undo.instance_attrs.append((obj, name))


def attention_pass(model, report, undo, state) -> bool:
    """Point the model (and its sub-models) at the "opsadv" attention function, on configs of its own."""
    register()
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        report.add("skipped", "", f"{type(model).__name__} attention",
                   "the model does not use transformers' AttentionInterface")
        return False
    mods = attention_modules(model)
    before = model.config._attn_implementation
    originals = {}
    for path, m in mods:
        cfg = getattr(m, "config", None)
        impl = getattr(cfg, "_attn_implementation", None) or before
        originals[impl] = originals.get(impl, 0) + 1
        _set_attr(undo, m, "_opsadv_attn_before", impl)
        _set_attr(undo, m, "_opsadv_state", state)
    _own_configs(model, undo)
    causal_fixed = _decoder_self_attention_causal(model, mods, undo)
    model.set_attn_implementation(NAME)
    for path, m, impl in _keep_eager_masks(model, mods, undo):
        report.add("skipped", path, f"{type(m).__name__} attention",
                   f"its attention is coded in its own forward, not transformers' AttentionInterface; the masks it "
                   f"builds keep the {impl!r} form that code adds to its scores")
    for path, m in causal_fixed:
        report.add("replaced", path, f"{type(m).__name__} (decoder self-attention): is_causal False -> True",
                   "its original 'eager' implementation always materializes the causal mask; opsadv's mask function "
                   "skips a plain causal one (as sdpa's does) and the attention then reads is_causal")
    report.add("attention", "", f"{type(model).__name__}: attention implementation {before!r} -> 'opsadv' "
               f"(opsadv.flash_attention; generate(past_key_values=opsadv.PagedKVCache(model)): prefill and "
               f"decode -> paged_attention; causal + padded batches and padded encoders -> key-padding "
               f"sparse_attention; {len(mods)} layers{_window_note(mods)}; calls with dropout / softcapping / sinks, "
               f"which have no opsadv kernel, run the model's original attention "
               f"({_fallback_note(originals or [before])}))")
    return True


def _mask_builders() -> frozenset:
    from transformers import masking_utils as mu
    return frozenset(n for n in dir(mu) if n.startswith("create_") and "mask" in n)


def _keep_eager_masks(model, mods, undo) -> list:
    """Stacks that build their masks with masking_utils (which reads config._attn_implementation) but have no
    module calling the AttentionInterface below them (BigBird-Pegasus' encoder: eager-coded self-attention that
    adds the mask to its scores) get a private config with their original implementation, so the mask keeps the
    form their code expects (an additive float mask for eager, not opsadv's bool one).  [(path, module, impl)]."""
    from transformers import PretrainedConfig
    builders = _mask_builders()
    served = {id(m) for _, m in mods}
    kept = []
    for path, m in model.named_modules():
        cfg = vars(m).get("config")
        code = _forward_code(m)
        if (not isinstance(cfg, PretrainedConfig) or code is None or builders.isdisjoint(code.co_names)
                or any(id(sub) in served for sub in m.modules())):
            continue
        impl = getattr(m, "_opsadv_attn_before", None) or _original_impl(model)
        own = copy.deepcopy(cfg)
        own._attn_implementation = impl
        undo.swap(m, "config", own)
        kept.append((path, m, impl))
    return kept


def _original_impl(model) -> str:
    return next((getattr(m, "_opsadv_attn_before") for m in model.modules() if hasattr(m, "_opsadv_attn_before")),
                "eager")


def _decoder_self_attention_causal(model, mods, undo) -> list:
    """Decoder self-attention modules of an encoder-decoder whose original implementation is eager and that say
    is_causal=False (NLLB-MoE): causal only through eager's materialized mask.  Set to True (recorded for undo), as
    the skipped causal mask leaves the attention with the module's flag; [(path, module)] of those changed."""
    if not getattr(model.config, "is_encoder_decoder", False):
        return []
    fixed = []
    for path, m in mods:
        parts = path.split(".")
        if (getattr(m, "_opsadv_attn_before", None) == "eager" and getattr(m, "is_causal", None) is False
                and parts[-1] == "self_attn" and any("decoder" in p for p in parts[:-1])):
            undo.swap(m, "is_causal", True)       # (revert sets the module's own False back)
            fixed.append((path, m))
    return fixed


def _layer_window(m) -> int | None:
    """The sliding window a transformers attention module passes (its own attribute, else its config's)."""
    if "sliding_window" in vars(m) or hasattr(type(m), "sliding_window"):
        w = getattr(m, "sliding_window", None)
    else:
        w = getattr(getattr(m, "config", None), "sliding_window", None)
    return w if isinstance(w, int) and not isinstance(w, bool) else None


def _window_note(mods) -> str:
    windows = sorted({w for w in (_layer_window(m) for _, m in mods) if w is not None})
    if not windows:
        return ""
    n = sum(1 for _, m in mods if _layer_window(m) is not None)
    return (f"; {n} sliding-window layers (window {', '.join(map(str, windows))}) -> causal + window sparse_attention, "
            f"one-query decode without padding -> flash_attention over the window's keys; static caches, mask "
            f"overlays, packed sequences and symbolic lengths keep transformers' window mask (masked flash_attention, "
            f"counted in fallbacks)")


def _fallback_note(originals) -> str:
    parts = []
    for o in sorted(originals, key=str):
        if o == "sdpa":
            parts.append("'sdpa'; softcapping / sinks: the model's eager attention")
        elif o == "eager":
            parts.append("'eager'")
        else:
            parts.append(f"{o!r}: the model's eager attention, the masks here take another form")
    return "; ".join(parts)
