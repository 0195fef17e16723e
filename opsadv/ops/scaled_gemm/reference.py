"""FP8 scale conventions, the quantize / dequantize helpers and the scaled_gemm reference impl (the oracle).

Convention (the one torch._scaled_mm, cuBLASLt and DeepSeek-V3 use): a scale is the DEQUANTIZATION factor, float32,

    x ≈ x_fp8.float() * scale          (scale broadcast over its block)
    x_fp8 = clamp(float32(x) / scale, -FMAX, FMAX) rounded to nearest even in the fp8 dtype   (NaN stays NaN)
    scale = amax / FMAX                (amax: the largest finite |x| of the block; a block of zeros gets scale 1)

FMAX = 448 for float8_e4m3fn, 57344 for float8_e5m2.  Granularities (x a matrix (rows, cols); the scale's shape
says which one it is, scale_kind() infers it):

    "tensor"        one scale                        shape () (or (1,), (1, 1))
    "row"           one per row                      (rows, 1)                     a of a GEMM: per token
    "col"           one per column                   (1, cols)                     b (K, N) of a GEMM: per output channel
    "block1x128"    1 x 128 blocks along the columns  (rows, ceil(cols / 128))     a (M, K): per token and 128 of K
    "block128x128"  128 x 128 blocks                 (ceil(rows / 128), ceil(cols / 128))   b (K, N) (DeepSeek-V3 weights)

Round trip (quantize then dequantize), per element, up to float32's rounding of x / scale: e4m3 keeps 3 mantissa
bits, |x_fp8 * scale - x| <= 2^-4 |x| where |x| / scale >= 2^-6 (e4m3's smallest normal), else <= 2^-10 * scale;
e5m2 keeps 2, <= 2^-3 |x| where |x| / scale >= 2^-14, else <= 2^-17 * scale.  With scale = amax / FMAX nothing
clamps.

The reference scaled_gemm dequantizes both operands exactly to float32 (an fp8 value is exact in float32; the
scale multiply rounds once), multiplies in float32, applies the epilogue in float32 and casts to out_dtype; with
out_fp8 it quantizes the float32 result per tensor with the rule above (requantize)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opsadv.core.activations import ACT

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
BLOCK = 128                                 # the block edge of the block granularities
GRANULARITIES = ("tensor", "row", "col", "block1x128", "block128x128")

FEATURES = frozenset({"scale_a_tensor", "scale_a_row", "scale_a_block", "scale_b_tensor", "scale_b_col",
                      "scale_b_block", "a_e5m2", "b_e5m2", "bias", "residual", "act_relu", "act_gelu",
                      "act_gelu_tanh", "act_silu", "out_fp8", "out_e5m2", "b_row_major"})


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_kind(scale: torch.Tensor, rows: int, cols: int) -> str | None:
    """The granularity a scale's shape gives for a (rows, cols) matrix, or None when it fits none.  Where two
    granularities share a shape (a (rows, 1) scale with cols <= 128 is "row" and "block1x128") they mean the same
    thing, and the first in GRANULARITIES' order is returned."""
    shape = tuple(scale.shape)
    if scale.numel() == 1 and len(shape) <= 2:
        return "tensor"
    if len(shape) != 2:
        return None
    if shape == (rows, 1):
        return "row"
    if shape == (1, cols):
        return "col"
    if shape == (rows, _cdiv(cols, BLOCK)):
        return "block1x128"
    if shape == (_cdiv(rows, BLOCK), _cdiv(cols, BLOCK)):
        return "block128x128"
    return None


def expand_scale(scale: torch.Tensor, rows: int, cols: int, kind: str | None = None) -> torch.Tensor:
    """The scale broadcast to every element of a (rows, cols) matrix (a view where it can be: a stride-0 expand
    for tensor / row / col; block scales are repeated 128 times along the blocked dims)."""
    kind = kind or scale_kind(scale, rows, cols)
    if kind == "tensor":
        return scale.reshape(1, 1).expand(rows, cols)
    if kind in ("row", "col"):
        return scale.expand(rows, cols)
    if kind == "block1x128":
        return scale.repeat_interleave(BLOCK, dim=1)[:, :cols]
    if kind == "block128x128":
        return scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :cols]
    raise ValueError(f"scale of shape {tuple(scale.shape)} fits no granularity of a ({rows}, {cols}) matrix")


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.isfinite(), x.abs(), 0)


def _amax_blocks(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """amax of the finite |x| per block of the granularity, float32, shaped as the granularity's scale."""
    a = _finite_abs(x.detach()).to(torch.float32)
    if granularity == "tensor":
        return a.amax() if a.numel() else a.new_zeros(())
    rows, cols = a.shape
    if granularity == "row":
        return a.amax(dim=1, keepdim=True) if cols else a.new_zeros((rows, 1))
    if granularity == "col":
        return a.amax(dim=0, keepdim=True) if rows else a.new_zeros((1, cols))
    br = BLOCK if granularity == "block128x128" else 1
    pr, pc = _cdiv(rows, br) * br - rows, _cdiv(cols, BLOCK) * BLOCK - cols
    a = F.pad(a, (0, pc, 0, pr))                                   # zero padding: |0| never raises an amax
    nr, nc = a.shape[0] // br, a.shape[1] // BLOCK
    if a.numel() == 0:
        return a.new_zeros((nr, nc))
    return a.reshape(nr, br, nc, BLOCK).amax(dim=(1, 3))


def check_fp8_dtype(dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return FP8_MAX[dtype]


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """amax / FMAX, float32; 1 where amax is 0 (a block of zeros quantizes to zeros with any scale)."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, amax / check_fp8_dtype(dtype), 1.0)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3,
                        kind: str | None = None) -> torch.Tensor:
    """x (rows, cols) (or any shape with a "tensor" scale) in fp8 under a given scale: clamp(float32(x) / scale,
    -FMAX, FMAX) rounded to nearest even; NaN stays NaN, +-inf clamps to +-FMAX."""
    fmax = check_fp8_dtype(dtype)
    xf = x.to(torch.float32)
    if scale.numel() == 1:
        s = scale.to(torch.float32).reshape(())
    else:
        s = expand_scale(scale.to(torch.float32), *x.shape, kind)
    return (xf / s).clamp_(-fmax, fmax).to(dtype)


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor", dtype: torch.dtype = E4M3):
    """(x_fp8, scale) with scale = amax / FMAX per block of `granularity` (one of GRANULARITIES; "tensor" takes
    any shape, the others a matrix) and x_fp8 = clamp(float32(x) / scale, -FMAX, FMAX) rounded to nearest even:
    the module docstring's convention, so x ≈ dequantize_fp8(x_fp8, scale).  For scaled_gemm(a, b, ...): a (M, K)
    takes "tensor", "row" or "block1x128"; b (K, N) takes "tensor", "col" or "block128x128"."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise ValueError(f"x must be a float16 / bfloat16 / float32 / float64 tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if granularity != "tensor" and x.dim() != 2:
        raise ValueError(f"granularity {granularity!r} takes a matrix (rows, cols); got shape {tuple(x.shape)}")
    scale = scale_from_amax(_amax_blocks(x, granularity), dtype)
    return quantize_with_scale(x, scale, dtype, granularity if granularity != "tensor" else None), scale


def dequantize_fp8(x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_fp8.float() * scale, the scale broadcast per its granularity (inferred from its shape: scale_kind),
    in float32, then cast to dtype."""
    if x_fp8.dtype not in FP8_DTYPES:
        raise ValueError(f"x_fp8 must be float8_e4m3fn or float8_e5m2, got {x_fp8.dtype}")
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return (x_fp8.to(torch.float32) * s.reshape(())).to(dtype)
    if x_fp8.dim() != 2 or scale_kind(s, *x_fp8.shape) is None:
        raise ValueError(f"scale of shape {tuple(scale.shape)} fits no granularity of x_fp8 of shape "
                         f"{tuple(x_fp8.shape)} (module docstring: opsadv.ops.scaled_gemm.reference)")
    return (x_fp8.to(torch.float32) * expand_scale(s, *x_fp8.shape)).to(dtype)


def requantize(y: torch.Tensor, dtype: torch.dtype):
    """The out_fp8 result of a float32 epilogue value y: (y_fp8, y_scale), one scale for the tensor (amax of the
    finite |y| / FMAX)."""
    scale = scale_from_amax(_amax_blocks(y, "tensor"), dtype)
    return quantize_with_scale(y, scale, dtype), scale


def epilogue(z: torch.Tensor, bias, activation: str, residual) -> torch.Tensor:
    """activation(z + bias) + residual in z's dtype (float32 here)."""
    if bias is not None:
        z = z + bias.to(z.dtype)
    y = ACT[activation](z)
    if residual is not None:
        y = y + residual.to(z.dtype)
    return y


def scaled_gemm_fwd(ctx, a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8):
    """The oracle: dequantize to float32, matmul, epilogue, then cast (or requantize with out_fp8)."""
    m, k = a.shape
    n = b.shape[1]
    af = a.to(torch.float32) * expand_scale(a_scale.to(torch.float32), m, k)
    bf = b.to(torch.float32) * expand_scale(b_scale.to(torch.float32), k, n)
    y = epilogue(af @ bf, bias, activation, residual)
    if out_fp8 is not None:
        return requantize(y, out_fp8)
    return y.to(out_dtype), None


# ---- scaled_swiglu_gemm ------------------------------------------------------------------------------------
SWIGLU_FEATURES = frozenset({"scale_a_tensor", "scale_a_row", "scale_a_block", "scale_b_tensor", "scale_b_col",
                             "scale_b_block", "a_e5m2", "b_e5m2", "bias", "act_gelu_tanh", "out_fp8", "out_e5m2",
                             "b_row_major"})


def scaled_swiglu_gemm_fwd(ctx, x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype, out_fp8):
    """The oracle of scaled_swiglu_gemm: both operands dequantized exactly into float64 (an fp8 value times a float32
    scale is exact there), [g | u] = x @ w_gate_up + bias in float64, act(g) * u, then cast to out_dtype, or with
    out_fp8 the float32 value requantized per tensor (requantize)."""
    m, k = x.shape
    n2 = w_gate_up.shape[1]
    xd = x.to(torch.float64) * expand_scale(x_scale.to(torch.float64), m, k)
    wd = w_gate_up.to(torch.float64) * expand_scale(w_scale.to(torch.float64), k, n2)
    gu = xd @ wd
    if bias is not None:
        gu = gu + bias.to(torch.float64)
    g, u = gu[:, :n2 // 2], gu[:, n2 // 2:]
    y = ACT[activation](g) * u
    if out_fp8 is not None:
        return requantize(y.to(torch.float32), out_fp8)
    return y.to(out_dtype), None
