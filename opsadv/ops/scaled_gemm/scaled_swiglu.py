"""scaled_swiglu_gemm: the FP8 SwiGLU (or GeGLU) GEMM, forward only.

    out = scaled_swiglu_gemm(x, w_gate_up, x_scale, w_scale, *, bias=None, activation="silu",
                             out_dtype=torch.bfloat16, out_fp8=False)
    [g | u] = (x_fp8 * x_scale) @ (w_fp8 * w_scale) + bias          (M, 2N)
    out     = act(g) * u                                               (M, N), act silu (SwiGLU) or gelu_tanh (GeGLU)

swiglu_gemm's layout (w_gate_up = [W_g | W_u], (K, 2N): output column j pairs gate column j with up column N + j)
with scaled_gemm's operands and scales.  One GEMM: a tile of the kernel holds the gate and the up accumulators of the
same output columns, so the (M, 2N) pre-activation never reaches memory (scaled_gemm + swiglu writes it, then reads
it back: 6 bytes per (row, output column) more at bf16).

Why an op of its own and not a "swiglu" activation of scaled_gemm: the output has half of b's columns (a different
fake kernel and shape rule), the bias covers both halves, and residual has no place in it, as swiglu_gemm is its
own op beside gemm.  It shares scaled_gemm's folder (scale conventions, validation, quantize helpers) and kernel.

- x (M, K), w_gate_up (K, 2N): float8_e4m3fn or float8_e5m2, any strides (w_gate_up column-major, i.e. the (2N, K)
  weight of a fused gate_up Linear (or [W_g; W_u] stacked) passed as .t(), is the layout the TMA kernel reads as
  K-major rows).
- x_scale, w_scale: scaled_gemm's dequantization scales of x and of the whole (K, 2N) w_gate_up:
      x_scale: () / (1,) per tensor; (M, 1) per row (token); (M, K / 128) 1x128 blocks along K
      w_scale: () / (1,) per tensor; (1, 2N) per column (output channel of the gate and the up projection);
               (K / 128, ceil(2N / 128)) 128x128 blocks of the concatenated matrix (with N not a multiple of 128,
               a block spans the last gate and the first up columns: quantize [W_g | W_u] as one matrix)
  Values finite and > 0 (checked for CPU tensors in eager calls).  Block scales need K a multiple of 128.
- bias (2N,): float16 / bfloat16 / float32, [b_g | b_u], added before the activation.
- activation: "silu" (default) or "gelu_tanh" (Gemma's gelu_pytorch_tanh).
- out_dtype: bfloat16 (default), float16 or float32; out_fp8 as scaled_gemm's: (y_fp8, y_scale), one per-tensor
  scale of this call's result (the kernel's float32 workspace, atomic amax and quantize pass).
- No gradients: inputs that require grad (with grad enabled) are refused.

Impl contract:
  fn(ctx, x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype, out_fp8) -> (out, out_scale)
CallSpec: dtype = out_dtype (float32 with out_fp8); features scale_a_*, scale_b_* (x's and w_gate_up's
granularities, scaled_gemm's words), a_e5m2 / b_e5m2, bias, act_gelu_tanh, out_fp8 / out_e5m2, b_row_major;
shapes ((M, K), (K, 2N)); bucket (rows<=, K=, 2N=)."""
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
from .reference import E5M2

OP = "scaled_swiglu_gemm"
ACTIVATIONS = ("silu", "gelu_tanh")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPILOGUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NAMES = ("x", "w_gate_up", "x_scale", "w_scale")


def validate(x, w_gate_up, x_scale, w_scale, bias=None, activation="silu", out_dtype=torch.bfloat16,
             out_fp8=False) -> tuple[str, str]:
    """Shapes, dtypes, devices and options (no tensor value is read); returns the (x, w) scale granularities."""
    gx, gw = _common.check_operands(OP, x, w_gate_up, x_scale, w_scale, NAMES, b_what="w_gate_up")
    n2 = w_gate_up.shape[1]
    if n2 % 2:
        raise InvalidArgumentError(OP, "w_gate_up", "shape (K, 2N): an even second dim ([W_gate | W_up])",
                                   tuple(w_gate_up.shape))
    if bias is not None:
        check_tensor(OP, "bias", bias, ndim=1, dtypes=EPILOGUE_DTYPES, allow_empty=True)
        if bias.shape[0] != n2:
            raise InvalidArgumentError(OP, "bias", f"shape ({n2},) ([b_gate | b_up])", tuple(bias.shape))
    check_choice(OP, "activation", activation, ACTIVATIONS)
    _common.check_out(OP, out_dtype, out_fp8, OUT_DTYPES)
    _common.check_devices(OP, "x", x, w_gate_up=w_gate_up, x_scale=x_scale, w_scale=w_scale, bias=bias)
    return gx, gw


def features(x, w, gx, gw, bias, activation, fp8) -> frozenset[str]:
    f = {f"scale_a_{gx}", f"scale_b_{gw}"}
    f |= {name for name, on in (("a_e5m2", x.dtype == E5M2), ("b_e5m2", w.dtype == E5M2), ("bias", bias is not None),
                                ("act_gelu_tanh", activation == "gelu_tanh"), ("out_fp8", fp8 is not None),
                                ("out_e5m2", fp8 == E5M2), ("b_row_major", not _common.b_col_major(w))) if on}
    return frozenset(f)


def _key(x, w, gx, gw, bias, activation, out_dtype, fp8) -> tuple:
    k, n2 = w.shape
    return (OP, device_key(x), x.dtype, w.dtype, gx, gw, None if bias is None else bias.dtype, activation, out_dtype,
            fp8, _common.b_col_major(w), len_bucket(x.shape[0]), k, n2)


def _spec(x, w, gx, gw, bias, activation, out_dtype, fp8) -> CallSpec:
    k, n2 = w.shape
    return CallSpec(OP, x.device.type, torch.float32 if fp8 is not None else out_dtype,
                    features(x, w, gx, gw, bias, activation, fp8), (len_bucket(x.shape[0]), k, n2),
                    shapes=(tuple(x.shape), tuple(w.shape)), bucket_names=("rows<=", "K=", "2N="),
                    device_index=device_index(x))


def _route(x, w, x_scale, w_scale, bias, activation, out_dtype, fp8, gx, gw):
    args = (x, w, x_scale, w_scale, bias, activation, out_dtype, fp8)
    return dispatch.call(_key(x, w, gx, gw, bias, activation, out_dtype, fp8),
                         lambda: _spec(x, w, gx, gw, bias, activation, out_dtype, fp8), args)


def _kinds(x, w, x_scale, w_scale) -> tuple[str, str]:
    return _common.a_scale_kind(x_scale, *x.shape), _common.b_scale_kind(w_scale, *w.shape)


@torch.library.custom_op("opsadv::scaled_swiglu_gemm", mutates_args=())
def _scaled_swiglu_gemm(x: Tensor, w_gate_up: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Optional[Tensor],
                        activation: str, out_dtype: torch.dtype, out_fp8: Optional[torch.dtype],
                        scope: int = 0) -> tuple[Tensor, Tensor]:
    """(out, out_scale); out_scale is 1 without out_fp8.  scope: the converted model's scope id (core.policy)."""
    with in_scope(scope):
        gx, gw = _kinds(x, w_gate_up, x_scale, w_scale)
        out, scale = _route(x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype, out_fp8, gx, gw)
        return out, (scale if scale is not None else x.new_ones((), dtype=torch.float32))


@_scaled_swiglu_gemm.register_fake
def _(x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype, out_fp8, scope=0):
    return (x.new_empty((x.shape[0], w_gate_up.shape[1] // 2), dtype=out_fp8 if out_fp8 is not None else out_dtype),
            x.new_empty((), dtype=torch.float32))


def _no_backward(ctx, dout, dscale):
    raise InvalidArgumentError(OP, "x", "no gradient: scaled_swiglu_gemm is forward only (FP8 training runs "
                               "scaled_gemm for the gate_up GEMM and the swiglu op)", "a backward through it")


_scaled_swiglu_gemm.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def scaled_swiglu_gemm(x: Tensor, w_gate_up: Tensor, x_scale: Tensor, w_scale: Tensor, *, bias: Tensor | None = None,
                       activation: str = "silu", out_dtype: torch.dtype = torch.bfloat16, out_fp8=False):
    """act(g) * u for [g | u] = (x_fp8 * x_scale) @ (w_fp8 * w_scale) + bias over w_gate_up = [W_g | W_u] (K, 2N), FP8
    operands (module docstring): out (M, N) in out_dtype, or (y_fp8, y_scale) with out_fp8.  act "silu" (SwiGLU) or
    "gelu_tanh" (GeGLU).  Scales as scaled_gemm's (opsadv.ops.scaled_gemm.quantize_fp8 makes them; w_scale is the
    scale of the whole [W_g | W_u])."""
    gx, gw = validate(x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype, out_fp8)
    fp8 = _common.out_fp8_dtype(out_fp8)
    _common.refuse_grad(OP, x=x, w_gate_up=w_gate_up, x_scale=x_scale, w_scale=w_scale, bias=bias)
    mode = eager_mode(x, w_gate_up, x_scale, w_scale, bias)
    if mode != TORCH_OPS:
        _common.check_values(OP, x_scale=x_scale, w_scale=w_scale)
    if x.numel() == 0 or w_gate_up.numel() == 0:
        # M, K or N is 0: the reference's plain torch gives the result (K = 0: act(b_g) * b_u)
        out, scale = _reference.scaled_swiglu_gemm_fwd(None, x, w_gate_up, x_scale, w_scale, bias, activation,
                                                       out_dtype, fp8)
    elif mode != TORCH_OPS:
        out, scale = _route(x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype, fp8, gx, gw)
    else:
        out, scale = torch.ops.opsadv.scaled_swiglu_gemm(x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype,
                                                         fp8, op_scope())
    return (out, scale) if fp8 is not None else out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    x, w, sx, sw = (arg(args, kwargs, i, n) for i, n in enumerate(NAMES))
    bias, act = kwargs.get("bias"), kwargs.get("activation", "silu")
    out_dtype, out_fp8 = kwargs.get("out_dtype", torch.bfloat16), kwargs.get("out_fp8", False)
    gx, gw = validate(x, w, sx, sw, bias, act, out_dtype, out_fp8)
    return _spec(x, w, gx, gw, bias, act, out_dtype, _common.out_fp8_dtype(out_fp8))


# as scaled_gemm's: float32 outputs held to Hopper's FP8 accumulation (fewer than fp32's bits between promotions)
# the reference runs the same call (every argument kept), so a half-precision cell compares two roundings of one
# value: up to an ulp apart per element (bf16: 2^-8 relative), not the half ulp of the default floor
TOLERANCE = {**_DEFAULT_TOLERANCE, torch.bfloat16: (4e-3, 4e-3), torch.float32: (2e-3, 2e-3), torch.float64: (2e-3, 2e-3)}

OPDEF = OpDef(OP, scaled_swiglu_gemm, Reference(_reference.scaled_swiglu_gemm_fwd, None, _reference.SWIGLU_FEATURES),
              explain_spec, custom_ops=(_scaled_swiglu_gemm,), cases=tuple(_cases.SWIGLU_CASES), tolerance=TOLERANCE,
              description="FP8 SwiGLU / GeGLU GEMM: act(x W_g + b_g) * (x W_u + b_u) over [W_g | W_u] with "
              "dequantization scales (per tensor, row / column, 1x128 / 128x128 blocks), optional fp8 output; "
              "forward only")
OPDEFS = (OPDEF,)
