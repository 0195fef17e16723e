"""Bench suite "fp8": opsadv.ops.scaled_gemm (FP8 e4m3 operands, bf16 output) against cuBLASLt through
torch._scaled_mm and against our own bf16 gemm on the same data (the "FP8 is ~2x bf16" context).

Grid: (m, n, k) = 8192^3 and the gemm suite's shapes (16384x12288x4096, 16384x11008x4096, 16384x4096x11008) x
scales "tensor" (per tensor), "row" (a per row x b per column), "block" (a 1x128 x b 128x128, DeepSeek-V3) x
epilogues "none" and "bias+gelu_tanh"; plus 8192^3 per-tensor with an fp8 output ("fp8_out": e4m3 y and its
per-tensor scale; the peer is _scaled_mm to float32 then amax / divide / cast in torch).  b is an nn.Linear-style
(n, k) weight passed as weight.t() (column-major: the layout _scaled_mm requires).  FLOPs 2*m*n*k.

Peers: "scaled_mm" (torch._scaled_mm; bias fused by cuBLASLt for per-tensor scales, else added in torch; gelu in
torch; the speedup baseline), "bf16_gemm" (opsadv.ops.gemm with the same epilogue on bf16 copies of the
dequantized operands).  When the dispatcher picks cuBLASLt, an "[own]" row times the Triton kernel
(cuda.triton.scaled_gemm_tma, else cuda.triton.scaled_gemm) too.  rel_err is against the reference semantics:
the dequantized operands multiplied in float32 with the epilogue in float32 (for fp8_out: the dequantized
output), not against a peer.

The issue's targets (H200): ours >= 1.0x scaled_mm at 8192^3 and the gemm shapes with per-tensor and row-wise
scales; block-scaled rate >= 0.9x our per-tensor rate; an epilogue costs <= 3% over the plain FP8 GEMM.

FP8 SwiGLU rows ("fwd e4m3 ... swiglu ..."): opsadv.ops.scaled_swiglu_gemm (one FP8 GEMM over [W_g | W_u], the
silu(g) * u epilogue, bf16 out) at a Llama-1.5B MLP shape, M 16384 tokens, K 2048, N 2 x 8192, per-tensor and
row-wise scales (plus block scales in the full grid).  FLOPs 2*M*K*2N.  Peers: "scaled_gemm_swiglu" (what the
composed FP8 path runs: opsadv.ops.scaled_gemm to a bf16 gate_up, then opsadv.ops.swiglu; the speedup baseline),
"scaled_mm_swiglu" (torch._scaled_mm to bf16, then torch's silu(g) * u; tensor / row scales only) and
"bf16_swiglu_gemm" (our bf16 opsadv.ops.swiglu_gemm on bf16 copies of the dequantized operands).  rel_err is
against silu(g) * u of the dequantized operands in float32.

Cast rows ("cast ..."): opsadv.ops.cast_to_fp8 with transpose=True under a given per-tensor scale (what the FP8
training recipe runs per operand: activations e4m3, gradients e5m2) on bf16 matrices of a Llama-1.5B step, (8192,
2048) and (8192, 8192).  Bytes: 2 read + 1 + 1 written per element.  Peers: "torch_ops" (what the recipe ran
before: abs / amax, float32 divide, clamp, cast, and a transpose copy; the speedup baseline) and "torch_compile"
(the same function under torch.compile: Inductor's fusion of it).  rel_err: the fp8 values against torch's cast
(0 when bit for bit).

Delayed cast rows ("cast delayed ..."): opsadv.ops.cast_to_fp8_delayed with transpose=True on a started 16-long
history (the recipe's activations and gradients: the whole delayed-scaling cast, scale from the history and amax
recorded, one launch), at the cast rows' shapes and a small (2048, 2048) one where launches weigh.  Peers:
"cast_steps" (what the recipe ran before: the window's max and the scale in torch, cast_to_fp8, the tiles' amax
reduced and written into a Python-indexed ring; the speedup baseline) and "torch_ops" (the same with the torch
cast).  Bytes as the cast rows'.

FP8 attention rows ("attn ..."): opsadv.ops.fp8_attention forward (e4m3 q, k, v with per-(batch, head)
descales, bf16 output) at d128, causal and not, (b, h, s) = (4, 32, 4096) and (1, 32, 16384) (the attention
suite's), plus GQA 32/8 causal at s 4096.  FLOPs 4*b*h*s*s*d (halved for causal).  Peers: "bf16_flash" (our
opsadv.ops.flash_attention on bf16 copies of the dequantized inputs; the speedup baseline: the issue's >= 1.5x)
and "sdpa_cudnn" (SDPA's cuDNN backend, bf16).  rel_err is against the reference semantics: the exact attention of
the dequantized inputs (float32, computed per head chunk), so it shows the kernel's P rounding (~2.5%: docs/fp8.md),
under the runner's 5% MISMATCH.  Target (H200): >= 1000 TFLOP/s at d128 s >= 4096.

FP8 attention backward rows ("attn bwd ..."): the backward alone, as fp8_attention_from_bf16 runs it by default on
the cuda backend (torch.ops.opsadv.fp8_attention_backward(..., "fp8"): cuda.triton.fp8_attention's backward, FP8
QK^T recomputation) on e4m3 q, k, v with per-(batch, head) descales, the FP8 forward's out and lse and a bf16 dO, at
d128 causal (b, h, s) = (2, 16, 4096) and GQA 32/8 (and non-causal b2 h16 in the full grid).  FLOPs 2.5 x the
forward's (5 GEMMs to 2; halved for causal).  Peers, on bf16 copies of the dequantized inputs with the same out, lse
and dO: "bf16_flash" (flash_attention's backward as the dispatcher resolves it: what backward="bf16" runs; the
speedup baseline, as the forward rows') and "bf16_own" (our own Triton / Gluon flash backward, suite_attention's
[own] choice).  The issue's target (H200): >= 1.3x our bf16 backward.  rel_err is against the baseline's
gradients: the two backwards' difference on the same out and lse (P, dS rounded to bf16 in both; the bf16 one
also rounds the dequantized inputs to bf16): a few 1e-3 expected."""
from __future__ import annotations

from typing import Iterator

import math

import torch
import torch.nn.functional as F

import opsadv
from opsadv.ops.fp8_attention import dequantize_heads, quantize_qkv
from opsadv.ops.fp8_attention.reference import fp8_attention_fwd
from opsadv.ops.scaled_gemm import _spec as _scaled_spec, new_amax_history, scale_from_amax, validate as _validate
from opsadv.ops.scaled_gemm.reference import dequantize_fp8, quantize_fp8, requantize

from .case import BenchCase, compiled_peer
from .suite_attention import _own as attention_own      # (impl, ctx) of our best own flash kernel for a call
from .suite_gemm import OWN_PREFIXES, SHAPES as GEMM_SHAPES, own_impl as _gemm_own_impl

ATTN_SHAPES = ((4, 32, 32, 4096), (1, 32, 32, 16384))        # (b, h, h_kv, s)
SHAPES = ((8192, 8192, 8192),) + tuple(GEMM_SHAPES[1:])
SCALINGS = {"tensor": ("tensor", "tensor"), "row": ("row", "col"), "block": ("block1x128", "block128x128")}
EPILOGUES = ("none", "gelu_tanh")


def _grid(quick: bool):
    """(m, n, k, scaling, epilogue)"""
    if quick:
        return [(8192, 8192, 8192, s, "none") for s in SCALINGS] + [(16384, 12288, 4096, "tensor", "gelu_tanh"),
                                                                   (8192, 8192, 8192, "tensor", "fp8_out")]
    g = [(m, n, k, s, ep) for m, n, k in SHAPES for s in SCALINGS for ep in EPILOGUES]
    return g + [(8192, 8192, 8192, "tensor", "fp8_out"), (8192, 8192, 8192, "row", "fp8_out")]


def own_impl(spec):
    """(impl, ctx) of our Triton kernel for this call (suite_gemm.own_impl's choice), or None."""
    return _gemm_own_impl("scaled_gemm", spec)


def _mm_scales(kind: str, sa, sb):
    """The scales as torch._scaled_mm takes them for this granularity."""
    if kind == "block":      # a: outer-dim-major (M, K/128); b: (K/128, N/128) as the transpose of a row-major one
        return sa.t().contiguous().t(), sb.t().contiguous().t()
    return sa, sb


def cases(quick: bool) -> Iterator[BenchCase]:
    if not torch.cuda.is_available():
        return
    yield from attention_cases(quick)
    yield from attention_bwd_cases(quick)
    yield from gemm_cases(quick)
    yield from swiglu_cases(quick)
    yield from cast_cases(quick)
    yield from cast_delayed_cases(quick)


SWIGLU_SHAPES = ((16384, 2048, 8192),)          # (m, k, n): a Llama-1.5B MLP (hidden 2048, intermediate 8192)


def swiglu_cases(quick: bool, dev: str = "cuda", shapes=SWIGLU_SHAPES) -> Iterator[BenchCase]:
    """(dev, shapes: tests run tiny rows on the CPU)"""
    scalings = ("tensor", "row") if quick else tuple(SCALINGS)
    for (m, k, n), scaling in ((s, sc) for s in shapes for sc in scalings):
        torch.manual_seed(0)
        gx, gw = SCALINGS[scaling]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(2 * n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5      # [W_g; W_u] rows (2N, K)
        x8, sx = quantize_fp8(x, gx)
        w8, sw = quantize_fp8(w.t(), gw)
        w8 = w8.t().contiguous().t()                                     # column-major (K, 2N): W8.t()
        del x, w
        xd, wd = dequantize_fp8(x8, sx), dequantize_fp8(w8, sw)           # float32
        gu = xd @ wd
        ref = F.silu(gu[:, :n]) * gu[:, n:]
        del gu
        x16, w16 = xd.to(torch.bfloat16), wd.to(torch.bfloat16).t().contiguous().t()
        del xd, wd

        def compare(out, _peer_out, ref=ref):
            return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

        def mine(x8=x8, w8=w8, sx=sx, sw=sw):
            with torch.no_grad():
                return opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw)

        def scaled_gemm_swiglu(x8=x8, w8=w8, sx=sx, sw=sw):
            with torch.no_grad():
                return opsadv.ops.swiglu(opsadv.ops.scaled_gemm(x8, w8, sx, sw))

        def bf16_swiglu_gemm(x16=x16, w16=w16):
            with torch.no_grad():
                return opsadv.ops.swiglu_gemm(x16, w16)

        peers = {"scaled_gemm_swiglu": scaled_gemm_swiglu, "bf16_swiglu_gemm": bf16_swiglu_gemm}
        if scaling != "block":
            msx, msw = _mm_scales(scaling, sx, sw)

            def scaled_mm_swiglu(x8=x8, w8=w8, msx=msx, msw=msw, n=n):
                gu = torch._scaled_mm(x8, w8, msx, msw, out_dtype=torch.bfloat16)
                return F.silu(gu[:, :n]) * gu[:, n:]
            peers["scaled_mm_swiglu"] = scaled_mm_swiglu
        words = ["fwd", "e4m3", f"m{m}", f"n2x{n}", f"k{k}", "swiglu", f"scale_{scaling}"]
        yield BenchCase(suite="fp8", case=" ".join(words), opsadv=mine, peers=peers, work=2.0 * m * k * 2 * n,
                        unit="TFLOP/s", compare=compare, baseline="scaled_gemm_swiglu")


def _attn_grid(quick: bool):
    """(b, h, h_kv, s, d, causal)"""
    if quick:
        return [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True)]
    return [(b, h, hkv, s, 128, c) for b, h, hkv, s in ATTN_SHAPES for c in (False, True)] + \
        [(4, 32, 8, 4096, 128, True)]


def _attention_reference(args, causal: bool, chunk: int = 4) -> torch.Tensor:
    """The exact attention of the dequantized inputs, float32, a few q heads at a time (an s 16384 score matrix of
    every head at once would not fit)."""
    q8, k8, v8, qd, kd, vd = args
    hq, hkv = q8.shape[1], k8.shape[1]
    grp = hq // hkv
    outs = []
    for h0 in range(0, hq, chunk):
        hs = slice(h0, h0 + chunk)
        ks = slice(h0 // grp, (h0 + chunk - 1) // grp + 1)
        sub = q8[:, hs], k8[:, ks], v8[:, ks], qd[:, hs], kd[:, ks], vd[:, ks]    # (chunk: a multiple of the group)
        outs.append(fp8_attention_fwd(None, *sub, causal, 1 / math.sqrt(q8.shape[-1]), torch.float32)[0])
    return torch.cat(outs, dim=1)


def attention_cases(quick: bool) -> Iterator[BenchCase]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda"
    for b, h, hkv, s, d, causal in _attn_grid(quick):
        torch.manual_seed(0)
        q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16)
        args = quantize_qkv(q, k, v)
        del q, k, v
        q16, k16, v16 = (dequantize_heads(x8, ds, torch.bfloat16) for x8, ds in zip(args[:3], args[3:]))
        ref = _attention_reference(args, causal, chunk=max(4, h // hkv))
        gqa = h != hkv

        def compare(out, _peer_out, ref=ref):
            return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

        def mine(args=args, causal=causal):
            with torch.no_grad():
                return opsadv.ops.fp8_attention(*args, causal=causal)

        def bf16_flash(q16=q16, k16=k16, v16=v16, causal=causal):
            with torch.no_grad():
                return opsadv.ops.flash_attention(q16, k16, v16, causal=causal)

        def sdpa_cudnn(q16=q16, k16=k16, v16=v16, causal=causal, gqa=gqa):
            with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q16, k16, v16, is_causal=causal, enable_gqa=gqa)

        words = ["attn", "fwd", "e4m3", f"b{b}", f"h{h}"] + ([f"kv{hkv}"] if gqa else []) + \
                [f"s{s}", f"d{d}"] + (["causal"] if causal else []) + ["descale_head"]
        yield BenchCase(suite="fp8", case=" ".join(words), opsadv=mine,
                        peers={"bf16_flash": bf16_flash, "sdpa_cudnn": sdpa_cudnn},
                        work=4.0 * b * h * s * s * d * (0.5 if causal else 1.0), unit="TFLOP/s", compare=compare,
                        baseline="bf16_flash")


def _attn_bwd_grid(quick: bool):
    """(b, h, h_kv, s, d, causal)"""
    rows = [(2, 16, 16, 4096, 128, True), (2, 32, 8, 4096, 128, True)]
    return rows[:1] if quick else rows + [(2, 16, 16, 4096, 128, False)]


def attention_bwd_cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda"
    for b, h, hkv, s, d, causal in _attn_bwd_grid(quick):
        torch.manual_seed(0)
        q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16)
        do = torch.randn_like(q)
        args = quantize_qkv(q, k, v)
        del q, k, v
        with torch.no_grad():
            out, lse = opsadv.ops.fp8_attention(*args, causal=causal, return_lse=True)
        q16, k16, v16 = (dequantize_heads(x8, ds, torch.bfloat16) for x8, ds in zip(args[:3], args[3:]))
        gqa = h != hkv

        def mine(args=args, do=do, out=out, lse=lse, causal=causal):
            return torch.ops.opsadv.fp8_attention_backward(do, *args, out, lse, causal, None, "fp8", 0)

        def bf16_flash(q16=q16, k16=k16, v16=v16, do=do, out=out, lse=lse, causal=causal):
            return torch.ops.opsadv.flash_attention_backward(do, q16, k16, v16, out, lse, None, causal, None, False,
                                                             0)

        peers = {"bf16_flash": bf16_flash}
        own = attention_own(q16, k16, causal, True)
        if own is not None:
            def bf16_own(own=own, q16=q16, k16=k16, v16=v16, do=do, out=out, lse=lse, causal=causal):
                impl, ctx = own
                return impl.backward(ctx, do, q16, k16, v16, out, lse, None, causal, q16.shape[-1] ** -0.5)
            peers["bf16_own"] = bf16_own
        words = ["attn", "bwd", "e4m3", f"b{b}", f"h{h}"] + ([f"kv{hkv}"] if gqa else []) + \
                [f"s{s}", f"d{d}"] + (["causal"] if causal else []) + ["descale_head"]
        yield BenchCase(suite="fp8", case=" ".join(words), opsadv=mine, peers=peers,
                        work=2.5 * 4.0 * b * h * s * s * d * (0.5 if causal else 1.0), unit="TFLOP/s",
                        baseline="bf16_flash", extra={"own_impl_bf16": own[0].id} if own is not None else {})


def gemm_cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda"
    for m, n, k, scaling, ep in _grid(quick):
        torch.manual_seed(0)
        ga, gb = SCALINGS[scaling]
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        a8, sa = quantize_fp8(a, ga)
        b8, sb = quantize_fp8(w.t(), gb)
        b8 = b8.t().contiguous().t()                        # column-major (K, N): W8.t()
        del a, w
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if ep == "gelu_tanh" else None
        act = "gelu_tanh" if ep == "gelu_tanh" else "none"
        out_fp8 = ep == "fp8_out"
        ad, bd = dequantize_fp8(a8, sa), dequantize_fp8(b8, sb)           # float32
        ref = ad @ bd
        if bias is not None:
            ref = F.gelu(ref + bias.float(), approximate="tanh")
        a16, b16 = ad.to(torch.bfloat16), bd.to(torch.bfloat16).t().contiguous().t()
        del ad, bd

        def compare(out, _peer_out, ref=ref):
            o = dequantize_fp8(*out) if isinstance(out, tuple) else out.float()
            return ((o.double() - ref.double()).norm() / ref.double().norm()).item()

        def mine(a8=a8, b8=b8, sa=sa, sb=sb, bias=bias, act=act, out_fp8=out_fp8):
            with torch.no_grad():
                return opsadv.ops.scaled_gemm(a8, b8, sa, sb, bias=bias, activation=act, out_fp8=out_fp8)

        msa, msb = _mm_scales(scaling, sa, sb)

        def scaled_mm(a8=a8, b8=b8, msa=msa, msb=msb, bias=bias, tensorwise=scaling == "tensor",
                      out_fp8=out_fp8):
            if out_fp8:
                return requantize(torch._scaled_mm(a8, b8, msa, msb, out_dtype=torch.float32), torch.float8_e4m3fn)
            y = torch._scaled_mm(a8, b8, msa, msb, bias=bias if tensorwise else None, out_dtype=torch.bfloat16)
            if bias is not None:
                y = F.gelu(y if tensorwise else y + bias, approximate="tanh")
            return y

        def bf16_gemm(a16=a16, b16=b16, bias=bias, act=act):
            with torch.no_grad():
                return opsadv.ops.gemm(a16, b16, bias=bias, activation=act)

        extra = {}
        kind_a, kind_b = _validate(a8, b8, sa, sb, bias, act, None, torch.bfloat16, out_fp8)
        own = own_impl(_scaled_spec(a8, b8, kind_a, kind_b, bias, act, None, torch.bfloat16,
                                    torch.float8_e4m3fn if out_fp8 else None))
        if own is not None:
            impl, ctx = own
            fp8 = torch.float8_e4m3fn if out_fp8 else None

            def own_fn(impl=impl, ctx=ctx, a8=a8, b8=b8, sa=sa, sb=sb, bias=bias, act=act, fp8=fp8):
                out, scale = impl.fn(ctx, a8, b8, sa, sb, bias, act, None, torch.bfloat16, fp8)
                return (out, scale) if fp8 is not None else out
            extra = {"own": own_fn, "own_prefix": OWN_PREFIXES, "own_impl": impl.id}
        words = ["fwd", "e4m3", f"m{m}", f"n{n}", f"k{k}", f"scale_{scaling}"] + \
                {"none": [], "gelu_tanh": ["bias", "gelu_tanh"], "fp8_out": ["fp8_out"]}[ep]
        yield BenchCase(suite="fp8", case=" ".join(words), opsadv=mine,
                        peers={"scaled_mm": scaled_mm, "bf16_gemm": bf16_gemm}, work=2.0 * m * n * k,
                        unit="TFLOP/s", compare=compare, baseline="scaled_mm", extra=extra)


CAST_SHAPES = ((8192, 2048), (8192, 8192))      # (rows, cols): a Llama-1.5B step's activations / MLP gradients


def _torch_cast(x, scale, dtype):
    """The unfused cast: what the FP8 training recipe ran before cast_to_fp8 (transpose copy and amax included)."""
    amax = x.abs().amax().float()
    fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    q = (x.float() / scale).clamp_(-fmax, fmax).to(dtype)
    return q, q.t().contiguous(), amax


class _PythonRing:
    """The delayed-scaling steps around a cast as the recipe ran them before cast_to_fp8_delayed (the peer)."""

    def __init__(self, length: int, dev: str, amax: float):
        self.buf, self.pos, self.length = torch.full((length,), amax, device=dev), 0, length

    def __call__(self, x, dtype, cast):
        scale = scale_from_amax(self.buf.amax(), dtype)
        q, qt, amax = cast(x, scale, dtype)
        self.buf[self.pos] = amax
        self.pos = (self.pos + 1) % self.length
        return q, qt, scale


def cast_delayed_cases(quick: bool, dev: str = "cuda", shapes=((2048, 2048), *CAST_SHAPES)) -> Iterator[BenchCase]:
    """(dev, shapes: tests run tiny rows on the CPU)"""
    dtypes = (torch.float8_e4m3fn,) if quick else (torch.float8_e4m3fn, torch.float8_e5m2)
    picked = tuple(dict.fromkeys(shapes[:1] + shapes[-1:])) if quick else shapes      # (the smallest, the largest)
    for (m, n), dtype in ((sh, d) for sh in picked for d in dtypes):
        torch.manual_seed(0)
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
        amax = x.float().abs().amax().item()
        scale = torch.tensor(amax / fmax, device=dev)
        ref = _torch_cast(x, scale, dtype)[0].float()
        hist = new_amax_history(16, dev)
        hist[:17] = amax                                  # started, every window slot at x's amax: the scale above
        hist[17], hist[18] = 0.0, 1.0
        steps, steps_torch = _PythonRing(16, dev, amax), _PythonRing(16, dev, amax)

        def compare(out, _peer_out, ref=ref):
            return ((out[0].float() - ref).norm() / ref.norm()).item()

        def mine(x=x, hist=hist, dtype=dtype):
            return opsadv.ops.cast_to_fp8_delayed(x, hist, dtype=dtype, transpose=True)

        def opsadv_cast(x, s, dt):
            return opsadv.ops.cast_to_fp8(x, s, dtype=dt, transpose=True)

        peers = {"cast_steps": lambda x=x, dtype=dtype, r=steps: r(x, dtype, opsadv_cast),
                 "torch_ops": lambda x=x, dtype=dtype, r=steps_torch: r(x, dtype, _torch_cast)}
        name = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
        yield BenchCase(suite="fp8", case=f"cast delayed bf16 {name} m{m} n{n} transpose", opsadv=mine,
                        peers=peers, work=4.0 * m * n, unit="TB/s", compare=compare, baseline="cast_steps")


def cast_cases(quick: bool, dev: str = "cuda", shapes=CAST_SHAPES) -> Iterator[BenchCase]:
    """(dev, shapes: tests run tiny rows on the CPU)"""
    dtypes = (torch.float8_e4m3fn,) if quick else (torch.float8_e4m3fn, torch.float8_e5m2)
    for (m, n), dtype in ((sh, d) for sh in (shapes[-1:] if quick else shapes) for d in dtypes):
        torch.manual_seed(0)
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
        scale = (x.float().abs().amax() / fmax).reshape(())
        ref = _torch_cast(x, scale, dtype)[0].float()

        def compare(out, _peer_out, ref=ref):
            return ((out[0].float() - ref).norm() / ref.norm()).item()

        def mine(x=x, scale=scale, dtype=dtype):
            return opsadv.ops.cast_to_fp8(x, scale, dtype=dtype, transpose=True)

        compiled = compiled_peer(_torch_cast)
        peers = {"torch_ops": lambda x=x, scale=scale, dtype=dtype: _torch_cast(x, scale, dtype),
                 "torch_compile": lambda x=x, scale=scale, dtype=dtype, f=compiled: f(x, scale, dtype)}
        name = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
        yield BenchCase(suite="fp8", case=f"cast bf16 {name} m{m} n{n} transpose", opsadv=mine, peers=peers,
                        work=4.0 * m * n, unit="TB/s", compare=compare, baseline="torch_ops")
