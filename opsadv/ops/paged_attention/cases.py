"""Conformance cases of paged_attention (odd page tables, every feature) and the inputs `opsadv demo` runs.

A case's cache is a pool of pages handed out in a shuffled order (a sequence's pages are not contiguous, not in
order); slots past each sequence's length hold NaN and block-table entries past its last page hold -1, so an
impl that reads either shows."""
from __future__ import annotations

from typing import Any

import torch

from opsadv.core.opdef import Case, rand

from .reference import kv_scales, quantize_kv


def paged_inputs(dtype, device, g, *, hq, hkv, d, page, lens, q_counts=None, s_q=1, append=False,
                 shared_prefix=0, extra_pages=2, spare_table=1):
    """(args, kwargs) of a paged_attention call: lens are seqlens_k (after the append); q_counts (a list) packs q
    as (total_q, Hq, D) with cu_seqlens_q, else q is (batch, s_q, Hq, D).  shared_prefix: that many leading
    pages of sequence 0 are also sequence 1's (a shared prompt).  Used by the tests too."""
    b = len(lens)
    need = [-(-n // page) for n in lens]
    own = [n - (shared_prefix if i == 1 else 0) for i, n in enumerate(need)]
    total = sum(own) + extra_pages
    perm = torch.randperm(total, generator=g).tolist()
    width = max(need + [1]) + spare_table
    table = torch.full((b, width), -1, dtype=torch.int32)
    it = iter(perm)
    for i in range(b):
        for j in range(need[i]):
            table[i, j] = table[0, j] if i == 1 and j < shared_prefix else next(it)
    kc = rand((total, page, hkv, d), dtype, device, g)
    vc = rand((total, page, hkv, d), dtype, device, g)
    used = torch.zeros(total * page, dtype=torch.bool)
    for i in range(b):
        t = torch.arange(lens[i])
        used[table[i, t // page].long() * page + t % page] = True
    used = used.view(total, page)
    kc[~used.to(device)] = float("nan")
    vc[~used.to(device)] = float("nan")
    kw: dict[str, Any] = {}
    if q_counts is not None:
        cu = torch.tensor([0] + q_counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        kw["cu_seqlens_q"] = cu.to(device)
        lead: tuple = (int(cu[-1]),)
    else:
        lead = (b, s_q)
    q = rand((*lead, hq, d), dtype, device, g)
    if append:
        kw["k_new"] = rand((*lead, hkv, d), dtype, device, g)
        kw["v_new"] = rand((*lead, hkv, d), dtype, device, g)
    return (q, kc, vc, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)), kw


def _paged(causal=True, lse=False, fp8=False, **shape):
    def build(dtype, device, g):
        args, kw = paged_inputs(dtype, device, g, **shape)
        kw.update(causal=causal, return_lse=lse)
        if fp8:     # the cache in e4m3 with per-kv-head scales (appends are quantized by the op)
            q, kc, vc, table, lens = args
            kw.update(k_scale=kv_scales(kc), v_scale=kv_scales(vc))
            args = (q, quantize_kv(kc, kw["k_scale"]), quantize_kv(vc, kw["v_scale"]), table, lens)
        return args, kw
    return build


_FP8_KEPT = frozenset({1, 2, "k_scale", "v_scale"})


CASES = [
    Case("paged_attention", "decode_gqa", _paged(hq=4, hkv=2, d=32, page=16, lens=[1, 37, 64], lse=True), ()),
    Case("paged_attention", "varlen_append_mqa",
         _paged(hq=4, hkv=1, d=40, page=8, lens=[20, 9, 40], q_counts=[3, 0, 5], append=True), ()),
    Case("paged_attention", "chunked_prefill", _paged(hq=2, hkv=2, d=64, page=16, lens=[17, 50], s_q=17), (),
         quick=False),
    Case("paged_attention", "shared_prefix_noncausal",
         _paged(causal=False, hq=6, hkv=2, d=16, page=8, lens=[33, 41], s_q=3, shared_prefix=2), (), quick=False),
    Case("paged_attention", "d128_page64_empty_seq",
         _paged(lse=True, hq=8, hkv=2, d=128, page=64, lens=[130, 0], s_q=2, append=False), (), quick=False),
    Case("paged_attention", "fp8_cache_append_gqa",
         _paged(fp8=True, lse=True, hq=4, hkv=2, d=64, page=16, lens=[1, 37, 70], append=True), (), kept=_FP8_KEPT),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: a GQA decode step (one new token per sequence, appended to the cache)."""
    if big:
        return paged_inputs(dtype, device, g, hq=32, hkv=8, d=128, page=16, lens=[4096] * 8, append=True)
    return paged_inputs(dtype, device, g, hq=4, hkv=2, d=64, page=16, lens=[100, 37], append=True)
