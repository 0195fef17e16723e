"""scaled_gemm: an FP8 GEMM with dequantization scales and gemm's fused epilogue, forward only.

    out = scaled_gemm(a, b, a_scale, b_scale, *, bias=None, activation="none", residual=None,
                      out_dtype=torch.bfloat16, out_fp8=False)
    out = activation((a_fp8 * a_scale) @ (b_fp8 * b_scale) + bias) + residual

Why an op of its own rather than fp8 dtypes inside gemm: the scales are two more tensor arguments whose shapes
carry the granularity, the output dtype is not the inputs' (and may be fp8 with a scale of its own: two outputs),
there is no autograd (an FP8 training step calls it once per GEMM: the forward on e4m3, the gradient GEMMs with an
e5m2 operand), and every impl needs a different set of checks (cuBLASLt's layout and alignment rules).  Folding it
into gemm would have put every one of these into gemm's hot path and its schema.

- a (M, K), b (K, N): float8_e4m3fn or float8_e5m2, any strides (b column-major, i.e. an nn.Linear weight W (N, K)
  passed as W.t(), is the layout cuBLASLt takes and the Triton kernel reads fastest).
- a_scale, b_scale: float32 DEQUANTIZATION scales (a ≈ a_fp8.float() * a_scale; reference.py states the
  convention and quantize_fp8 / dequantize_fp8 follow it), granularity inferred from the shape:
      a_scale: () / (1,) / (1, 1) per tensor;  (M, 1) per row (token);  (M, K / 128) 1x128 blocks along K
      b_scale: () / (1,) / (1, 1) per tensor;  (1, N) per column (output channel);  (K / 128, ceil(N / 128))
               128x128 blocks (DeepSeek-V3's weights)
  Any a granularity pairs with any b granularity.  Block scales need K a multiple of 128.  Values must be finite
  and > 0 (checked for CPU tensors in eager calls only: a GPU check would sync every call).
- bias (N,), residual (M, N): float16 / bfloat16 / float32.  activation: gemm's ("none", "relu", "gelu",
  "gelu_tanh", "silu"), applied after the bias, before the residual add, in float32.
- out_dtype: bfloat16 (default), float16 or float32.
- out_fp8: False, True (float8_e4m3fn) or a float8 dtype: returns (y_fp8, y_scale) instead of out, y ≈
  y_fp8.float() * y_scale with ONE scale per tensor (float32, shape ()) from this call's result ("current
  scaling"): y_scale = amax(|y|) / FMAX (448 for e4m3, 57344 for e5m2; amax over finite values, 1 when y is all
  zero), y_fp8 = clamp(y / y_scale, -FMAX, FMAX) rounded to nearest even, y the float32 epilogue value.  The
  scale depends on every tile, so no single pass can apply it: the Triton kernel keeps each tile's float32 y in a
  workspace (4 bytes x M x N) and reduces the tiles' amax with an atomic max into one float32; a second
  elementwise pass divides and casts.  (Delayed scaling, a scale known before the call, would quantize in the
  epilogue itself: not offered yet.)
- No gradients: inputs that require grad (with grad enabled) are refused.

Impl contract:
  fn(ctx, a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8) -> (out, out_scale)
      out_fp8: None or the fp8 dtype; out_scale: a float32 () tensor with out_fp8, else None.
CallSpec: dtype = out_dtype (float32 with out_fp8: the epilogue's dtype); features: scale_a_{tensor,row,block},
scale_b_{tensor,col,block}, a_e5m2 / b_e5m2, bias, residual, act_<name>, out_fp8 / out_e5m2, and b_row_major
where b is not column-major (cuBLASLt refuses it); bucket (rows<=, K=, N=).

Not in the conformance catalogue: its runner casts every floating input to the case dtype (the oracle's float64,
the baseline's dtype), which would turn the fp8 operands into bf16 / float64 ones this op refuses; tests/
test_scaled_gemm.py holds the same comparisons against a float64 oracle on the dequantized operands."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import TOLERANCE as _DEFAULT_TOLERANCE, OpDef, Reference, arg
from opsadv.core.op_common import TORCH_OPS, check_choice, check_tensor, dt, eager_mode, len_bucket
from opsadv.core.policy import in_scope, op_scope

from . import cases as _cases, reference as _reference
from .reference import (BLOCK, E4M3, E5M2, FP8_DTYPES, FP8_MAX, GRANULARITIES,  # noqa: F401  (public helpers)
                        dequantize_fp8, quantize_fp8, quantize_with_scale, scale_from_amax, scale_kind)

OP = "scaled_gemm"
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPILOGUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
A_KINDS = {"tensor": "tensor", "row": "row", "block1x128": "block"}          # a_scale granularity -> feature
B_KINDS = {"tensor": "tensor", "col": "col", "block128x128": "block"}        # b_scale granularity -> feature


def _a_scale_kind(s, m: int, k: int) -> str | None:
    """a_scale's granularity as a feature word ("tensor", "row", "block"), None for a shape a takes none of."""
    return A_KINDS.get(scale_kind(s, m, k) or "")


def _b_scale_kind(s, k: int, n: int) -> str | None:
    """b_scale's granularity as a feature word ("tensor", "col", "block"), None for a shape b takes none of."""
    return B_KINDS.get(scale_kind(s, k, n) or "")


def _out_fp8_dtype(out_fp8):
    """None (no fp8 output) or the fp8 dtype out_fp8 asks for."""
    if out_fp8 is False or out_fp8 is None:
        return None
    if out_fp8 is True:
        return E4M3
    return out_fp8


def _b_col_major(b: Tensor) -> bool:
    """b (K, N) is column-major: b.t() is a contiguous (N, K) matrix (an nn.Linear weight passed as W.t())."""
    k, n = b.shape
    return (b.stride(0) == 1 or k <= 1) and (b.stride(1) == k or n <= 1)


def validate(a, b, a_scale, b_scale, bias=None, activation="none", residual=None, out_dtype=torch.bfloat16,
             out_fp8=False) -> tuple[str, str]:
    """Shapes, dtypes, devices and options (no tensor value is read); returns the (a, b) scale granularities."""
    check_tensor(OP, "a", a, ndim=2, dtypes=FP8_DTYPES, allow_empty=True)
    check_tensor(OP, "b", b, ndim=2, dtypes=FP8_DTYPES, allow_empty=True)
    m, k = a.shape
    if b.shape[0] != k:
        raise InvalidArgumentError(OP, "b", f"shape (K, N) with K = {k} (a's last dim)", tuple(b.shape))
    n = b.shape[1]
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        check_tensor(OP, name, s, dtypes=(torch.float32,), allow_empty=True)
    ga, gb = _a_scale_kind(a_scale, m, k), _b_scale_kind(b_scale, k, n)
    if ga is None:
        raise InvalidArgumentError(OP, "a_scale", f"float32 of shape () or (1,) (per tensor), ({m}, 1) (per row) or "
                                   f"({m}, {-(-k // BLOCK)}) (1x128 blocks along K) for a of shape ({m}, {k})",
                                   f"shape {tuple(a_scale.shape)}")
    if gb is None:
        raise InvalidArgumentError(OP, "b_scale", f"float32 of shape () or (1,) (per tensor), (1, {n}) (per column) "
                                   f"or ({-(-k // BLOCK)}, {-(-n // BLOCK)}) (128x128 blocks) for b of shape "
                                   f"({k}, {n})", f"shape {tuple(b_scale.shape)}")
    if "block" in (ga, gb) and k % BLOCK:
        raise InvalidArgumentError(OP, "a_scale" if ga == "block" else "b_scale",
                                   f"per-tensor, row or column scales: block scales need K a multiple of {BLOCK}",
                                   f"K = {k} with {'a' if ga == 'block' else 'b'} block scales")
    if bias is not None:
        check_tensor(OP, "bias", bias, ndim=1, dtypes=EPILOGUE_DTYPES, allow_empty=True)
        if bias.shape[0] != n:
            raise InvalidArgumentError(OP, "bias", f"shape ({n},)", tuple(bias.shape))
    check_choice(OP, "activation", activation, ACTIVATIONS)
    if residual is not None:
        check_tensor(OP, "residual", residual, ndim=2, dtypes=EPILOGUE_DTYPES, allow_empty=True)
        if tuple(residual.shape) != (m, n):
            raise InvalidArgumentError(OP, "residual", f"shape ({m}, {n}) (the output's)", tuple(residual.shape))
    if out_dtype not in OUT_DTYPES:
        raise InvalidArgumentError(OP, "out_dtype", f"one of {[dt(d) for d in OUT_DTYPES]} (an fp8 output: "
                                   "out_fp8=True)", repr(out_dtype))
    if not (out_fp8 is True or out_fp8 is False or out_fp8 is None or out_fp8 in FP8_DTYPES):
        raise InvalidArgumentError(OP, "out_fp8", "False, True (float8_e4m3fn) or torch.float8_e4m3fn / "
                                   "torch.float8_e5m2", repr(out_fp8))
    for name, t in (("b", b), ("a_scale", a_scale), ("b_scale", b_scale), ("bias", bias), ("residual", residual)):
        if t is not None and t.device != a.device:
            raise InvalidArgumentError(OP, name, f"on device {a.device} (same as a)", str(t.device))
    return ga, gb


def check_values(a_scale, b_scale) -> None:
    """The scales' values (CPU tensors only)."""
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if s.device.type == "cpu" and s.numel() and not bool(((s > 0) & s.isfinite()).all()):
            bad = s[~((s > 0) & s.isfinite())].reshape(-1)[0].item()
            raise InvalidArgumentError(OP, name, "finite scales > 0 (dequantization factors: x = x_fp8 * scale)",
                                       f"a value {bad}")


def features(a, b, ga, gb, bias, activation, residual, fp8) -> frozenset[str]:
    f = {f"scale_a_{ga}", f"scale_b_{gb}"}
    f |= {name for name, on in (("a_e5m2", a.dtype == E5M2), ("b_e5m2", b.dtype == E5M2), ("bias", bias is not None),
                                ("residual", residual is not None), ("out_fp8", fp8 is not None),
                                ("out_e5m2", fp8 == E5M2), ("b_row_major", not _b_col_major(b))) if on}
    if activation != "none":
        f.add(f"act_{activation}")
    return frozenset(f)


def _key(a, b, ga, gb, bias, activation, residual, out_dtype, fp8) -> tuple:
    k, n = b.shape
    return (OP, device_key(a), a.dtype, b.dtype, ga, gb, None if bias is None else bias.dtype, activation,
            None if residual is None else residual.dtype, out_dtype, fp8, _b_col_major(b), len_bucket(a.shape[0]),
            k, n)


def _spec(a, b, ga, gb, bias, activation, residual, out_dtype, fp8) -> CallSpec:
    k, n = b.shape
    return CallSpec(OP, a.device.type, torch.float32 if fp8 is not None else out_dtype,
                    features(a, b, ga, gb, bias, activation, residual, fp8), (len_bucket(a.shape[0]), k, n),
                    shapes=(tuple(a.shape), tuple(b.shape)), bucket_names=("rows<=", "K=", "N="),
                    device_index=device_index(a))


def _route(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, fp8, ga, gb):
    args = (a, b, a_scale, b_scale, bias, activation, residual, out_dtype, fp8)
    return dispatch.call(_key(a, b, ga, gb, bias, activation, residual, out_dtype, fp8),
                         lambda: _spec(a, b, ga, gb, bias, activation, residual, out_dtype, fp8), args)


def _no_scale(a) -> Tensor:
    return a.new_ones((), dtype=torch.float32)


@torch.library.custom_op("opsadv::scaled_gemm", mutates_args=())
def _scaled_gemm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, bias: Optional[Tensor], activation: str,
                 residual: Optional[Tensor], out_dtype: torch.dtype, out_fp8: Optional[torch.dtype],
                 scope: int = 0) -> tuple[Tensor, Tensor]:
    """(out, out_scale); out_scale is 1 without out_fp8.  scope: the converted model's scope id (core.policy)."""
    with in_scope(scope):
        ga, gb = _a_scale_kind(a_scale, *a.shape), _b_scale_kind(b_scale, *b.shape)
        out, scale = _route(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8, ga, gb)
        return out, (scale if scale is not None else _no_scale(a))


@_scaled_gemm.register_fake
def _(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8, scope=0):
    return (a.new_empty((a.shape[0], b.shape[1]), dtype=out_fp8 if out_fp8 is not None else out_dtype),
            a.new_empty((), dtype=torch.float32))


def _no_backward(ctx, dout, dscale):
    raise InvalidArgumentError(OP, "a", "no gradient: scaled_gemm is forward only (an FP8 training step calls it "
                               "for each of its GEMMs)", "a backward through scaled_gemm")


_scaled_gemm.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def _refuse_grad(**tensors) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise InvalidArgumentError(OP, name, "a tensor that does not require grad (scaled_gemm is forward only: "
                                       "run it under torch.no_grad(), or detach)", "requires_grad=True")


def _empty_result(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, fp8):
    """M, K or N is 0: the reference's plain torch gives the result (K = 0: the epilogue of a zero product)."""
    return _reference.scaled_gemm_fwd(None, a, b, a_scale, b_scale, bias, activation, residual, out_dtype, fp8)


def scaled_gemm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, *, bias: Tensor | None = None,
                activation: str = "none", residual: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                out_fp8=False):
    """activation((a_fp8 * a_scale) @ (b_fp8 * b_scale) + bias) + residual from FP8 operands (module docstring):
    out (M, N) in out_dtype, or (y_fp8, y_scale) with out_fp8 (True: e4m3; or the fp8 dtype), y ≈ y_fp8 * y_scale.
    Scales are dequantization factors whose shapes give their granularity: per tensor, per row of a / column of
    b, or 1x128 (a) / 128x128 (b) blocks; opsadv.ops.scaled_gemm.quantize_fp8 makes them."""
    ga, gb = validate(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8)
    fp8 = _out_fp8_dtype(out_fp8)
    _refuse_grad(a=a, b=b, a_scale=a_scale, b_scale=b_scale, bias=bias, residual=residual)
    mode = eager_mode(a, b, a_scale, b_scale, bias, residual)
    if mode != TORCH_OPS:
        check_values(a_scale, b_scale)
    if a.numel() == 0 or b.numel() == 0:
        out, scale = _empty_result(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, fp8)
    elif mode != TORCH_OPS:
        out, scale = _route(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, fp8, ga, gb)
    else:
        out, scale = torch.ops.opsadv.scaled_gemm(a, b, a_scale, b_scale, bias, activation, residual, out_dtype, fp8,
                                                  op_scope())
    return (out, scale) if fp8 is not None else out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    a, b, sa, sb = (arg(args, kwargs, i, n) for i, n in enumerate(("a", "b", "a_scale", "b_scale")))
    bias, act, res = kwargs.get("bias"), kwargs.get("activation", "none"), kwargs.get("residual")
    out_dtype, out_fp8 = kwargs.get("out_dtype", torch.bfloat16), kwargs.get("out_fp8", False)
    ga, gb = validate(a, b, sa, sb, bias, act, res, out_dtype, out_fp8)
    return _spec(a, b, ga, gb, bias, act, res, out_dtype, _out_fp8_dtype(out_fp8))


# float32 outputs: Hopper's FP8 MMA accumulates with fewer than fp32's bits between promotions (DeepSeek-V3 4.2.1)
# (float64 cells write float32, the widest output the op has)
TOLERANCE = {**_DEFAULT_TOLERANCE, torch.float32: (2e-3, 2e-3), torch.float64: (2e-3, 2e-3)}

OPDEF = OpDef(OP, scaled_gemm, Reference(_reference.scaled_gemm_fwd, None, _reference.FEATURES), explain_spec,
              custom_ops=(_scaled_gemm,), cases=tuple(_cases.CASES), tolerance=TOLERANCE, description="FP8 GEMM with dequantization scales (per tensor, row / "
              "column, 1x128 / 128x128 blocks) and the fused bias / activation / residual epilogue, optional fp8 "
              "output; forward only")
OPDEFS = (OPDEF,)
