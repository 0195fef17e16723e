"""Conformance cases of attention_merge_ (odd shapes, rows without keys, strided accumulators).  No demo: the op
writes its accumulators in place, and `opsadv demo` calls each op twice on the same inputs.

A case's accumulators are float32 (float64 in the float64 cells) whatever the cell's dtype: they are the state's
storage format, so they and lse are `kept` (never cast to the compared dtype), and the cell's dtype is out's, the
partial result flash_attention returns.  The kit hands every call fresh copies of the accumulators (`mutates`)."""
from __future__ import annotations

import torch

from opsadv.core.opdef import Case, rand

KEPT = frozenset({0, 1, 3})          # acc_out, acc_lse, lse: storage formats; out takes the cell's dtype
MUTATES = (0, 1)                     # acc_out, acc_lse are written in place
LOG_OUTPUTS = frozenset({1})         # the merged lse (output 1): its float32 error is absolute


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_inputs(dtype, device, g, b, h, s, d, *, empty_rows=False, row_slice=None, bshd_out=False,
                 bshd_acc=False):
    """(acc_out, acc_lse, out, lse) of a merge: random partial results with lse in [-6, 6].
    empty_rows: row 0 of acc_lse, row 1 of lse and row 2 of both are -inf (no key on that side yet).
    row_slice=(pad, total): the accumulators are rows pad:pad+s of (b, h, total, d) / (b, h, total) buffers
    (the ring's step over a slice of the rows).  bshd_out / bshd_acc: out / the accumulators stored as
    (b, s, h, d) and viewed as (b, h, s, d) (the Triton attention kernels' out layout).  Used by the tests too."""
    adt = acc_dtype(dtype)
    if row_slice is not None:
        pad, total = row_slice
        acc_out = rand((b, h, total, d), adt, device, g)[:, :, pad:pad + s]
        acc_lse = (rand((b, h, total), adt, device, g) * 2)[:, :, pad:pad + s]
    elif bshd_acc:
        acc_out = rand((b, s, h, d), adt, device, g).transpose(1, 2)
        acc_lse = (rand((b, s, h), adt, device, g) * 2).transpose(1, 2)
    else:
        acc_out = rand((b, h, s, d), adt, device, g)
        acc_lse = rand((b, h, s), adt, device, g) * 2
    out = rand((b, s, h, d), dtype, device, g).transpose(1, 2) if bshd_out else rand((b, h, s, d), dtype, device, g)
    lse = rand((b, h, s), adt, device, g) * 2
    if empty_rows:
        ninf = float("-inf")
        acc_lse[:, :, 0] = ninf
        acc_lse[:, :, 2] = ninf
        lse[:, :, 1:3] = ninf
    return acc_out, acc_lse, out, lse


def _merge(b, h, s, d, **kw):
    def build(dtype, device, g):
        return merge_inputs(dtype, device, g, b, h, s, d, **kw), {}
    return build


def _case(name, build, quick=True):
    return Case("attention_merge_", name, build, (), quick=quick, kept=KEPT, mutates=MUTATES,
                log_outputs=LOG_OUTPUTS)


CASES = [
    _case("one_row", _merge(1, 1, 1, 64)),
    _case("odd_d80", _merge(2, 3, 127, 80)),
    _case("rows_without_keys", _merge(1, 2, 3, 128, empty_rows=True)),
    _case("row_slice_bshd_out", _merge(1, 2, 37, 64, row_slice=(5, 50), bshd_out=True, empty_rows=True)),
    _case("d256_two_tiles", _merge(1, 2, 5, 256), quick=False),
    _case("bshd_accumulators", _merge(2, 3, 17, 128, bshd_acc=True, bshd_out=True), quick=False),
]
