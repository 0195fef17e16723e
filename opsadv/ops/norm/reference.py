"""The layer_norm and rms_norm reference impls (the oracle): plain torch, float32 accumulation (float64 stays
float64)."""
from __future__ import annotations

import torch

from opsadv.core.op_common import acc, acc_dtype, stats_dtype

FEATURES = frozenset({"weight", "bias", "residual", "offset"})


# ---- norms ---------------------------------------------------------------------------------------
def layer_norm_fwd(ctx, x, weight, bias, eps, residual):
    s = acc(x) + acc(residual) if residual is not None else acc(x)
    xsum = s.to(x.dtype) if residual is not None else x.new_empty((0,))
    s = s.to(stats_dtype(ctx, x, "norm") or s.dtype)        # norm="fp64": statistics in float64
    mean = s.mean(-1)
    var = ((s - mean[..., None]) ** 2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = (s - mean[..., None]) * rstd[..., None]
    if weight is not None:
        y = y * acc(weight)
    if bias is not None:
        y = y + acc(bias)
    sd = acc_dtype(x)
    return y.to(x.dtype), xsum, mean.to(sd), rstd.to(sd)


def layer_norm_bwd(ctx, dy, dsum, xin, weight, bias, mean, rstd):
    n = xin.shape[-1]
    xhat = (acc(xin) - acc(mean)[..., None]) * acc(rstd)[..., None]
    g = acc(dy)
    dxhat = g * acc(weight) if weight is not None else g
    dx = acc(rstd)[..., None] * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    if dsum.numel():
        dx = dx + acc(dsum)
    dw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype) if weight is not None else xin.new_empty((0,))
    db = g.reshape(-1, n).sum(0).to(bias.dtype) if bias is not None else xin.new_empty((0,))
    return dx.to(xin.dtype), dw, db


def rms_norm_fwd(ctx, x, weight, eps, residual, offset):
    s = acc(x) + acc(residual) if residual is not None else acc(x)
    xsum = s.to(x.dtype) if residual is not None else x.new_empty((0,))
    s = s.to(stats_dtype(ctx, x, "norm") or s.dtype)        # norm="fp64": statistics in float64
    rstd = torch.rsqrt((s * s).mean(-1) + eps)
    y = s * rstd[..., None]
    if weight is not None:
        y = y * (offset + acc(weight))
    return y.to(x.dtype), xsum, rstd.to(acc_dtype(x))


def rms_norm_bwd(ctx, dy, dsum, xin, weight, rstd, offset):
    n = xin.shape[-1]
    r = acc(rstd)[..., None]
    xhat = acc(xin) * r
    g = acc(dy)
    dxhat = g * (offset + acc(weight)) if weight is not None else g
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    if dsum.numel():
        dx = dx + acc(dsum)
    dw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype) if weight is not None else xin.new_empty((0,))
    return dx.to(xin.dtype), dw
