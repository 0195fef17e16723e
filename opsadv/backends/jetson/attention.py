"""jetson.chunked_math_attention: attention in plain torch over query chunks, so the score
matrix never exceeds the workspace cap (s_q x s_k is never materialized at once).  It serves
what the Triton kernel cannot (Xavier's cc 7.2, head dims outside its list, masks) without
the memory blow-up of an unchunked math fallback.  GQA by broadcasting (K/V never repeated);
float32 accumulation (float64 stays float64).  Forward and backward."""
from __future__ import annotations

import torch

from opsadv.core.op_common import probs_from_lse, softmax_lse

from .chunking import chunked_attention_bwd, chunked_attention_fwd

BYTES_PER_SCORE = 16     # float32 scores, probabilities and (backward) dP, dS per query row x key


def _acc(t):
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _scores(q, k, attn_mask, causal, scale):
    """float scores (b, h_kv, group, s_q, s_k) with -inf where masked; causal bottom-right."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    qf = _acc(q).view(b, hkv, hq // hkv, sq, d)
    s = (qf @ _acc(k).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    if attn_mask is not None:
        m = attn_mask.expand(b, hq, sq, sk).reshape(b, hkv, hq // hkv, sq, sk)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + _acc(m)
    return s


def _fwd(ctx, q, k, v, attn_mask, causal, scale):
    b, hq, sq, d = q.shape
    s = _scores(q, k, attn_mask, causal, scale)
    p, lse = softmax_lse(s)
    out = p @ _acc(v).unsqueeze(2)
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def _bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = _scores(q, k, attn_mask, causal, scale)
    p = probs_from_lse(s, _acc(lse).view(b, hkv, g, sq))
    do = _acc(dout).reshape(b, hkv, g, sq, d)
    dv = (p.transpose(-1, -2) @ do).sum(2)
    dp = do @ _acc(v).unsqueeze(2).transpose(-1, -2)
    delta = (do * _acc(out).reshape(b, hkv, g, sq, d)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ _acc(k).unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ _acc(q).view(b, hkv, g, sq, d)).sum(2) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def fwd(ctx, q, k, v, attn_mask, causal, scale):
    return chunked_attention_fwd(_fwd, BYTES_PER_SCORE, ctx, q, k, v, attn_mask, causal, scale)


def bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    return chunked_attention_bwd(_bwd, BYTES_PER_SCORE, ctx, dout, q, k, v, out, lse, attn_mask, causal, scale)
