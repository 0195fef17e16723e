"""Bench suite "attention": opsadv.ops.flash_attention against SDPA with each backend forced
(cuDNN, flash, efficient) and compiled FlexAttention, forward and forward+backward.
Grid (docs/performance.md): bf16 and fp16, d64 and d128, causal and not, (b,h,s) = (16,32,1024),
(4,32,4096), (1,32,16384), GQA 32 q heads over 8 kv heads.  FLOPs: 4*b*h*s*s*d (halved for
causal), forward+backward 3.5x.  Tensors are made lazily, one case at a time."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.nn.functional as F

import opsadv
from opsadv.core import dispatch
from opsadv.core.policy import current_policy
from opsadv.ops.flash_attention import _spec as attention_spec
from opsadv.registry import get_registry

from .case import BenchCase, flex_peer

# The library's own kernels, best first (H200: the Gluon forward >= cuDNN at d128, the Triton one 0.78-0.92x);
# an "[own]" row reports the first one that accepts the case, when the dispatcher chose a vendor kernel.
OWN = ("cuda.gluon.flash_attention", "cuda.triton.flash_attention")
OWN_PREFIXES = ("cuda.gluon.", "cuda.triton.")
SHAPES = ((16, 32, 1024), (4, 32, 4096), (1, 32, 16384))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# `opsadv bench --allow-cpu` without a GPU: the quick grid at sizes a CPU runs in seconds (a smoke test)
CPU_QUICK = [("bf16", 1, 4, 4, 128, 64, False, False), ("bf16", 1, 4, 2, 128, 64, True, True)]


def _grid(quick: bool):
    """(dtype, b, h, hkv, s, d, causal, backward)"""
    if quick and not torch.cuda.is_available():
        return CPU_QUICK
    if quick:
        return [("bf16", 4, 32, 32, 4096, 128, False, False), ("bf16", 4, 32, 32, 4096, 128, True, False),
                ("bf16", 4, 32, 32, 4096, 128, True, True), ("bf16", 4, 32, 8, 4096, 128, True, False),
                ("bf16", 16, 32, 32, 1024, 64, False, True)]
    g = []
    for bwd in (False, True):
        for d in (64, 128):
            for b, h, s in SHAPES:
                for causal in (False, True):
                    g.append(("bf16", b, h, h, s, d, causal, bwd))
        for causal in (False, True):
            g.append(("fp16", 4, 32, 32, 4096, 128, causal, bwd))
        for b, h, s in SHAPES[1:]:
            g.append(("bf16", b, h, 8, s, 128, True, bwd))
    return g


def _own(q, k, causal, backward):
    """(impl, ctx) of the library's best own kernel that accepts the case (OWN), bypassing the
    dispatcher's choice (for "[own]" rows); None when none does."""
    if "cuda" not in get_registry().backends or not get_registry().backends["cuda"].available:
        return None
    pol = dataclasses.replace(current_policy(), backend="cuda", autotune=False)
    exp, r = dispatch.explain_spec(attention_spec(q, k, None, causal, backward), pol)
    if r is None:
        return None
    accepted = {c.impl.id for c in exp.candidates if c.accepted}
    for own_id in OWN:
        impl = next((i for i in get_registry().impls_by_op.get("flash_attention", []) if i.id == own_id), None)
        if impl is not None and own_id in accepted:
            return impl, r.ctx         # one backend's impls share the resolution context (profile, options)
    return None


# Sub-millisecond cases move more between rounds: in one suite run the s1024 d128 forward's SDPA-cuDNN peer
# read 0.462 ms against 0.479 for the dispatcher running the same cuDNN kernel, while 5 interleaved rounds of
# the same kernels put both at 0.492-0.496 ms
SHORT_CASE_ROUNDS = 7


def cases(quick: bool) -> Iterator[BenchCase]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flex, make_mask = flex_peer()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for dt, b, h, hkv, s, d, causal, bwd in _grid(quick):
        torch.manual_seed(0)
        dtype = DTYPES[dt]
        q = torch.randn(b, h, s, d, device=dev, dtype=dtype)
        k = torch.randn(b, hkv, s, d, device=dev, dtype=dtype)
        v = torch.randn(b, hkv, s, d, device=dev, dtype=dtype)
        do = torch.randn(b, h, s, d, device=dev, dtype=dtype) if bwd else None
        gqa = hkv != h
        scale = d ** -0.5
        qg, kg, vg = (t.clone().requires_grad_(bwd) for t in (q, k, v))

        def run(fn, qg=qg, kg=kg, vg=vg, do=do, bwd=bwd):
            if not bwd:
                with torch.no_grad():
                    return fn(qg, kg, vg)
            return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do)

        def mine(q_, k_, v_, causal=causal):
            return opsadv.ops.flash_attention(q_, k_, v_, causal=causal)

        peers = {}
        for key, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def sdpa(q_, k_, v_, be=be, causal=causal, gqa=gqa):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)
            peers[key] = (lambda fn=sdpa, run=run: run(fn))
        if flex is not None and dev == "cuda":
            bm = make_mask(lambda b_, h_, i, j: i >= j, None, None, s, s, device=dev) if causal else None

            def fx(q_, k_, v_, bm=bm, gqa=gqa):
                return flex(q_, k_, v_, block_mask=bm, enable_gqa=gqa)
            peers["flex"] = (lambda fn=fx, run=run: run(fn))
        extra = {}
        own = _own(q, k, causal, bwd)
        if own is not None:
            impl, ctx = own
            if bwd:
                def own_fn(impl=impl, ctx=ctx, q=q, k=k, v=v, do=do, causal=causal, scale=scale):
                    o, lse = impl.fn(ctx, q, k, v, None, causal, scale)
                    return impl.backward(ctx, do, q, k, v, o, lse, None, causal, scale)
            else:
                def own_fn(impl=impl, ctx=ctx, q=q, k=k, v=v, causal=causal, scale=scale):
                    return impl.fn(ctx, q, k, v, None, causal, scale)[0]
            extra = {"own": own_fn, "own_prefix": OWN_PREFIXES, "own_impl": impl.id}
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (3.5 if bwd else 1.0)
        words = [("fwd+bwd" if bwd else "fwd"), dt, f"b{b}", f"h{h}"] + ([f"kv{hkv}"] if gqa else []) + \
                [f"s{s}", f"d{d}"] + (["causal"] if causal else []) + (["gqa"] if gqa else [])
        yield BenchCase(suite="attention", case=" ".join(words), opsadv=(lambda fn=mine, run=run: run(fn)), peers=peers,
                        work=flops, unit="TFLOP/s", extra=extra, rounds=SHORT_CASE_ROUNDS if s <= 1024 else None)
