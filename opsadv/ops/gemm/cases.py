"""Conformance cases of gemm and swiglu_gemm (odd shapes, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

from typing import Any

import torch

from opsadv.core.opdef import Case, rand


# ---- gemm ----------------------------------------------------------------------------------------
def _gemm(m, k, n, activation="none", bias=False, residual=False, alpha=1.0, batch=None, transposed_b=False):
    def build(dtype, device, g):
        lead = (batch, m) if batch else (m,)
        a = rand(lead + (k,), dtype, device, g)
        b = rand((n, k), dtype, device, g, k ** -0.5).t() if transposed_b else rand((k, n), dtype, device, g, k ** -0.5)
        kw: dict[str, Any] = {"activation": activation, "alpha": alpha}
        if bias:
            kw["bias"] = rand((n,), dtype, device, g)
        if residual:
            kw["residual"] = rand(lead + (n,), dtype, device, g)
        return (a, b), kw
    return build


CASES = [
    Case("gemm", "decode_m1", _gemm(1, 64, 32), (0, 1)),
    Case("gemm", "odd_bias_gelu_tanh", _gemm(3, 100, 48, "gelu_tanh", bias=True), (0, 1)),
    Case("gemm", "odd_silu_residual", _gemm(127, 96, 130, "silu", bias=True, residual=True), (0, 1)),
    Case("gemm", "relu_alpha", _gemm(17, 64, 64, "relu", alpha=0.5), (0, 1), quick=False),
    Case("gemm", "gelu_batched", _gemm(5, 64, 80, "gelu", bias=True, batch=2), (0, 1)),
    Case("gemm", "linear_weight_t", _gemm(33, 64, 40, "none", bias=True, transposed_b=True), (0, 1), quick=False),
]


def _swiglu(m, k, n, bias=False, batch=None):
    def build(dtype, device, g):
        lead = (batch, m) if batch else (m,)
        kw = {"bias": rand((2 * n,), dtype, device, g)} if bias else {}
        return (rand(lead + (k,), dtype, device, g), rand((k, 2 * n), dtype, device, g, k ** -0.5)), kw
    return build


SWIGLU_CASES = [
    Case("swiglu_gemm", "decode_m1", _swiglu(1, 64, 48), (0, 1)),
    Case("swiglu_gemm", "odd", _swiglu(127, 96, 65), (0, 1)),
    Case("swiglu_gemm", "batched_bias", _swiglu(3, 64, 40, bias=True, batch=2), (0, 1), quick=False),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s gemm call: bias + gelu_tanh epilogue."""
    m, k, n = (4096, 2048, 2048) if big else (100, 96, 80)
    return (rand((m, k), dtype, device, g), rand((k, n), dtype, device, g, k ** -0.5)), {
        "bias": rand((n,), dtype, device, g), "activation": "gelu_tanh"}


def demo_swiglu(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s swiglu_gemm call."""
    m, k, n = (4096, 2048, 2048) if big else (100, 96, 80)
    return (rand((m, k), dtype, device, g), rand((k, 2 * n), dtype, device, g, k ** -0.5)), {}
