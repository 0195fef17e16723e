"""The varlen_attention reference impl (the oracle): plain torch, float32 accumulation (float64 stays float64).

It walks the sequences on the host (cu_seqlens read once) and runs a plain softmax per segment; GQA by a
(kv head, group) view of q, no K / V copy per query head."""
from __future__ import annotations

import torch

from opsadv.core.op_common import acc, acc_dtype
from opsadv.ops.paged_attention.reference import attend

FEATURES = frozenset({"causal", "gqa"})


def varlen_fwd(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    cdt = acc_dtype(q)
    out = torch.zeros(q.shape, dtype=cdt, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        r0, n, k0, kv_len = cq[b], cq[b + 1] - cq[b], ck[b], ck[b + 1] - ck[b]
        if n == 0 or kv_len == 0:
            continue                                    # no keys: out 0, lse -inf
        kb, vb = acc(k[k0:k0 + kv_len]), acc(v[k0:k0 + kv_len])            # (L, Hkv, D)
        qb = acc(q[r0:r0 + n]).reshape(n, hkv, g, d)
        out[r0:r0 + n], lse[r0:r0 + n] = attend(qb, kb, vb, scale, causal)
    return out.to(q.dtype), lse
