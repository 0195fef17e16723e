"""Conformance cases of varlen_attention (segments of odd and empty lengths, queries past their keys, GQA / MQA,
q and K / V as strided views of packed projections) and the inputs `opsadv demo` runs."""
from __future__ import annotations

import torch

from opsadv.core.opdef import Case, rand


def varlen_inputs(dtype, device, g, *, hq, hkv, d, q_lens, k_lens, packed=False):
    """(args, kwargs) of a varlen_attention call: sequence b has q_lens[b] queries and k_lens[b] keys.  packed:
    q, k and v are views of one (total, Hq + 2 Hkv, D) qkv projection (total = max(total_q, total_k) rows; q takes
    the first total_q, k / v the first total_k), so every one is strided.  Used by the tests too."""
    cu_q = torch.tensor([0] + list(q_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(k_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    if packed:
        qkv = rand((max(tq, tk), hq + 2 * hkv, d), dtype, device, g)
        q, k, v = qkv[:tq, :hq], qkv[:tk, hq:hq + hkv], qkv[:tk, hq + hkv:]
    else:
        q, k, v = (rand((t, h, d), dtype, device, g) for t, h in ((tq, hq), (tk, hkv), (tk, hkv)))
    return (q, k, v, cu_q.to(device), cu_k.to(device)), {}


def _case(causal=True, lse=False, **shape):
    def build(dtype, device, g):
        args, kw = varlen_inputs(dtype, device, g, **shape)
        kw.update(causal=causal, return_lse=lse)
        return args, kw
    return build


CASES = [
    # (first: the compile / export checks' case, whose rel-err compare needs an lse without -inf rows)
    Case("varlen_attention", "packed_qkv_mqa_more_q_than_k",
         _case(hq=4, hkv=1, d=40, q_lens=[7, 5], k_lens=[3, 20], packed=True), ()),
    # chunked prefill: chunks of 0 / 1 / 3 queries against longer contexts, an empty context; GQA, lse
    Case("varlen_attention", "chunked_gqa_empty",
         _case(lse=True, hq=4, hkv=2, d=32, q_lens=[3, 0, 1, 2], k_lens=[37, 5, 1, 0]), ()),
    Case("varlen_attention", "noncausal_d128", _case(causal=False, hq=2, hkv=2, d=128, q_lens=[17, 4],
                                                     k_lens=[127, 9]), (), quick=False),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: a chunked-prefill batch (query chunks against their sequences' longer contexts)."""
    if big:
        args, kw = varlen_inputs(dtype, device, g, hq=32, hkv=8, d=128, q_lens=[512, 256, 1, 1],
                                 k_lens=[4096, 2048, 3000, 100])
    else:
        args, kw = varlen_inputs(dtype, device, g, hq=4, hkv=2, d=64, q_lens=[16, 1, 5], k_lens=[100, 37, 5])
    kw["causal"] = True
    return args, kw
