"""The rotary_embedding reference impl (the oracle): plain torch, float32 accumulation (float64 stays float64)."""
from __future__ import annotations

import torch

from opsadv.core.op_common import acc

FEATURES = frozenset({"interleaved", "partial", "position_ids"})


# ---- rotary embedding --------------------------------------------------------------------------------------
def _rotate(x, cos, sin, position_ids, interleaved, backward):
    r = cos.shape[-1]
    c, s = acc(cos), acc(sin)
    if x.dtype == torch.float64:
        c, s = c.double(), s.double()
    if position_ids is not None:
        c, s = c[position_ids], s[position_ids]          # (S, R) or (1 or B, S, R)
    if c.dim() == 2:
        c, s = c[None], s[None]
    c, s = c[:, None], s[:, None]                        # broadcast over heads
    xf = acc(x)
    xr, xp = xf[..., :r], xf[..., r:]
    if interleaved:
        x1, x2, c1, c2, s1, s2 = xr[..., 0::2], xr[..., 1::2], c[..., 0::2], c[..., 1::2], s[..., 0::2], s[..., 1::2]
    else:
        h = r // 2
        x1, x2, c1, c2, s1, s2 = xr[..., :h], xr[..., h:], c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    if backward:                                         # the transpose of the rotation: by -angle
        s1, s2 = -s2, -s1
    y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    yr = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
    return torch.cat((yr, xp), -1).to(x.dtype)


def rotary_fwd(ctx, q, k, cos, sin, position_ids, interleaved):
    return (_rotate(q, cos, sin, position_ids, interleaved, False),
            _rotate(k, cos, sin, position_ids, interleaved, False))


def rotary_bwd(ctx, gq, gk, cos, sin, position_ids, interleaved):
    return (_rotate(gq, cos, sin, position_ids, interleaved, True),
            _rotate(gk, cos, sin, position_ids, interleaved, True))
