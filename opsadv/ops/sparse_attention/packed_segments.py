"""Packed sequences inside a compiled graph: the varlen segments of transformers' packed causal mask (for
convert/hf_attention.py), derived from the mask's values on the device (an opaque op: dynamo traces no host read).

Without a cache and without an attention mask, transformers builds a decoder's mask from the position ids: causal
within each run of positions that step by 1 (a new sequence wherever they do not).  In eager calls the mask
function's closure names the sequence ids (convert/hf_attention.py's _packed_sequences); while dynamo traces, the
closure holds a traced tensor it cannot read, and transformers then builds that packed form for *every* batch
without a cache (it cannot check on the host whether the rows are packed), so `use_cache=False` training under
torch.compile would otherwise take the dense masked kernel on every layer.

`packed_segments(mask, left)` reads the segments off the materialized (b, 1, s, s) bool mask: a sequence starts at
row 0 of each batch row and wherever query i may not see key i - 1.  It returns FlashAttention-style cu_seqlens of
fixed size b * s + 1 over the batch rows laid end to end (trailing segments empty), so the graph's shapes do not
depend on the data and each segment is at most s long.  Outside CUDA-graph capture it also checks that the mask is
exactly causal within those segments (and within the window of `left` keys before each query, when left >= 0), so a
mask of another form (an overlay the traced mask function added) is refused with an error rather than computed as
the wrong pattern."""
from __future__ import annotations

import torch
from torch import Tensor

from opsadv.core.errors import InvalidArgumentError
from opsadv.core.sparse_tiles import capturing

OP = "packed_segments"


def _segments(mask: Tensor, left: int) -> tuple[Tensor, Tensor]:
    """(boundary (b, s) bool: a sequence starts here, start (b, s) int64: the row's sequence start)."""
    b, _, s, _ = mask.shape
    m = mask[:, 0]
    boundary = torch.ones(b, s, dtype=torch.bool, device=mask.device)
    if s > 1:
        boundary[:, 1:] = ~torch.diagonal(m, offset=-1, dim1=-2, dim2=-1)
    idx = torch.arange(s, device=mask.device)
    start = torch.cummax(torch.where(boundary, idx, 0), dim=-1).values
    return boundary, start


def _expected_rows(start: Tensor, rows: slice, s: int, left: int) -> Tensor:
    """Rows `rows` of the (b, s, s) mask of causal attention within the segments (and the window)."""
    i = torch.arange(s, device=start.device)[rows, None]
    j = torch.arange(s, device=start.device)[None, :]
    ok = (j <= i) & (j >= start[:, rows, None])
    if left >= 0:
        ok = ok & (j >= i - left)
    return ok


def expected_mask(mask: Tensor, left: int) -> Tensor:
    """The (b, 1, s, s) mask of causal attention within the segments `mask` implies (and the window)."""
    _, start = _segments(mask, left)
    return _expected_rows(start, slice(None), mask.shape[-1], left)[:, None]


def _matches(mask: Tensor, start: Tensor, left: int, rows_per_step: int = 1024) -> bool:
    """mask equals the expected one, compared a block of rows at a time (a long row's s x s temporaries), with one
    host read at the end (a read per block stalled a compiled step's launches once per 1024 rows)."""
    s = mask.shape[-1]
    same = torch.ones((), dtype=torch.bool, device=mask.device)
    for r in range(0, s, rows_per_step):
        same &= torch.eq(mask[:, 0, r:r + rows_per_step], _expected_rows(start, slice(r, r + rows_per_step), s,
                                                                          left)).all()
    return bool(same)


@torch.library.custom_op("opsadv::packed_segments", mutates_args=())
def _packed_segments(mask: Tensor, left: int) -> Tensor:
    b, _, s, _ = mask.shape
    boundary, start = _segments(mask, left)
    if not capturing(mask) and not _matches(mask, start, left):
        raise InvalidArgumentError(
            OP, "mask", "transformers' packed causal mask (causal within runs of position ids that step by 1"
            + (f", within a window of {left + 1} keys)" if left >= 0 else ")"),
            "another pattern: its mask function added an overlay this compiled form cannot take; call the model "
            "with an attention_mask (or without torch.compile)")
    n = b * s
    pos = torch.arange(n, device=mask.device)
    starts = torch.sort(torch.where(boundary.reshape(-1), pos, n)).values
    return torch.cat([starts, pos.new_full((1,), n)]).to(torch.int32)


@_packed_segments.register_fake
def _(mask, left):
    return mask.new_empty(mask.shape[0] * mask.shape[-1] + 1, dtype=torch.int32)


def packed_segments(mask: Tensor, left: int | None = None) -> Tensor:
    """cu_seqlens (b * s + 1,) int32 of a packed causal bool mask (b, 1, s, s) (module docstring); left: the
    window's left reach in keys (transformers' sliding_window - 1), None without a window."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 \
            or mask.shape[2] != mask.shape[3]:
        raise InvalidArgumentError(OP, "mask", "a bool tensor (b, 1, s, s)",
                                   f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
    return torch.ops.opsadv.packed_segments(mask, -1 if left is None else int(left))
