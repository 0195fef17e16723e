"""What scaled_gemm and scaled_swiglu_gemm share: the scale granularities as call features, the fp8-output option,
the operand checks (each op names its own arguments in its errors) and the scales' value check."""
from __future__ import annotations

import torch

from opsadv.core.errors import InvalidArgumentError
from opsadv.core.op_common import check_tensor, dt

from .reference import BLOCK, E4M3, FP8_DTYPES, scale_kind

A_KINDS = {"tensor": "tensor", "row": "row", "block1x128": "block"}          # a_scale granularity -> feature
B_KINDS = {"tensor": "tensor", "col": "col", "block128x128": "block"}        # b_scale granularity -> feature


def a_scale_kind(s, m: int, k: int) -> str | None:
    """a_scale's granularity as a feature word ("tensor", "row", "block"), None for a shape a takes none of."""
    return A_KINDS.get(scale_kind(s, m, k) or "")


def b_scale_kind(s, k: int, n: int) -> str | None:
    """b_scale's granularity as a feature word ("tensor", "col", "block"), None for a shape b takes none of."""
    return B_KINDS.get(scale_kind(s, k, n) or "")


def out_fp8_dtype(out_fp8):
    """None (no fp8 output) or the fp8 dtype out_fp8 asks for."""
    if out_fp8 is False or out_fp8 is None:
        return None
    if out_fp8 is True:
        return E4M3
    return out_fp8


def b_col_major(b: torch.Tensor) -> bool:
    """b (K, N) is column-major: b.t() is a contiguous (N, K) matrix (an nn.Linear weight passed as W.t())."""
    k, n = b.shape
    return (b.stride(0) == 1 or k <= 1) and (b.stride(1) == k or n <= 1)


def check_operands(op: str, a, b, a_scale, b_scale, names=("a", "b", "a_scale", "b_scale"),
                   b_what: str = "b") -> tuple[str, str]:
    """a (M, K) and b (K, N) fp8 matrices with float32 scales of a granularity each takes, block scales only with K
    a multiple of 128; returns the (a, b) granularities.  names: the op's names of the four arguments; b_what: how
    an error describes b's columns (scaled_swiglu_gemm: "w_gate_up")."""
    na, nb, nsa, nsb = names
    check_tensor(op, na, a, ndim=2, dtypes=FP8_DTYPES, allow_empty=True)
    check_tensor(op, nb, b, ndim=2, dtypes=FP8_DTYPES, allow_empty=True)
    m, k = a.shape
    if b.shape[0] != k:
        raise InvalidArgumentError(op, nb, f"shape (K, {'2N' if b_what != 'b' else 'N'}) with K = {k} ({na}'s last "
                                   "dim)", tuple(b.shape))
    n = b.shape[1]
    for name, s in ((nsa, a_scale), (nsb, b_scale)):
        check_tensor(op, name, s, dtypes=(torch.float32,), allow_empty=True)
    ga, gb = a_scale_kind(a_scale, m, k), b_scale_kind(b_scale, k, n)
    if ga is None:
        raise InvalidArgumentError(op, nsa, f"float32 of shape () or (1,) (per tensor), ({m}, 1) (per row) or "
                                   f"({m}, {-(-k // BLOCK)}) (1x128 blocks along K) for {na} of shape ({m}, {k})",
                                   f"shape {tuple(a_scale.shape)}")
    if gb is None:
        raise InvalidArgumentError(op, nsb, f"float32 of shape () or (1,) (per tensor), (1, {n}) (per column) "
                                   f"or ({-(-k // BLOCK)}, {-(-n // BLOCK)}) (128x128 blocks) for {nb} of shape "
                                   f"({k}, {n})", f"shape {tuple(b_scale.shape)}")
    if "block" in (ga, gb) and k % BLOCK:
        raise InvalidArgumentError(op, nsa if ga == "block" else nsb,
                                   f"per-tensor, row or column scales: block scales need K a multiple of {BLOCK}",
                                   f"K = {k} with {na if ga == 'block' else nb} block scales")
    return ga, gb


def check_out(op: str, out_dtype, out_fp8, out_dtypes) -> None:
    if out_dtype not in out_dtypes:
        raise InvalidArgumentError(op, "out_dtype", f"one of {[dt(d) for d in out_dtypes]} (an fp8 output: "
                                   "out_fp8=True)", repr(out_dtype))
    if not (out_fp8 is True or out_fp8 is False or out_fp8 is None or out_fp8 in FP8_DTYPES):
        raise InvalidArgumentError(op, "out_fp8", "False, True (float8_e4m3fn) or torch.float8_e4m3fn / "
                                   "torch.float8_e5m2", repr(out_fp8))


def check_devices(op: str, ref_name: str, ref, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise InvalidArgumentError(op, name, f"on device {ref.device} (same as {ref_name})", str(t.device))


def check_values(op: str, **scales) -> None:
    """The scales' values (CPU tensors only: a GPU check would sync every call)."""
    for name, s in scales.items():
        if s.device.type == "cpu" and s.numel() and not bool(((s > 0) & s.isfinite()).all()):
            bad = s[~((s > 0) & s.isfinite())].reshape(-1)[0].item()
            raise InvalidArgumentError(op, name, "finite scales > 0 (dequantization factors: x = x_fp8 * scale)",
                                       f"a value {bad}")


def refuse_grad(op: str, **tensors) -> None:
    """Forward-only ops: inputs that require grad (with grad enabled) are refused."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise InvalidArgumentError(op, name, f"a tensor that does not require grad ({op} is forward only: "
                                       "run it under torch.no_grad(), or detach)", "requires_grad=True")
