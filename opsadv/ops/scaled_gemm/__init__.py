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

Conformance cases (cases.py) keep the fp8 operands and their scales as built (Case.kept: a storage format, not a
precision the runner may cast); tests/test_scaled_gemm.py also compares every impl with a float64 oracle on the
dequantized operands.

scaled_swiglu_gemm (scaled_swiglu.py), the FP8 SwiGLU / GeGLU GEMM, is defined in this folder too: the same
operands, scales and kernels, with the gated epilogue over [W_gate | W_up]; and cast_to_fp8 (cast.py), the one-pass
cast (+ transpose + amax) under a given scale that FP8 training feeds these GEMMs with."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import TOLERANCE as _DEFAULT_TOLERANCE, OpDef, Reference, arg
from opsadv.core.op_common import TORCH_OPS, check_choice, check_tensor, eager_mode, len_bucket
from opsadv.core.policy import in_scope, op_scope

from . import cases as _cases, common as _common, reference as _reference
from .common import (a_scale_kind as _a_scale_kind, b_col_major as _b_col_major, b_scale_kind as _b_scale_kind,
                     out_fp8_dtype as _out_fp8_dtype)
from .reference import (BLOCK, E4M3, E5M2, FP8_DTYPES, FP8_MAX, GRANULARITIES,  # noqa: F401  (public helpers)
                        dequantize_fp8, quantize_fp8, quantize_with_scale, scale_from_amax, scale_kind)

OP = "scaled_gemm"
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPILOGUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def validate(a, b, a_scale, b_scale, bias=None, activation="none", residual=None, out_dtype=torch.bfloat16,
             out_fp8=False) -> tuple[str, str]:
    """Shapes, dtypes, devices and options (no tensor value is read); returns the (a, b) scale granularities."""
    ga, gb = _common.check_operands(OP, a, b, a_scale, b_scale)
    m, n = a.shape[0], b.shape[1]
    if bias is not None:
        check_tensor(OP, "bias", bias, ndim=1, dtypes=EPILOGUE_DTYPES, allow_empty=True)
        if bias.shape[0] != n:
            raise InvalidArgumentError(OP, "bias", f"shape ({n},)", tuple(bias.shape))
    check_choice(OP, "activation", activation, ACTIVATIONS)
    if residual is not None:
        check_tensor(OP, "residual", residual, ndim=2, dtypes=EPILOGUE_DTYPES, allow_empty=True)
        if tuple(residual.shape) != (m, n):
            raise InvalidArgumentError(OP, "residual", f"shape ({m}, {n}) (the output's)", tuple(residual.shape))
    _common.check_out(OP, out_dtype, out_fp8, OUT_DTYPES)
    _common.check_devices(OP, "a", a, b=b, a_scale=a_scale, b_scale=b_scale, bias=bias, residual=residual)
    return ga, gb


def check_values(a_scale, b_scale) -> None:
    """The scales' values (CPU tensors only)."""
    _common.check_values(OP, a_scale=a_scale, b_scale=b_scale)


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
    _common.refuse_grad(OP, **tensors)


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
# the reference runs the same call (every argument kept), so a half-precision cell compares two roundings of one
# value: up to an ulp apart per element (bf16: 2^-8 relative), not the half ulp of the default floor
TOLERANCE = {**_DEFAULT_TOLERANCE, torch.bfloat16: (4e-3, 4e-3), torch.float32: (2e-3, 2e-3), torch.float64: (2e-3, 2e-3)}

OPDEF = OpDef(OP, scaled_gemm, Reference(_reference.scaled_gemm_fwd, None, _reference.FEATURES), explain_spec,
              custom_ops=(_scaled_gemm,), cases=tuple(_cases.CASES), tolerance=TOLERANCE, description="FP8 GEMM with dequantization scales (per tensor, row / "
              "column, 1x128 / 128x128 blocks) and the fused bias / activation / residual epilogue, optional fp8 "
              "output; forward only")

from .scaled_swiglu import OPDEF as SWIGLU_OPDEF, scaled_swiglu_gemm  # noqa: E402  (needs nothing above; see its module)
from .cast import OPDEF as CAST_OPDEF, cast_to_fp8  # noqa: E402  (as scaled_swiglu)
from .cast_delayed import OPDEF as CAST_DELAYED_OPDEF, cast_to_fp8_delayed, new_amax_history  # noqa: E402

OPDEFS = (OPDEF, SWIGLU_OPDEF, CAST_OPDEF, CAST_DELAYED_OPDEF)
