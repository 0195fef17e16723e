"""scaled_gemm (FP8) through cuBLASLt: torch._scaled_mm, then the rest of the epilogue in torch.

Impls:
  cuda.cublas.scaled_gemm        300  per-tensor and row-wise (a (M, 1) x b (1, N)) scales; a per-tensor scale
                                      paired with a row / column one is expanded to row-wise (a copy of M or N floats)
  cuda.cublas.scaled_gemm_block  150  a 1x128 x b 128x128 block scales (cuBLASLt 12.9+, torch >= 2.9); ranked below
                                      the Triton kernel until measured

What torch._scaled_mm takes (aten/src/ATen/native/cuda/ScaledBlas.cpp, Blas.cpp before 2.9), declared here so the
dispatcher refuses with the reason instead of the call failing:
  - compute capability >= 8.9; a row-major, b column-major (b.t() contiguous: an nn.Linear weight W passed as
    W.t()); a is made contiguous here when it is not (a copy), a row-major b is refused (copying a weight per call
    would hide its cost);
  - K and N multiples of 16 (M any);
  - not both operands e5m2;
  - row-wise scales: float32 (M, 1) and (1, N), contiguous; bfloat16 output (the CUTLASS row-wise kernel torch
    uses below cuBLAS 12.9 writes only bf16) and e4m3 operands (that kernel's types);
  - bias: bf16 / fp16 of the output's dtype, never with a float32 output: fused only for per-tensor scales with a
    bias of the output dtype, otherwise added after in torch, as the activation and the residual are (unfused:
    one more pass over the output each);
  - block scales: a_scale (M, K/128) outer-dim-major and b_scale (K/128, N/128) passed transposed-contiguous
    (copies of the scales, K/128 x (M + N/128) floats).
out_fp8: _scaled_mm writes float32, the epilogue runs in torch, then the reference's requantize (amax, divide,
cast: three more passes)."""
from __future__ import annotations

import torch

from opsadv.core.activations import ACT
from opsadv.core.kernel import PRIORITY_GENERIC, PRIORITY_VENDOR, KernelImpl, temporaries
from opsadv.ops.scaled_gemm.reference import requantize

FP8_MIN_CC = (8, 9)
BLOCK_MIN_TORCH = (2, 9)
_ROW = {"scale_a_row", "scale_b_col"}
_BLOCK = {"scale_a_block", "scale_b_block"}
_EPILOGUE = frozenset({"bias", "residual", "act_relu", "act_gelu", "act_gelu_tanh", "act_silu", "out_fp8",
                       "out_e5m2"})


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _common_reasons(spec) -> list[str]:
    (m, k), (_, n) = spec.shapes
    why = []
    if k % 16 or n % 16:
        why.append(f"torch._scaled_mm needs K and N multiples of 16, got K={k} N={n}")
    if {"a_e5m2", "b_e5m2"} <= spec.features:
        why.append("cuBLASLt does not multiply two e5m2 operands")
    return why


def _check(spec, env) -> list[str]:
    why = _common_reasons(spec)
    f = spec.features
    if f & _BLOCK:
        why.append("block scales: cuda.cublas.scaled_gemm_block")
    if f & _ROW:
        if spec.dtype != torch.bfloat16 or "out_fp8" in f:
            why.append("row-wise scales: bfloat16 output only (torch's CUTLASS row-wise kernel)")
        if f & {"a_e5m2", "b_e5m2"}:
            why.append("row-wise scales: e4m3 operands only (torch's CUTLASS row-wise kernel)")
    return why


def _block_check(spec, env) -> list[str]:
    why = _common_reasons(spec)
    if not {"scale_a_block", "scale_b_block"} <= spec.features:
        why.append("cuBLASLt pairs a 1x128 a_scale with a 128x128 b_scale only (both block)")
    if _torch_version() < BLOCK_MIN_TORCH:
        why.append(f"block-scaled torch._scaled_mm needs torch >= {BLOCK_MIN_TORCH[0]}.{BLOCK_MIN_TORCH[1]}, "
                   f"this is {torch.__version__}")
    return why


def _epilogue(y, bias, activation, residual, out_dtype, out_fp8):
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = ACT[activation](y)
    if residual is not None:
        y = y + residual.to(y.dtype)
    if out_fp8 is not None:
        return requantize(y, out_fp8)
    return y.to(out_dtype), None


def _scaled_mm(ctx, a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8):
    m, n = a.shape[0], b.shape[1]
    a = a if a.is_contiguous() else a.contiguous()
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        sa, sb = a_scale.reshape(()), b_scale.reshape(())
    else:               # row-wise: a per-tensor scale paired with a row / column one becomes row-wise too
        sa = a_scale.reshape(-1, 1).expand(m, 1).contiguous()
        sb = b_scale.reshape(1, -1).expand(1, n).contiguous()
    tensorwise = sa.dim() == 0
    dtype = torch.float32 if out_fp8 is not None else out_dtype
    fuse_bias = bias is not None and tensorwise and bias.dtype == dtype and dtype != torch.float32
    y = torch._scaled_mm(a, b, sa, sb, bias=bias if fuse_bias else None, out_dtype=dtype)
    return _epilogue(y, None if fuse_bias else bias, activation, residual, out_dtype, out_fp8)


def _scaled_mm_block(ctx, a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8):
    a = a if a.is_contiguous() else a.contiguous()
    sa = a_scale.t().contiguous().t()            # (M, K/128), outer-dim-major
    sb = b_scale.t().contiguous().t()            # (K/128, N/128) as the transpose of a row-major (N/128, K/128)
    dtype = torch.float32 if out_fp8 is not None else out_dtype
    y = torch._scaled_mm(a, b, sa, sb, out_dtype=dtype)
    return _epilogue(y, bias, activation, residual, out_dtype, out_fp8)


FEATURES = frozenset({"scale_a_tensor", "scale_a_row", "scale_b_tensor", "scale_b_col", "a_e5m2", "b_e5m2"}) | _EPILOGUE


def impls(env) -> list[KernelImpl]:
    common = dict(op="scaled_gemm", backend="cuda", dtypes=(torch.bfloat16, torch.float16, torch.float32),
                  min_cc=FP8_MIN_CC, memory=temporaries(1.0), honours=frozenset())
    return [
        KernelImpl("cuda.cublas.scaled_gemm", fn=_scaled_mm, priority=PRIORITY_VENDOR, features=FEATURES,
                   check=_check, description="cuBLASLt FP8 GEMM through torch._scaled_mm (per-tensor / row-wise "
                   "scales; bias fused for per-tensor scales, activation / residual / fp8 requantize in torch)",
                   **common),
        KernelImpl("cuda.cublas.scaled_gemm_block", fn=_scaled_mm_block, priority=PRIORITY_GENERIC + 50,
                   features=frozenset({"scale_a_block", "scale_b_block", "b_e5m2", "a_e5m2"}) | _EPILOGUE,
                   check=_block_check, description="cuBLASLt FP8 GEMM with 1x128 x 128x128 block scales through "
                   "torch._scaled_mm (cuBLAS 12.9+), epilogue in torch; below the Triton kernel until measured",
                   **common),
    ]
