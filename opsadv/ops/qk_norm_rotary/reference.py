"""The qk_norm_rotary reference impl (the oracle): plain torch, float32 accumulation (float64 stays float64)."""
from __future__ import annotations

import torch

from opsadv.core.op_common import acc, stats_dtype

FEATURES = frozenset({"interleaved", "partial", "position_ids"})


def _tables(cos, sin, position_ids, cdt):
    c, s = cos.to(cdt), sin.to(cdt)
    if position_ids is not None:
        c, s = c[position_ids], s[position_ids]          # (S, R) or (1 or B, S, R)
    if c.dim() == 2:
        c, s = c[None], s[None]
    return c[:, None], s[:, None]                        # broadcast over heads


def rotate(x, cos, sin, position_ids, interleaved, backward):
    """x (in its compute dtype) rotated over its first R = cos.shape[-1] features; backward: by -angle."""
    r = cos.shape[-1]
    c, s = _tables(cos, sin, position_ids, x.dtype)
    xr, xp = x[..., :r], x[..., r:]
    if interleaved:
        x1, x2, c1, c2, s1, s2 = xr[..., 0::2], xr[..., 1::2], c[..., 0::2], c[..., 1::2], s[..., 0::2], s[..., 1::2]
    else:
        h = r // 2
        x1, x2, c1, c2, s1, s2 = xr[..., :h], xr[..., h:], c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    if backward:                                         # the transpose of the rotation
        s1, s2 = -s2, -s1
    y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    yr = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
    return torch.cat((yr, xp), -1)


def _rstd(ctx, xf, x, eps):
    s = xf.to(stats_dtype(ctx, x, "norm") or xf.dtype)   # norm="fp64": statistics in float64
    return torch.rsqrt((s * s).mean(-1, keepdim=True) + eps).to(xf.dtype)


def normed(ctx, x, weight, eps, offset):
    """rms_norm(x) * (offset + weight) in the compute dtype (float32; float64 stays float64)."""
    xf = acc(x)
    return xf * _rstd(ctx, xf, x, eps) * (offset + acc(weight))


def qk_norm_rotary_fwd(ctx, q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved):
    return tuple(rotate(normed(ctx, x, w, eps, weight_offset), cos, sin, position_ids, interleaved, False).to(x.dtype)
                 for x, w in ((q, q_weight), (k, k_weight)))


def _norm_bwd(ctx, g, x, weight, eps, offset, cos, sin, position_ids, interleaved):
    gn = rotate(acc(g), cos, sin, position_ids, interleaved, True)      # the gradient of the normed x
    xf = acc(x)
    rstd = _rstd(ctx, xf, x, eps)
    xhat = xf * rstd
    dxhat = gn * (offset + acc(weight))
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = (gn * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def qk_norm_rotary_bwd(ctx, gq, gk, q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids,
                       interleaved):
    dq, dqw = _norm_bwd(ctx, gq, q, q_weight, eps, weight_offset, cos, sin, position_ids, interleaved)
    dk, dkw = _norm_bwd(ctx, gk, k, k_weight, eps, weight_offset, cos, sin, position_ids, interleaved)
    return dq, dk, dqw, dkw
