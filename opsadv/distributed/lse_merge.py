"""Merging partial attention results by their log-sum-exp (the ring's combine step).

Two partial results over disjoint key sets, (o1, lse1) and (o2, lse2), combine exactly into
    lse = logaddexp(lse1, lse2),   o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse).
A row with no key in either (lse1 = lse2 = -inf) stays o = 0, lse = -inf: the exponent is taken against 0
there, never -inf - -inf (NaN)."""
from __future__ import annotations

import torch
from torch import Tensor


def merge_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """acc_out (b, h, s, d) and acc_lse (b, h, s), in the accumulation dtype, absorb the partial (out, lse) in place
    (acc_out / acc_lse may be views, e.g. the rows a ring step touched)."""
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    ref = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)     # rows still without a key: weights exp(-inf) = 0
    acc_out.mul_(torch.exp(acc_lse - ref).unsqueeze(-1))
    acc_out.add_(out.to(acc_out.dtype) * torch.exp(lse.to(acc_lse.dtype) - ref).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def empty_accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """(out 0, lse -inf) for q's rows: the state before any key was seen (float64 stays float64, else float32)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (torch.zeros(q.shape, dtype=dtype, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device))
