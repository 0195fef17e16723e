"""Conformance cases of scaled_gemm: fp8 operands and their scales kept as built (Case.kept: the storage format, not
a precision to cast).  Every argument is kept, so the reference runs the same call: the case's dtype is the output
dtype (float64 cells run float32 out, the widest the op writes), and the comparison measures the kernel's
accumulation and rounding against the reference's."""
from __future__ import annotations

import torch

from opsadv.core.opdef import Case

from .reference import E4M3, E5M2, quantize_fp8

_KEPT = frozenset({0, 1, 2, 3, "bias", "residual"})


def _gemm(m, k, n, ga, gb, *, db=E4M3, bias=False, residual=False, activation="none"):
    def build(dtype, device, g):
        out = torch.float32 if dtype == torch.float64 else dtype
        # per-row / per-column magnitudes that differ, so a scale applied to the wrong row or column shows
        a = torch.randn(m, k, generator=g, dtype=torch.float64) * 2.0 ** (torch.arange(m) % 5 - 2.0)[:, None]
        b = torch.randn(k, n, generator=g, dtype=torch.float64) * 2.0 ** (torch.arange(n) % 3 - 1.0)[None, :]
        a8, sa = quantize_fp8(a, ga)
        b8, sb = quantize_fp8(b, gb, db)
        b8 = b8.t().contiguous().t()                     # column-major b, the layout cuBLASLt takes
        kw = {"activation": activation, "out_dtype": out}
        if bias:
            kw["bias"] = torch.randn(n, generator=g).to(device=device, dtype=out)
        if residual:
            kw["residual"] = torch.randn(m, n, generator=g).to(device=device, dtype=out)
        return tuple(t.to(device) for t in (a8, b8, sa, sb)), kw
    return build


CASES = [
    Case("scaled_gemm", "tensor_scales_bias_gelu", _gemm(37, 128, 48, "tensor", "tensor", bias=True,
                                                         activation="gelu_tanh"), (), kept=_KEPT),
    Case("scaled_gemm", "row_col_residual", _gemm(1, 256, 80, "row", "col", residual=True), (), kept=_KEPT),
    Case("scaled_gemm", "block_scales", _gemm(127, 256, 160, "block1x128", "block128x128", activation="silu"), (),
         kept=_KEPT),
    Case("scaled_gemm", "e5m2_b_row_block", _gemm(3, 384, 64, "row", "block128x128", db=E5M2, bias=True), (),
         kept=_KEPT, quick=False),
]


# ---- scaled_swiglu_gemm -------------------------------------------------------------------------------------
_SWIGLU_KEPT = frozenset({0, 1, 2, 3, "bias"})


def _swiglu(m, k, n, gx, gw, *, dw=E4M3, bias=False, activation="silu", w_row_major=False, x_strided=False):
    """x (m, k) and w_gate_up (k, 2n) = [W_g | W_u] (column-major: a fused gate_up Linear weight's .t())."""
    def build(dtype, device, g):
        out = torch.float32 if dtype == torch.float64 else dtype
        x = torch.randn(m, k, generator=g, dtype=torch.float64) * 2.0 ** (torch.arange(m) % 5 - 2.0)[:, None]
        # per-column magnitudes that differ between the gate and the up half, so a pairing or scale mix-up shows
        w = torch.randn(k, 2 * n, generator=g, dtype=torch.float64) * k ** -0.5
        w = w * 2.0 ** (torch.arange(2 * n) % 3 - 1.0 + (torch.arange(2 * n) >= n))[None, :]
        x8, sx = quantize_fp8(x, gx)
        w8, sw = quantize_fp8(w, gw, dw)
        if not w_row_major:
            w8 = w8.t().contiguous().t()
        if x_strided:                                   # rows of a wider buffer (row stride 2k)
            x8 = torch.cat((x8.view(torch.uint8), x8.view(torch.uint8)), dim=1).view(x8.dtype)[:, :k]
        kw = {"activation": activation, "out_dtype": out}
        if bias:
            kw["bias"] = torch.randn(2 * n, generator=g).to(device=device, dtype=out)
        return tuple(t.to(device) for t in (x8, w8, sx, sw)), kw
    return build


SWIGLU_CASES = [
    Case("scaled_swiglu_gemm", "decode_m1_tensor_bias", _swiglu(1, 128, 48, "tensor", "tensor", bias=True), (),
         kept=_SWIGLU_KEPT),
    Case("scaled_swiglu_gemm", "odd_row_col_geglu", _swiglu(127, 96, 40, "row", "col", activation="gelu_tanh",
                                                            x_strided=True), (), kept=_SWIGLU_KEPT),
    # N = 72: a 128-column block of w's scales spans the last gate and the first up columns
    Case("scaled_swiglu_gemm", "block_scales", _swiglu(3, 256, 72, "block1x128", "block128x128", bias=True), (),
         kept=_SWIGLU_KEPT),
    Case("scaled_swiglu_gemm", "e5m2_w_row_major", _swiglu(33, 128, 80, "row", "col", dw=E5M2, w_row_major=True), (),
         kept=_SWIGLU_KEPT, quick=False),
]
