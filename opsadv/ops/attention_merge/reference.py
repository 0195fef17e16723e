"""The attention_merge_ reference impl (the oracle): plain torch in the accumulators' dtype (float32, or float64)."""
from __future__ import annotations

import torch

FEATURES: frozenset[str] = frozenset()


def merge_fwd(ctx, acc_out, acc_lse, out, lse) -> None:
    """acc_out (b, h, s, d) and acc_lse (b, h, s) absorb the partial (out, lse) in place:
        new = logaddexp(acc_lse, lse),  acc_out = acc_out * exp(acc_lse - new) + out * exp(lse - new).
    Rows still without a key (new = -inf) take the exponents against 0: weights exp(-inf) = 0, never NaN."""
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    ref = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    acc_out.mul_(torch.exp(acc_lse - ref).unsqueeze(-1))
    acc_out.add_(out.to(acc_out.dtype) * torch.exp(lse.to(acc_lse.dtype) - ref).unsqueeze(-1))
    acc_lse.copy_(new_lse)
