"""Bench suite "decode": opsadv.ops.paged_attention for one decode step (one query per sequence, bf16) over a paged
KV cache, against SDPA's flash and cuDNN backends and FlexAttention (compiled) over a contiguous cache of the same
contents (BENCHMARKS.md's decode peers), FlexAttention over the same paged cache ("flex_paged": the pages read in
place through a block mask converted from the block table by torch's PagedAttention helper, flex_paged_peer), and
FlashInfer's paged decode over the same cache where FlashInfer is installed ("flashinfer": its CUDA-core decode
kernel; "flashinfer_tc": its tensor-core path, flashinfer_peer).  Grid: GQA 32 / 8 and MQA 32 / 1 at d128, pages of 16 and 128, batch 1 / 8 / 64 x context 1k / 8k /
32k / 128k (cases whose paged cache would exceed MAX_CACHE_TOKENS tokens, b64 x 128k, left out: with the contiguous
copy the peers need it would not fit next to the others).  The cache's pages are handed out shuffled (as an
allocator's free list leaves them); every sequence holds the full context.  No append in the timed call (the peers
do not write a cache): the attention alone.

Rate in TB/s of bytes moved: K and V of every cached token read once, q read and out written (the block table is
negligible).  opsadv's row also says which impl ran; split-KV shows in b1 / long-context rows.

fp8 rows ("fwd bf16 fp8kv decode ..."): opsadv over an fp8 (e4m3) cache with per-kv-head scales, built from the
same K / V (kv_scales, quantize_kv), against opsadv's own bf16 kernel as the one contender `opsadv_bf16` (the
peers have no fp8 cache): its speedup is the bf16 time over the fp8 time, paired per round (issue 39's target:
>= 1.7x, half the bytes).  The bf16 contender reads the fp8 cache dequantized to bf16 (the same values up to bf16
rounding, the same shapes and bytes as the bf16 row), so rel_err measures the kernel, not the quantization.  Work
counts 1 byte per K / V element.  Every case of the full grid gets one; the quick grid only QUICK_FP8's."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

import opsadv

from opsadv.ops.paged_attention import kv_scales, quantize_kv
from opsadv.ops.paged_attention.reference import dequantize_kv

from . import flashinfer_peer
from .case import BenchCase, flex_peer

# (label, hq, hkv)
HEADS = (("gqa", 32, 8), ("mqa", 32, 1))
HEAD_DIM = 128
PAGES = (16, 128)
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)
MAX_CACHE_TOKENS = 1 << 22          # b x context: b64 x 128k (8M tokens, 34 GB of K / V per copy at GQA) left out
QUICK = (("gqa", 16, 1, 8192), ("gqa", 16, 1, 131072), ("gqa", 128, 8, 32768), ("mqa", 16, 64, 8192))
QUICK_FP8 = (("gqa", 16, 1, 131072), ("gqa", 128, 8, 32768))      # the quick grid's cases that get an fp8 row


def grid(quick: bool) -> list[tuple[str, int, int, int, int, int]]:
    """(label, hq, hkv, page, batch, context) of every case, in order."""
    heads = {h[0]: h for h in HEADS}
    if quick:
        return [(lab, heads[lab][1], heads[lab][2], p, b, s) for lab, p, b, s in QUICK]
    return [(lab, hq, hkv, p, b, s) for lab, hq, hkv in HEADS for p in PAGES for b in BATCHES for s in CONTEXTS
            if b * s <= MAX_CACHE_TOKENS]


def bytes_moved(b: int, s: int, hq: int, hkv: int, d: int, es: int = 2, kv_es: int | None = None) -> float:
    """K and V read (kv_es bytes an element, default es: 1 for an fp8 cache), q read and out written (es)."""
    return float(2 * b * s * hkv * d * (es if kv_es is None else kv_es) + 2 * b * hq * d * es)


def fp8_cache(kc, vc, dtype):
    """(k_cache, v_cache, k_scale, v_scale) in fp8 with per-kv-head scales, and the same values dequantized to
    dtype (k, v; float32 products rounded once, a chunk of pages at a time to bound the temporaries)."""
    out = []
    for c in (kc, vc):
        s = kv_scales(c)
        c8 = quantize_kv(c, s)
        deq = torch.cat([dequantize_kv(part, s, torch.float32).to(dtype) for part in c8.split(4096)])
        out.append((c8, s, deq))
    (k8, ks, kd), (v8, vs, vd) = out
    return k8, v8, ks, vs, kd, vd


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


def flex_paged_peer(flex, q, kc, vc, table, lens):
    """A call of `flex` (flex_attention, compiled or not) attending q (b, 1, Hq, D) over the paged cache itself,
    returning (b, Hq, 1, D): the pool viewed as one sequence (1, Hkv, pages x page_size, D) (no copy), and a block
    mask whose kv blocks are pages: the logical mask (key < seqlens_k[b], blocks of page_size) mapped onto physical
    pages by torch.nn.attention.experimental._paged_attention.PagedAttention (page table and its inverse filled from
    block_table).  None where that helper is missing."""
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        return None
    n, page, hkv, d = kc.shape
    b, per = table.shape
    dev = kc.device
    paged = PagedAttention(n, page, b, device=dev)
    paged.page_table[:, :per] = table.long()
    seq = torch.arange(b, device=dev).repeat_interleave(per)
    paged.physical_to_logical[seq, table.reshape(-1).long()] = torch.arange(per, device=dev).repeat(b)
    paged.capacity[:] = per * page
    kv_len = lens.long()
    logical = create_block_mask(lambda bi, h, qi, kv: kv < kv_len[bi], b, None, 1, per * page, device=dev,
                                BLOCK_SIZE=(128, page))
    mask = paged.convert_logical_block_mask(logical, kv_len=kv_len)
    kf, vf = (c.view(1, n * page, hkv, d).transpose(1, 2) for c in (kc, vc))
    qh, gqa = q.transpose(1, 2), q.shape[2] != hkv

    def run():
        with torch.no_grad():
            return flex(qh, kf, vf, block_mask=mask, enable_gqa=gqa)
    return run


def cases(quick: bool, shapes=None, fp8_shapes=None) -> Iterator[BenchCase]:
    """shapes: (label, hq, hkv, page, batch, context[, head_dim]) tuples instead of grid(quick) (tests: tiny shapes
    on CPU); fp8_shapes: those of them that get an fp8 row (default: every case, or QUICK_FP8's in the quick
    grid).  Each fp8 row follows its case's bf16 row."""
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
                fp = flex_paged_peer(flex, q, kc, vc, table, lens)
                if fp is not None:
                    peers["flex_paged"] = fp
            for name, tc in (("flashinfer", False), ("flashinfer_tc", True)):
                fi = flashinfer_peer.decode_peer(q, kc, vc, table, lens, tensor_cores=tc)
                if fi is not None:
                    peers[name] = fi
        else:
            peers = {"sdpa": (lambda sdpa=sdpa: sdpa(None))}
        words = ["fwd", "bf16" if dtype == torch.bfloat16 else "fp32", "decode", label, f"b{b}", f"ctx{s}",
                 f"h{hq}/{hkv}", f"d{d}", f"page{page}"]
        rounds = 7 if b * s <= 65536 else None
        yield BenchCase(suite="decode", case=" ".join(words), opsadv=mine, peers=peers,
                        work=bytes_moved(b, s, hq, hkv, d, dtype.itemsize), unit="TB/s",
                        baseline="sdpa_flash" if dev == "cuda" else "sdpa", rounds=rounds,
                        extra={"flashinfer": flashinfer_peer.version() or
                               f"not a peer here: {flashinfer_peer.why_missing()}"} if dev == "cuda" else {})
        if fp8_shapes is not None:
            wants_fp8 = (label, hq, hkv, page, b, s, *rest) in [tuple(x) for x in fp8_shapes]
        else:
            wants_fp8 = not quick or (label, page, b, s) in QUICK_FP8
        if not wants_fp8:
            continue
        del k, v, peers                                  # the peers' contiguous copies: not needed by the fp8 row
        k8, v8, ks, vs, kd, vd = fp8_cache(kc, vc, dtype)

        def mine_fp8(q=q, k8=k8, v8=v8, table=table, lens=lens, ks=ks, vs=vs):
            with torch.no_grad():
                return opsadv.ops.paged_attention(q, k8, v8, table, lens, k_scale=ks, v_scale=vs).transpose(1, 2)

        def bf16_same_values(q=q, kd=kd, vd=vd, table=table, lens=lens):
            with torch.no_grad():
                return opsadv.ops.paged_attention(q, kd, vd, table, lens).transpose(1, 2)

        yield BenchCase(suite="decode", case=" ".join(words[:2] + ["fp8kv"] + words[2:]), opsadv=mine_fp8,
                        peers={"opsadv_bf16": bf16_same_values},
                        work=bytes_moved(b, s, hq, hkv, d, dtype.itemsize, kv_es=1), unit="TB/s",
                        baseline="opsadv_bf16", rounds=rounds,
                        extra={"kv_cache": "float8_e4m3fn, per-kv-head scales (kv_scales, quantize_kv)",
                               "baseline_note": "opsadv_bf16: opsadv's bf16 kernel over the fp8 cache dequantized "
                                                "to bf16 (same table, same shapes)"})
