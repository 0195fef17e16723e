"""The paged_attention reference impl (the oracle): plain torch, float32 accumulation (float64 stays float64).

It walks the sequences on the host (seqlens_k and cu_seqlens_q read once), gathers each sequence's pages through
its block-table row into contiguous K / V, and runs a plain softmax; GQA by a (kv head, group) view of q, no K / V
copy per query head.  k_new / v_new are first written into the cache pages in place (append_kv).

An fp8 (float8_e4m3fn) cache holds fp8 * scale per kv head: the gathered pages are dequantized in the compute dtype,
and appended rows are quantized by quantize_kv, the rule the Triton append kernel follows bit for bit."""
from __future__ import annotations

import torch

from opsadv.core.op_common import acc, acc_dtype

FEATURES = frozenset({"causal", "gqa", "varlen", "append", "fp8_kv"})
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                     # the largest finite float8_e4m3fn


def quantize_kv(x, scale):
    """x (..., Hkv, D) (any float dtype) as a float8_e4m3fn cache with per-kv-head scales (Hkv,) (or one scalar):
    clamp(float32(x) / scale, -448, 448) rounded to nearest even.  NaN stays NaN.  fp8 * scale gives x back within
    a relative 2^-4 per element (3 mantissa bits) where |x| / scale >= 2^-6 (e4m3's smallest normal; below it
    the error is at most 2^-10 * scale absolute), up to float32's rounding of x / scale, and clamped at
    448 * scale."""
    s = scale.to(torch.float32).reshape(-1, 1)
    # fp16 / bf16 / fp32 x: the division promotes to float32 itself (one temporary the size of x in float32)
    y = (x.to(torch.float32) if x.dtype == torch.float64 else x) / s
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def kv_scales(x, dim: int = -2):
    """Per-head scales for quantize_kv: amax(|x|) over every dim but `dim` (the kv-head dim of x, default -2 of
    (..., Hkv, D)) / 448, float32 (Hkv,); non-finite values are ignored, and a head of zeros gets scale 1."""
    x = x.detach()
    dim = dim % x.dim()
    if x.numel() == 0:
        return torch.ones(x.shape[dim], dtype=torch.float32, device=x.device)
    a = torch.where(x.isfinite(), x.abs(), 0)               # in x's dtype: amax is exact there
    amax = a.amax(dim=tuple(i for i in range(x.dim()) if i != dim)).to(torch.float32)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def dequantize_kv(c, scale, dtype):
    """A cache's values in dtype: c itself (bf16 / fp16 / fp32 / fp64 cache), or fp8 * scale per kv head (dim -2)."""
    if c.dtype != FP8:
        return c.to(dtype)
    return c.to(dtype) * scale.to(dtype).reshape(-1, 1)


def segments(q, block_table, cu_seqlens_q) -> list[tuple[int, int]]:
    """(first query row, query count) of each sequence in q's rows (q packed as (total_q, Hq, D))."""
    b = block_table.shape[0]
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.tolist()
        return [(cu[i], cu[i + 1] - cu[i]) for i in range(b)]
    s = q.shape[1]
    return [(i * s, s) for i in range(b)]


def append_kv(k_cache, v_cache, block_table, seqlens_k, segs, k_new, v_new, k_scale=None, v_scale=None) -> None:
    """k_new / v_new rows of sequence b (packed like q) written in place at cache positions
    seqlens_k[b] - n_b .. seqlens_k[b] - 1 (seqlens_k counts the tokens after appending); quantized (quantize_kv)
    into an fp8 cache."""
    ps = k_cache.shape[1]
    kn, vn = k_new.reshape(-1, *k_new.shape[-2:]), v_new.reshape(-1, *v_new.shape[-2:])
    if k_cache.dtype == FP8:
        kn, vn = quantize_kv(kn, k_scale), quantize_kv(vn, v_scale)
    lens = seqlens_k.tolist()
    for b, (r0, n) in enumerate(segs):
        if n == 0:
            continue
        pos = torch.arange(lens[b] - n, lens[b], device=k_cache.device)
        page = block_table[b].to(device=k_cache.device, dtype=torch.long)[pos // ps]
        k_cache[page, pos % ps] = kn[r0:r0 + n].to(k_cache.dtype)
        v_cache[page, pos % ps] = vn[r0:r0 + n].to(v_cache.dtype)



def attend(qb, k, v, scale, causal):
    """One sequence's attention: qb (n, Hkv, G, D) against k / v (L, Hkv, D), causal bottom-right (query i sees
    keys j <= L - n + i) -> (out (n, Hq, D), lse (n, Hq)); a row with no key gives 0 and -inf."""
    n, hkv, g, d = qb.shape
    kv_len = k.shape[0]
    s = torch.einsum("nkgd,lkd->kgnl", qb, k) * scale           # (Hkv, G, n, L)
    if causal:
        i = torch.arange(n, device=qb.device)[:, None]
        j = torch.arange(kv_len, device=qb.device)[None, :]
        s = s.masked_fill(j > i + (kv_len - n), float("-inf"))
    m = torch.logsumexp(s, -1)                                  # (Hkv, G, n)
    m = m.masked_fill(torch.isposinf(m), float("nan"))         # a +inf score: out and lse NaN (as flash)
    empty = torch.isneginf(m)
    p = torch.exp(s - m.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    o = torch.einsum("kgnl,lkd->nkgd", p, v.to(p.dtype))
    return o.reshape(n, hkv * g, d), m.permute(2, 0, 1).reshape(n, hkv * g)

def paged_fwd(ctx, q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal, scale,
              k_scale=None, v_scale=None):
    segs = segments(q, block_table, cu_seqlens_q)
    if k_new is not None:
        append_kv(k_cache, v_cache, block_table, seqlens_k, segs, k_new, v_new, k_scale, v_scale)
    hq, d = q.shape[-2:]
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    qr = q.reshape(-1, hq, d)
    cdt = acc_dtype(q)
    out = torch.zeros(qr.shape, dtype=cdt, device=q.device)
    lse = torch.full(qr.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
    lens = seqlens_k.tolist()
    for b, (r0, n) in enumerate(segs):
        kv_len = lens[b]
        if n == 0 or kv_len == 0:
            continue                                    # no keys: out 0, lse -inf
        pages = block_table[b, : -(-kv_len // ps)].to(device=k_cache.device, dtype=torch.long)
        k = dequantize_kv(k_cache[pages].reshape(-1, hkv, d)[:kv_len], k_scale, cdt)        # (L, Hkv, D)
        v = dequantize_kv(v_cache[pages].reshape(-1, hkv, d)[:kv_len], v_scale, cdt)
        qb = acc(qr[r0:r0 + n]).reshape(n, hkv, g, d)
        out[r0:r0 + n], lse[r0:r0 + n] = attend(qb, k, v, scale, causal)
    return out.to(q.dtype).reshape(q.shape), lse.reshape(q.shape[:-1])
