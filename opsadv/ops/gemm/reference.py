"""The gemm and swiglu_gemm reference impls (the oracle): plain torch, float32 accumulation (float64 stays float64)."""
from __future__ import annotations

import torch.nn.functional as F

from opsadv.core.activations import ACT, act_grad, swiglu_grad
from opsadv.core.op_common import acc, operand, weight_grad

FEATURES = frozenset({"bias", "residual", "alpha", "batched", "act_relu", "act_gelu", "act_gelu_tanh", "act_silu"})
SWIGLU_FEATURES = frozenset({"bias", "batched"})


# ---- gemm ----------------------------------------------------------------------------------------
def gemm_fwd(ctx, a, b, bias, activation, residual, alpha):
    z = alpha * (operand(ctx, a, "matmul") @ operand(ctx, b, "matmul"))
    if bias is not None:
        z = z + acc(bias)
    y = ACT[activation](z)
    if residual is not None:
        y = y + acc(residual)
    return y.to(a.dtype)


def gemm_bwd(ctx, grad, a, b, bias, activation, alpha):
    af, bf, g = operand(ctx, a, "matmul"), operand(ctx, b, "matmul"), acc(grad)
    z = alpha * (af @ bf) + (acc(bias) if bias is not None else 0)
    dz = g * act_grad(activation, z)
    k, n = b.shape
    a2, dz2 = af.reshape(-1, k), dz.reshape(-1, n)
    da = alpha * (dz @ bf.t())
    db = alpha * weight_grad(a2, dz2, bf)
    dbias = dz2.sum(0).to(bias.dtype) if bias is not None else a.new_empty((0,))
    return da.to(a.dtype), db.to(b.dtype), dbias


def swiglu_fwd(ctx, x, w, bias):
    gu = operand(ctx, x, "matmul") @ operand(ctx, w, "matmul") + (acc(bias) if bias is not None else 0)
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g) * u).to(x.dtype)


def swiglu_bwd(ctx, grad, x, w, bias):
    xf, wf = operand(ctx, x, "matmul"), operand(ctx, w, "matmul")
    dgu = swiglu_grad(acc(grad), xf @ wf + (acc(bias) if bias is not None else 0))
    k, n2 = w.shape
    dx = dgu @ wf.t()
    dw = weight_grad(xf.reshape(-1, k), dgu.reshape(-1, n2), wf)
    dbias = dgu.reshape(-1, n2).sum(0).to(bias.dtype) if bias is not None else x.new_empty((0,))
    return dx.to(x.dtype), dw.to(w.dtype), dbias
