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
