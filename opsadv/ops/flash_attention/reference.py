"""The flash_attention reference impl (the oracle): plain torch, float32 accumulation (float64 stays float64)."""
from __future__ import annotations

import torch

from opsadv.core.op_common import acc, acc_dtype, operand, probs_from_lse, softmax_lse, stats_dtype

FEATURES = frozenset({"causal", "gqa", "cross_length", "attn_mask_bool", "attn_mask_float"})


# ---- attention ---------------------------------------------------------------------------------
def _scores(q, k, attn_mask, causal, scale, ctx=None):
    """float scores with -inf where masked (bool mask False, causal, or additive -inf)."""
    rep = q.shape[1] // k.shape[1]
    kf = operand(ctx, k, "attention").repeat_interleave(rep, dim=1)
    s = (operand(ctx, q, "attention") @ kf.transpose(-1, -2)) * scale
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + acc(attn_mask)
    return s


def _probs(s, stats: torch.dtype | None = None):
    """Probabilities and row logsumexp; `stats` (softmax="bf16"): row max, sum and probabilities in that dtype.
    Fully masked rows: lse -inf, probabilities 0 (not NaN); a row with a +inf or NaN score gives out and lse NaN, as
    SDPA (out) and the Triton kernels do (docs/conformance.md, "NaN and Inf")."""
    acc_t = s.dtype
    p, lse = softmax_lse(s if stats is None else s.to(stats))
    return p.to(acc_t), lse.to(acc_t)


def attention_fwd(ctx, q, k, v, attn_mask, causal, scale):
    s = _scores(q, k, attn_mask, causal, scale, ctx)
    p, lse = _probs(s, stats_dtype(ctx, q, "softmax"))
    rep = q.shape[1] // k.shape[1]
    pv = operand(ctx, p, "attention") if q.dtype == torch.float32 else p    # tensor cores read P as they read V
    out = pv @ operand(ctx, v, "attention").repeat_interleave(rep, dim=1)
    return out.to(q.dtype), lse.to(acc_dtype(q))


def attention_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    rep = q.shape[1] // k.shape[1]
    s = _scores(q, k, attn_mask, causal, scale, ctx)
    p = probs_from_lse(s, acc(lse))
    do, vf, kf = acc(dout), acc(v).repeat_interleave(rep, dim=1), acc(k).repeat_interleave(rep, dim=1)
    dp = do @ vf.transpose(-1, -2)
    delta = (do * acc(out)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ acc(q)) * scale
    dv = p.transpose(-1, -2) @ do
    b, hkv = k.shape[0], k.shape[1]
    dk = dk.reshape(b, hkv, rep, *dk.shape[2:]).sum(2)   # GQA: sum over the query heads sharing a kv head
    dv = dv.reshape(b, hkv, rep, *dv.shape[2:]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
