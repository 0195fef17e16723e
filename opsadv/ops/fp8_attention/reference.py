"""FP8 attention's descale conventions, the q / k / v quantize helpers and the reference impl (the oracle).

Descales follow scaled_gemm's convention (opsadv.ops.scaled_gemm.reference): a descale is the DEQUANTIZATION
factor, float32, x ≈ x_fp8.float() * descale.  For attention operands (b, h, s, d) a descale is

    per tensor        shape () or (1,)                 one factor for the whole tensor
    per head          shape (b, h) of that tensor       one per (batch, head): k / v per (batch, kv head)
    per kv head (q)   shape (b, h_kv)                   q only: FA3's q_descale, shared by the q heads of a GQA group

(FA3's flash_attn_func takes (b, h_kv) for all three.)  With h_q == h_kv "per head" and "per kv head" are the
same thing.

quantize_heads(x) gives the per-head ("current scaling") quantization: descale = amax / 448 per (batch, head), the
amax over the head's finite |x| (a head of zeros gets 1), x_fp8 = clamp(float32(x) / descale, -448, 448) rounded to
nearest even (e4m3; the same rule as opsadv.ops.scaled_gemm.quantize_fp8, bit for bit).  Round trip: |error| <=
2^-4 |x| where |x| / descale >= 2^-6, else <= 2^-10 * descale.

The reference is the exact attention of the dequantized inputs: q, k, v dequantized to float32 (float64 for a
float64 out_dtype), softmax(scale * q k^T) v with bottom-right causal masking, lse the natural-log row logsumexp
of the scaled scores.  It does not emulate the kernel's P quantization (the Triton kernel rounds P to e4m3 for
its FP8 P @ V): that extra error is the kernel's, bounded in the tests (tests/test_fp8_attention.py) and
documented in docs/fp8.md.

The reference backward (fp8_attention_bwd) emulates the FP8 backward kernel's roundings exactly
(opsadv/backends/triton_common/fp8_attention/bwd_kernels.py): P = exp(S - lse) of the dequantized inputs (the FP8
QK^T is exact: products of e4m3 values are exact in float32), delta = rowsum(dO * out) of the given out, dV =
P^T dO and dQ = dS K, dK = dS^T Q with P and dS rounded to the gradients' dtype when it is bf16 / fp16 (the GEMM
operand dtype there), the saved q, k, v exact; accumulation in float32 (float64 for float64 gradients, or acc=)."""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
FMAX = 448.0
FEATURES = frozenset({"causal", "gqa", "cross_length", "q_descale_tensor", "q_descale_head", "q_descale_kv_head",
                      "k_descale_tensor", "k_descale_head", "v_descale_tensor", "v_descale_head"})


def descale_kind(descale: torch.Tensor, b: int, h: int, h_kv: int | None = None) -> str | None:
    """"tensor", "head" ((b, h)), "kv_head" ((b, h_kv), q only: pass h_kv) or None for a shape that is none."""
    shape = tuple(descale.shape)
    if descale.numel() == 1 and len(shape) <= 1:
        return "tensor"
    if shape == (b, h):
        return "head"
    if h_kv is not None and shape == (b, h_kv):
        return "kv_head"
    return None


def expand_descale(descale: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """The descale as a (b or 1, h or 1, 1, 1) factor of a (b, h, s, d) tensor; a (b, h_kv) descale of q (h > h_kv)
    repeats over each GQA group of h // h_kv heads."""
    d = descale.to(torch.float32) if descale.dtype != torch.float64 else descale
    if d.numel() == 1 and d.dim() <= 1:
        return d.reshape(1, 1, 1, 1)
    if d.shape[1] != h:
        d = d.repeat_interleave(h // d.shape[1], dim=1)
    return d.reshape(b, h, 1, 1)


def dequantize_heads(x8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x8.float() * descale (broadcast per its kind) in float32 (float64 for dtype float64), then cast to dtype."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    b, h = x8.shape[:2]
    return (x8.to(acc) * expand_descale(descale, b, h).to(acc)).to(dtype)


def quantize_heads(x: torch.Tensor, granularity: str = "head"):
    """(x_fp8 e4m3, descale float32) of a (b, h, s, d) tensor: descale amax / 448 per (batch, head) ("head":
    shape (b, h)) or per tensor ("tensor": shape ()); the module docstring's rule."""
    if granularity not in ("head", "tensor"):
        raise ValueError(f"granularity must be 'head' or 'tensor', got {granularity!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in (E4M3, torch.float8_e5m2):
        raise ValueError(f"x must be a float16 / bfloat16 / float32 / float64 tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
    a = torch.where(x.isfinite(), x.abs(), 0).detach().to(torch.float32)
    if granularity == "tensor":
        amax = a.amax() if a.numel() else a.new_zeros(())
    else:
        amax = a.amax(dim=(2, 3)) if a.shape[2] * a.shape[3] else a.new_zeros(a.shape[:2])
    descale = torch.where(amax > 0, amax / FMAX, torch.ones_like(amax))
    full = descale.reshape(1, 1, 1, 1) if granularity == "tensor" else descale[:, :, None, None]
    return (x.detach().to(torch.float32) / full).clamp_(-FMAX, FMAX).to(E4M3), descale


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, granularity: str = "head"):
    """(q8, k8, v8, q_descale, k_descale, v_descale) for fp8_attention: each tensor quantized per (batch, head)
    of its own heads (q per q head, k / v per kv head), or per tensor; quantize_heads' rule."""
    q8, qd = quantize_heads(q, granularity)
    k8, kd = quantize_heads(k, granularity)
    v8, vd = quantize_heads(v, granularity)
    return q8, k8, v8, qd, kd, vd


def fp8_attention_fwd(ctx, q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype):
    """The oracle: exact softmax attention of the dequantized inputs (float32; float64 for a float64 out_dtype),
    output in out_dtype, lse (b, h_q, s_q) natural log in the accumulation dtype."""
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[1], k.shape[1]
    qf = dequantize_heads(q, q_descale, acc)
    kf = dequantize_heads(k, k_descale, acc).repeat_interleave(hq // hkv, dim=1)
    vf = dequantize_heads(v, v_descale, acc).repeat_interleave(hq // hkv, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:      # bottom-right aligned: query i sees keys j <= i + s_k - s_q
        s = s.masked_fill(_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)                         # a row that sees no key: out 0, lse -inf
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return (p @ vf).to(out_dtype), lse


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where query i must not see key j (bottom-right aligned: j > i + s_k - s_q)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j > i + (sk - sq)


def fp8_attention_bwd(ctx, dout, q, k, v, q_descale, k_descale, v_descale, out, lse, causal, scale, *, acc=None):
    """(dq, dk, dv) in dout's dtype: the gradients with respect to the dequantized q, k, v, with the FP8 backward
    kernel's roundings (module docstring): P and dS rounded to dout's dtype where it is bf16 / fp16.  acc: the
    accumulation dtype (default float32; float64 for float64 dout); the tests pass float64 to compare the kernel's
    float32 arithmetic with an exact emulation of its roundings."""
    acc = acc or (torch.float64 if dout.dtype == torch.float64 else torch.float32)
    gemm = dout.dtype if dout.dtype in (torch.float16, torch.bfloat16) else None
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    rep = hq // hkv
    qf = dequantize_heads(q, q_descale, acc)
    kf = dequantize_heads(k, k_descale, acc).repeat_interleave(rep, dim=1)
    vf = dequantize_heads(v, v_descale, acc).repeat_interleave(rep, dim=1)
    do, o = dout.to(acc), out.to(acc)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(sq, sk, q.device), float("-inf"))
    lse_ = lse.to(acc)
    lse_ = torch.where(torch.isneginf(lse_), float("inf"), lse_)      # a row that saw no key: p = 0
    p = torch.exp(s - lse_[..., None])
    delta = (do * o).sum(-1, keepdim=True)

    def rounded(x):     # the GEMM operand dtype's rounding, back in acc
        return x.to(gemm).to(acc) if gemm is not None else x
    dv = rounded(p).transpose(-1, -2) @ do
    ds = p * (do @ vf.transpose(-1, -2) - delta)
    dsr = rounded(ds)
    dq = (dsr @ kf) * scale
    dk = (dsr.transpose(-1, -2) @ qf) * scale
    if rep > 1:         # GQA: a kv head's gradient sums its q heads'
        dk = dk.reshape(b, hkv, rep, sk, d).sum(2)
        dv = dv.reshape(b, hkv, rep, sk, d).sum(2)
    return dq.to(dout.dtype), dk.to(dout.dtype), dv.to(dout.dtype)
