"""Padded encoders run on their real tokens only: the layer stack of a BERT-style encoder gets
(1, N, hidden) packed rows instead of (b, s, hidden), so every GEMM, norm and the attention
(varlen sparse_attention, one segment per sequence) skip the padding; the result is scattered
back to (b, s, hidden) with zeros at padded positions (transformers leaves unspecified values
there that heads do not read, except a question-answering head's span softmax over every position:
such models are not packed).

The encoder module keeps its class and parameters (state_dict unchanged): its instance gets a
forward wrapper (undone by `Undo.revert`).  Found by structure: a child ModuleList `layer` /
`layers` of an encoder-only transformers model whose attention goes through the "opsadv"
attention function and whose positions enter at the embeddings (absolute), i.e. the layers are
position-independent per token.

Row counts: eager calls pack exactly the real tokens (one host read of the mask, which the varlen
path needs anyway).  Under CUDA-graph capture nothing may be read back, so the graph runner
sets `static_rows` (the bucket of the real-token count it keyed the graph on) and the gather /
segment offsets are computed on the device for that many rows: the real tokens first, then
padding rows as extra segments of at most s rows each (a fixed count, trailing ones empty) that
the output never keeps, so every segment is <= s and the layout's max_seqlen = s holds without a
host read (FA2's varlen kernel needs that bound as a host int)."""
from __future__ import annotations

import contextvars
import inspect
from typing import NamedTuple

import torch
from torch import nn

from opsadv.ops.sparse_attention.layout import SparseLayout, capturing

from .masks import key_padding_of
from .modules import _exporting

# rows the packed stack has while a CUDA graph is captured (set by the graph runner's hint)
static_rows: contextvars.ContextVar[int | None] = contextvars.ContextVar("opsadv_static_rows", default=None)
BLOCK = 128                     # layout block size of the packed varlen layout


class Pack(NamedTuple):
    order: torch.Tensor         # int64 (N,): flat (b*s) position of each packed row, real tokens first
    valid: torch.Tensor         # bool (N, 1): row is a real token
    layout: SparseLayout        # varlen layout over the N rows (one segment per sequence, + fill)
    batch: int
    seq: int


def bucket_rows(n: int, total: int) -> int:
    """Packed row count a graph is captured for: n rounded up to 1/8 of its power of two (>= 256),
    so at most ~12% of the rows are filler and few graphs cover all batches."""
    if n <= 256:
        return min(256, total)
    step = max(256, 1 << (n.bit_length() - 4))
    return min(total, -(-n // step) * step)


def build_pack(kpm: torch.Tensor) -> Pack:
    """kpm: (b, s) bool key padding mask (True = real token), real tokens not necessarily leading."""
    b, s = kpm.shape
    flat = kpm.reshape(-1)
    rows = static_rows.get()                      # set by the graph runner (warm-up and capture)
    lens = kpm.sum(1, dtype=torch.int32)
    if rows is None and not capturing(kpm):
        seqlens = lens.tolist()                   # eager: exact rows (one host read)
        n = sum(seqlens)
        order = torch.nonzero(flat).squeeze(1)
        lay = SparseLayout.varlen(seqlens, block_size=BLOCK, device=kpm.device) if n else None
        valid = torch.ones(n, 1, dtype=torch.bool, device=kpm.device)
        return Pack(order, valid, lay, b, s)
    if rows is None:                              # captured without a row hint: every row, still exact
        rows = b * s
    # device-only: real tokens first (stable: batch-major, in sequence order), then padding rows
    order = torch.sort((~flat).to(torch.uint8), stable=True).indices[:rows]
    n_real = lens.sum()
    cu = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0, dtype=torch.int32), filler_offsets(n_real, rows, s)])
    valid = (torch.arange(rows, device=kpm.device) < n_real)[:, None]
    bm = _ones_block_mask(rows, kpm.device)
    lay = SparseLayout(rows, rows, BLOCK, bm, cu_seqlens=cu, dense_blocks=True, max_seqlen=min(s, rows))
    return Pack(order, valid, lay, b, s)


def filler_offsets(n_real: torch.Tensor, rows: int, s: int) -> torch.Tensor:
    """End offsets of the filler segments after n_real real rows (a device scalar): ceil(rows / s)
    segments of <= s rows (the filler is at most `rows` rows), empty ones at the end; computed on the
    device, no host copy.  The last offset is `rows`."""
    n_fill = -(-rows // s)
    steps = torch.arange(1, n_fill + 1, device=n_real.device, dtype=torch.int32) * s
    return torch.clamp(n_real.to(torch.int32) + steps, max=rows)


def _ones_block_mask(rows: int, device: torch.device) -> torch.Tensor:
    # the cached all-True block mask; the runner's eager warm-up (same rows) creates it outside capture
    return SparseLayout.dense(rows, block_size=BLOCK, device=device).block_mask


def packed_mask(pack: Pack, like: torch.Tensor) -> torch.Tensor:
    """The mask handed down the layer stack: a fresh view of the caller's mask (which stays
    untouched) carrying the pack; the attention function reads it with `pack_of`."""
    m = like.view(like.shape)
    m._opsadv_pack = pack
    return m


def pack_of(mask) -> Pack | None:
    return getattr(mask, "_opsadv_pack", None) if isinstance(mask, torch.Tensor) else None


class PackedEncoderForward:
    """The wrapper installed as `encoder.forward`."""

    def __init__(self, encoder: nn.Module, orig):
        self.encoder, self.orig = encoder, orig

    def __call__(self, hidden_states, attention_mask=None, *args, **kwargs):
        kpm = key_padding_of(attention_mask)
        # export / compile tracing: the row count depends on mask values, so the padded layers serve
        if (kpm is None or _exporting() or args or kwargs.get("encoder_hidden_states") is not None
                or kwargs.get("output_hidden_states") or kwargs.get("output_attentions")
                or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
                or (torch.is_grad_enabled() and hidden_states.requires_grad) or hidden_states.dim() != 3
                or tuple(hidden_states.shape[:2]) != tuple(kpm.shape)):
            return self.orig(hidden_states, attention_mask, *args, **kwargs)
        pack = build_pack(kpm)
        b, s, h = hidden_states.shape
        if pack.layout is None:                   # no real token at all: nothing to pack
            return self.orig(hidden_states, attention_mask, *args, **kwargs)
        x = hidden_states.reshape(b * s, h).index_select(0, pack.order)[None]
        out = self.orig(x, packed_mask(pack, attention_mask), *args, **kwargs)
        y = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        y = y[0].masked_fill(~pack.valid, 0)
        full = y.new_zeros(b * s, y.shape[-1]).index_copy_(0, pack.order, y).view(b, s, -1)
        if hasattr(out, "last_hidden_state"):
            out.last_hidden_state = full
            return out
        return (full, *out[1:])


def _layer_stack(m: nn.Module) -> nn.ModuleList | None:
    for name in ("layer", "layers"):
        c = getattr(m, name, None)
        if isinstance(c, nn.ModuleList) and len(c) > 0:
            return c
    return None


def candidate(model: nn.Module, encoder: nn.Module) -> str | None:
    """None when `encoder` can run packed, else why not."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "is_decoder", False) or getattr(cfg, "is_encoder_decoder", False):
        return "not an encoder-only model"
    if type(model).__name__.endswith("ForQuestionAnswering") or hasattr(model, "qa_outputs"):
        return ("its question-answering head reads every position: transformers' span loss takes a softmax over the "
                "whole sequence, padded positions included, so their outputs must stay the original's")
    if getattr(cfg, "_attn_implementation", None) != "opsadv":
        return "attention does not go through the opsadv attention function"
    pe = getattr(cfg, "position_embedding_type", "absolute")
    if pe not in (None, "absolute"):
        return f"position_embedding_type {pe!r} acts inside the layers"
    if any("rotary" in type(x).__name__.lower() for x in encoder.modules()):
        return "rotary position embeddings act inside the layers"
    try:
        params = list(inspect.signature(encoder.forward).parameters)
    except (TypeError, ValueError):
        return "forward signature unknown"
    if params[:2] != ["hidden_states", "attention_mask"]:
        return "forward does not take (hidden_states, attention_mask, ...)"
    return None


def packing_pass(model: nn.Module, report, undo) -> int:
    """Install the packed forward on the encoder layer stacks of an encoder-only transformers model."""
    n = 0
    for path, m in list(model.named_modules()):
        if m is model or _layer_stack(m) is None or isinstance(m.__dict__.get("forward"), PackedEncoderForward):
            continue
        why = candidate(model, m)
        if why is not None:
            if "encoder" in path.split(".")[-1]:
                report.add("skipped", path, f"{type(m).__name__} packing", why)
            continue
        m.forward = PackedEncoderForward(m, m.forward)
        undo.instance_attrs.append((m, "forward"))
        report.add("packed", path, f"{type(m).__name__}: padded batches run on their real tokens only "
                   "(layers get (1, tokens, hidden) rows, varlen attention; outputs at padded positions are 0)")
        n += 1
    return n


class _Rows:
    """Context the runner warms up and captures under: the packed stack has `rows` rows."""

    def __init__(self, rows: int):
        self.rows = rows

    def __enter__(self):
        self.token = static_rows.set(self.rows)

    def __exit__(self, *exc):
        static_rows.reset(self.token)


def graph_hint(model: nn.Module):
    """The CUDA-graph runner's hint for a packed model: key padded batches on the bucket of their
    real-token count (one host read of the 2-D attention mask per call), so a graph captured for
    `rows` packed rows only ever replays batches with at most that many real tokens."""
    names = [n for n in inspect.signature(model.forward).parameters]
    pos = names.index("attention_mask") if "attention_mask" in names else None

    def hint(args, kwargs):
        am = kwargs.get("attention_mask")
        if am is None and pos is not None and len(args) > pos:
            am = args[pos]
        if not isinstance(am, torch.Tensor) or am.dim() != 2:
            return None, None
        rows = bucket_rows(int(am.count_nonzero()), am.numel())
        return rows, _Rows(rows)

    return hint
