"""Merging partial attention results by their log-sum-exp (the ring's combine step).

Two partial results over disjoint key sets, (o1, lse1) and (o2, lse2), combine exactly into
    lse = logaddexp(lse1, lse2),   o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse).
A row with no key in either (lse1 = lse2 = -inf) stays o = 0, lse = -inf: the exponent is taken against 0
there, never -inf - -inf (NaN).  The merge itself is the op opsadv.ops.attention_merge_ (ops/attention_merge)."""
from __future__ import annotations

import torch
from torch import Tensor

from opsadv.ops.attention_merge import attention_merge_


def merge_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """acc_out (b, h, s, d) and acc_lse (b, h, s), in the accumulation dtype, absorb the partial (out, lse) in place
    (acc_out / acc_lse may be views, e.g. the rows a ring step touched): the op attention_merge_, one Triton kernel
    on the cuda backend for float32 accumulators (float64 ones take the reference impl, the torch formula)."""
    attention_merge_(acc_out, acc_lse, out, lse)


def empty_accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """(out 0, lse -inf) for q's rows: the state before any key was seen (float64 stays float64, else float32)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (torch.zeros(q.shape, dtype=dtype, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device))
