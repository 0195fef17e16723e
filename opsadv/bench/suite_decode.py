"""Bench suite "decode": opsadv.ops.paged_attention for one decode step (one query per sequence, bf16) over a paged
KV cache, against SDPA's flash and cuDNN backends and FlexAttention (compiled) over a contiguous cache of the same
contents (BENCHMARKS.md's decode peers; Flex here without a paged block mask: over the contiguous cache, the
simple setup).  Grid: GQA 32 / 8 and MQA 32 / 1 at d128, pages of 16 and 128, batch 1 / 8 / 64 x context 1k / 8k /
32k / 128k (cases whose paged cache would exceed MAX_CACHE_TOKENS tokens, b64 x 128k, left out: with the contiguous
copy the peers need it would not fit next to the others).  The cache's pages are handed out shuffled (as an
allocator's free list leaves them); every sequence holds the full context.  No append in the timed call (the peers
do not write a cache): the attention alone.

Rate in TB/s of bytes moved: K and V of every cached token read once, q read and out written (the block table is
negligible).  opsadv's row also says which impl ran; split-KV shows in b1 / long-context rows."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

import opsadv

from .case import BenchCase, flex_peer

# (label, hq, hkv)
HEADS = (("gqa", 32, 8), ("mqa", 32, 1))
HEAD_DIM = 128
PAGES = (16, 128)
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)
MAX_CACHE_TOKENS = 1 << 22          # b x context: b64 x 128k (8M tokens, 34 GB of K / V per copy at GQA) left out
QUICK = (("gqa", 16, 1, 8192), ("gqa", 16, 1, 131072), ("gqa", 128, 8, 32768), ("mqa", 16, 64, 8192))


def grid(quick: bool) -> list[tuple[str, int, int, int, int, int]]:
    """(label, hq, hkv, page, batch, context) of every case, in order."""
    heads = {h[0]: h for h in HEADS}
    if quick:
        return [(lab, heads[lab][1], heads[lab][2], p, b, s) for lab, p, b, s in QUICK]
    return [(lab, hq, hkv, p, b, s) for lab, hq, hkv in HEADS for p in PAGES for b in BATCHES for s in CONTEXTS
            if b * s <= MAX_CACHE_TOKENS]


def bytes_moved(b: int, s: int, hq: int, hkv: int, d: int, es: int = 2) -> float:
    return float(2 * b * s * hkv * d * es + 2 * b * hq * d * es)


def paged_cache(b, s, hkv, d, page, dtype, dev, seed=0):
    """(k_cache, v_cache, block_table, seqlens_k, k, v): every sequence holding s tokens in shuffled pages, and the
    same K / V contiguous as (b, hkv, s, d) for the peers."""
    g = torch.Generator(device=dev).manual_seed(seed)
    per = -(-s // page)
    n = b * per
    kc = torch.randn(n, page, hkv, d, device=dev, dtype=dtype, generator=g)
    vc = torch.randn(n, page, hkv, d, device=dev, dtype=dtype, generator=g)
    table = torch.randperm(n, device=dev, generator=g).to(torch.int32).view(b, per)
    lens = torch.full((b,), s, dtype=torch.int32, device=dev)

    def contiguous(c):
        return c[table.long()].reshape(b, per * page, hkv, d)[:, :s].transpose(1, 2).contiguous()
    return kc, vc, table, lens, contiguous(kc), contiguous(vc)


def cases(quick: bool, shapes=None) -> Iterator[BenchCase]:
    """shapes: (label, hq, hkv, page, batch, context[, head_dim]) tuples instead of grid(quick) (tests: tiny shapes
    on CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    flex = flex_peer()[0] if dev == "cuda" else None
    for label, hq, hkv, page, b, s, *rest in (shapes or grid(quick)):
        d = rest[0] if rest else HEAD_DIM
        kc, vc, table, lens, k, v = paged_cache(b, s, hkv, d, page, dtype, dev)
        g = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(b, 1, hq, d, device=dev, dtype=dtype, generator=g)      # (b, s_q = 1, Hq, D)
        qh = q.transpose(1, 2)                                                   # (b, Hq, 1, D) for the peers
        gqa = hq != hkv

        def mine(q=q, kc=kc, vc=vc, table=table, lens=lens):
            with torch.no_grad():
                return opsadv.ops.paged_attention(q, kc, vc, table, lens).transpose(1, 2)

        def sdpa(backends, qh=qh, k=k, v=v, gqa=gqa):
            with torch.no_grad():
                if backends is None:
                    return F.scaled_dot_product_attention(qh, k, v, enable_gqa=gqa)
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(qh, k, v, enable_gqa=gqa)

        if dev == "cuda":
            peers = {"sdpa_flash": (lambda sdpa=sdpa: sdpa([SDPBackend.FLASH_ATTENTION])),
                     "sdpa_cudnn": (lambda sdpa=sdpa: sdpa([SDPBackend.CUDNN_ATTENTION]))}
            if flex is not None:
                def fx(qh=qh, k=k, v=v, gqa=gqa):
                    with torch.no_grad():
                        return flex(qh, k, v, enable_gqa=gqa)
                peers["flex"] = fx
        else:
            peers = {"sdpa": (lambda sdpa=sdpa: sdpa(None))}
        words = ["fwd", "bf16" if dtype == torch.bfloat16 else "fp32", "decode", label, f"b{b}", f"ctx{s}",
                 f"h{hq}/{hkv}", f"d{d}", f"page{page}"]
        yield BenchCase(suite="decode", case=" ".join(words), opsadv=mine, peers=peers,
                        work=bytes_moved(b, s, hq, hkv, d, dtype.itemsize), unit="TB/s",
                        baseline="sdpa_flash" if dev == "cuda" else "sdpa", rounds=7 if b * s <= 65536 else None)
