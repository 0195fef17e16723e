"""Plain-torch kernels: the numerical oracle.  Half inputs compute in float32, float64 stays
float64; outputs come back in the input dtype.  Written for clarity, not speed."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from opsadv.core.activations import ACT, act_grad, swiglu_grad
from opsadv.core.layout import dense_mask


def _acc(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return t if t.dtype == torch.float64 else t.float()


def _lse_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ---- attention ---------------------------------------------------------------------------------
def _scores(q, k, attn_mask, causal, scale):
    """float scores with -inf where masked (bool mask False, causal, or additive -inf)."""
    rep = q.shape[1] // k.shape[1]
    kf = _acc(k).repeat_interleave(rep, dim=1)
    s = (_acc(q) @ kf.transpose(-1, -2)) * scale
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + _acc(attn_mask)
    return s


def _probs(s):
    lse = torch.logsumexp(s, dim=-1)
    # fully masked rows: lse = -inf, probabilities 0 (not NaN); a row with a +inf or NaN score gives out and lse NaN,
    # as SDPA (out) and the Triton kernels do (docs/conformance.md, "NaN and Inf")
    lse = lse.masked_fill(torch.isposinf(lse), float("nan"))
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None])
    p = p.masked_fill(empty[..., None], 0.0)
    return p, lse


def attention_fwd(ctx, q, k, v, attn_mask, causal, scale):
    s = _scores(q, k, attn_mask, causal, scale)
    p, lse = _probs(s)
    rep = q.shape[1] // k.shape[1]
    out = p @ _acc(v).repeat_interleave(rep, dim=1)
    return out.to(q.dtype), lse.to(_lse_dtype(q))


def attention_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    rep = q.shape[1] // k.shape[1]
    s = _scores(q, k, attn_mask, causal, scale)
    l = _acc(lse)
    empty = torch.isneginf(l)
    p = torch.exp(s - l.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    do, vf, kf = _acc(dout), _acc(v).repeat_interleave(rep, dim=1), _acc(k).repeat_interleave(rep, dim=1)
    dp = do @ vf.transpose(-1, -2)
    delta = (do * _acc(out)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ _acc(q)) * scale
    dv = p.transpose(-1, -2) @ do
    b, hkv = k.shape[0], k.shape[1]
    dk = dk.reshape(b, hkv, rep, *dk.shape[2:]).sum(2)   # GQA: sum over the query heads sharing a kv head
    dv = dv.reshape(b, hkv, rep, *dv.shape[2:]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- sparse attention (dense masking) ------------------------------------------------------------
def _sparse_mask(q, k, block_mask, kpm, cu, bs, causal, wl, wr, ng):
    window = (wl, wr) if wl >= 0 else None
    return dense_mask(q.shape[2], k.shape[2], bs, block_mask, causal, window, ng, kpm, cu, device=q.device)


def sparse_fwd(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks=False,
               max_seqlen=-1):
    mask = _sparse_mask(q, k, block_mask, kpm, cu, bs, causal, wl, wr, ng)
    return attention_fwd(ctx, q, k, v, mask, False, scale)


def sparse_bwd(ctx, dout, q, k, v, out, lse, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale,
               dense_blocks=False, max_seqlen=-1):
    mask = _sparse_mask(q, k, block_mask, kpm, cu, bs, causal, wl, wr, ng)
    return attention_bwd(ctx, dout, q, k, v, out, lse, mask, False, scale)


# ---- gemm ----------------------------------------------------------------------------------------
def gemm_fwd(ctx, a, b, bias, activation, residual, alpha):
    z = alpha * (_acc(a) @ _acc(b))
    if bias is not None:
        z = z + _acc(bias)
    y = ACT[activation](z)
    if residual is not None:
        y = y + _acc(residual)
    return y.to(a.dtype)


def gemm_bwd(ctx, grad, a, b, bias, activation, alpha):
    af, bf, g = _acc(a), _acc(b), _acc(grad)
    z = alpha * (af @ bf) + (_acc(bias) if bias is not None else 0)
    dz = g * act_grad(activation, z)
    k, n = b.shape
    a2, dz2 = af.reshape(-1, k), dz.reshape(-1, n)
    da = alpha * (dz @ bf.t())
    db = alpha * (a2.t() @ dz2)
    dbias = dz2.sum(0).to(bias.dtype) if bias is not None else a.new_empty((0,))
    return da.to(a.dtype), db.to(b.dtype), dbias


def swiglu_fwd(ctx, x, w, bias):
    gu = _acc(x) @ _acc(w) + (_acc(bias) if bias is not None else 0)
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g) * u).to(x.dtype)


def swiglu_bwd(ctx, grad, x, w, bias):
    xf, wf = _acc(x), _acc(w)
    dgu = swiglu_grad(_acc(grad), xf @ wf + (_acc(bias) if bias is not None else 0))
    k, n2 = w.shape
    dx = dgu @ wf.t()
    dw = xf.reshape(-1, k).t() @ dgu.reshape(-1, n2)
    dbias = dgu.reshape(-1, n2).sum(0).to(bias.dtype) if bias is not None else x.new_empty((0,))
    return dx.to(x.dtype), dw.to(w.dtype), dbias


def swiglu_act_fwd(ctx, gate_up):
    g, u = _acc(gate_up).chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)


def swiglu_act_bwd(ctx, grad, gate_up):
    return swiglu_grad(_acc(grad), _acc(gate_up)).to(gate_up.dtype)


# ---- norms ---------------------------------------------------------------------------------------
def layer_norm_fwd(ctx, x, weight, bias, eps, residual):
    s = _acc(x) + _acc(residual) if residual is not None else _acc(x)
    mean = s.mean(-1)
    var = ((s - mean[..., None]) ** 2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = (s - mean[..., None]) * rstd[..., None]
    if weight is not None:
        y = y * _acc(weight)
    if bias is not None:
        y = y + _acc(bias)
    xsum = s.to(x.dtype) if residual is not None else x.new_empty((0,))
    sd = _lse_dtype(x)
    return y.to(x.dtype), xsum, mean.to(sd), rstd.to(sd)


def layer_norm_bwd(ctx, dy, dsum, xin, weight, bias, mean, rstd):
    n = xin.shape[-1]
    xhat = (_acc(xin) - _acc(mean)[..., None]) * _acc(rstd)[..., None]
    g = _acc(dy)
    dxhat = g * _acc(weight) if weight is not None else g
    dx = _acc(rstd)[..., None] * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    if dsum.numel():
        dx = dx + _acc(dsum)
    dw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype) if weight is not None else xin.new_empty((0,))
    db = g.reshape(-1, n).sum(0).to(bias.dtype) if bias is not None else xin.new_empty((0,))
    return dx.to(xin.dtype), dw, db


def rms_norm_fwd(ctx, x, weight, eps, residual, offset):
    s = _acc(x) + _acc(residual) if residual is not None else _acc(x)
    rstd = torch.rsqrt((s * s).mean(-1) + eps)
    y = s * rstd[..., None]
    if weight is not None:
        y = y * (offset + _acc(weight))
    xsum = s.to(x.dtype) if residual is not None else x.new_empty((0,))
    return y.to(x.dtype), xsum, rstd.to(_lse_dtype(x))


def rms_norm_bwd(ctx, dy, dsum, xin, weight, rstd, offset):
    n = xin.shape[-1]
    r = _acc(rstd)[..., None]
    xhat = _acc(xin) * r
    g = _acc(dy)
    dxhat = g * (offset + _acc(weight)) if weight is not None else g
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    if dsum.numel():
        dx = dx + _acc(dsum)
    dw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype) if weight is not None else xin.new_empty((0,))
    return dx.to(xin.dtype), dw


# ---- rotary embedding --------------------------------------------------------------------------------------
def _rotate(x, cos, sin, position_ids, interleaved, backward):
    r = cos.shape[-1]
    c, s = _acc(cos), _acc(sin)
    if x.dtype == torch.float64:
        c, s = c.double(), s.double()
    if position_ids is not None:
        c, s = c[position_ids], s[position_ids]          # (S, R) or (1 or B, S, R)
    if c.dim() == 2:
        c, s = c[None], s[None]
    c, s = c[:, None], s[:, None]                        # broadcast over heads
    xf = _acc(x)
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
