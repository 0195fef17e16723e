"""cast_to_fp8: a matrix into FP8 under a scale known before the call, optionally its transpose too, and its amax, in
one pass (the cast of delayed-scaling FP8 training; TransformerEngine's cast-transpose).

    x_fp8, x_fp8_t, amax = cast_to_fp8(x, scale, dtype=torch.float8_e5m2, transpose=True)

- x (M, N): float16 / bfloat16 / float32 (float64: the reference impl), any strides.
- scale: the DEQUANTIZATION scale (scaled_gemm's convention: x ≈ x_fp8.float() * scale), float32, one element, on
  x's device; x_fp8 = clamp(float32(x) / scale, -FMAX, FMAX) rounded to nearest even, NaN stays NaN: bit for bit
  quantize_with_scale(x, scale, dtype).  Its value is not checked (a GPU check would sync every call).
- dtype: float8_e4m3fn (default) or float8_e5m2.
- transpose: also x_fp8_t (N, M) contiguous, x_fp8.t().contiguous(): the column-major operand (x_fp8_t.t()) the
  gradient GEMMs of a linear layer read, written from the same read of x instead of a second pass over x_fp8.
Returns (x_fp8 (M, N) contiguous, x_fp8_t or None, amax): amax a float32 () tensor, max |x| over every element
(NaN when x holds a NaN, as torch's x.abs().amax(); 0 for an empty x): what a delayed-scaling history records for
the next call's scale.

Why an op of its own: an FP8 training step casts every GEMM's activation and gradient (and the weight), and torch's
x.abs().amax(), x.float() / scale, clamp_ and .to(fp8) are five passes over x with float32 temporaries, plus a
transpose copy for the weight-gradient GEMM: ~20 bytes of memory traffic per element where one kernel needs 2 + 1
(+ 1 for the transpose).  No gradients: inputs that require grad (with grad enabled) are refused.

Impl contract:
  fn(ctx, x, scale, dtype, transpose) -> (x_fp8, x_fp8_t, amax)   x_fp8_t: (N, M), or an empty (0,) tensor
CallSpec: dtype = x's; features "e5m2", "transpose"; bucket (rows<=, N=)."""
from __future__ import annotations

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core import policy as _policy
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.op_common import (FLOAT_DTYPES, TORCH_OPS, check_tensor, dispatch_modes, dt, eager_mode,
                                   function_modes, functorch_level, grad_enabled, is_compiling, len_bucket)
from opsadv.core.opdef import Case, OpDef, Reference, arg, rand
from opsadv.core.policy import in_scope, op_scope

from . import common as _common
from .reference import E4M3, E5M2, quantize_with_scale

OP = "cast_to_fp8"
FEATURES = frozenset({"e5m2", "transpose"})


def check_cast_args(op: str, x, dtype, transpose) -> None:
    """x, dtype and transpose of a cast op (this one, cast_to_fp8_delayed)."""
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, allow_empty=True)
    if dtype not in (E4M3, E5M2):
        raise InvalidArgumentError(op, "dtype", "torch.float8_e4m3fn or torch.float8_e5m2", repr(dtype))
    if not isinstance(transpose, bool):
        raise InvalidArgumentError(op, "transpose", "a bool", repr(transpose))


def validate(x, scale, dtype, transpose) -> None:
    """Shapes, dtypes, devices and options (no tensor value is read)."""
    check_cast_args(OP, x, dtype, transpose)
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        given = f"{dt(scale.dtype)} of shape {tuple(scale.shape)}" if isinstance(scale, Tensor) else \
            type(scale).__name__
        raise InvalidArgumentError(OP, "scale", "a float32 tensor of one element (the per-tensor dequantization "
                                   "scale)", given)
    _common.check_devices(OP, "x", x, scale=scale)


def _features(dtype, transpose) -> frozenset[str]:
    return frozenset(f for f, on in (("e5m2", dtype == E5M2), ("transpose", transpose)) if on)


def cast_key(op: str, x, dtype, transpose) -> tuple:
    return (op, device_key(x), x.dtype, dtype, transpose, len_bucket(x.shape[0]), x.shape[1])


def cast_spec(op: str, x, dtype, transpose) -> CallSpec:
    return CallSpec(op, x.device.type, x.dtype, _features(dtype, transpose), (len_bucket(x.shape[0]), x.shape[1]),
                    shapes=(tuple(x.shape),), bucket_names=("rows<=", "N="), device_index=device_index(x))


def _route(x, scale, dtype, transpose):
    return dispatch.call(cast_key(OP, x, dtype, transpose), lambda: cast_spec(OP, x, dtype, transpose), (x, scale, dtype, transpose))


def reference_cast(ctx, x, scale, dtype, transpose):
    """The oracle: plain torch (quantize_with_scale), any device."""
    x8 = quantize_with_scale(x, scale, dtype).contiguous()
    x8t = x8.t().clone(memory_format=torch.contiguous_format) if transpose else x8.new_empty((0,))   # (never x8)
    amax = x.detach().abs().amax().to(torch.float32) if x.numel() else x.new_zeros((), dtype=torch.float32)
    return x8, x8t, amax


@torch.library.custom_op("opsadv::cast_to_fp8", mutates_args=())
def _cast(x: Tensor, scale: Tensor, dtype: torch.dtype, transpose: bool, scope: int = 0) -> tuple[Tensor, Tensor,
                                                                                                    Tensor]:
    """(x_fp8, x_fp8_t or an empty (0,) tensor, amax).  scope: the converted model's scope id (core.policy)."""
    with in_scope(scope):
        return _route(x, scale, dtype, transpose)


@_cast.register_fake
def _(x, scale, dtype, transpose, scope=0):
    m, n = x.shape
    return (x.new_empty((m, n), dtype=dtype), x.new_empty((n, m) if transpose else (0,), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


def _no_backward(ctx, *grads):
    raise InvalidArgumentError(OP, "x", "no gradient: cast_to_fp8 is a cast (an FP8 training step differentiates "
                               "around it)", "a backward through cast_to_fp8")


_cast.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)

_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped


def tensor_meta(t):
    return type(t), t.dtype, t.device, t.shape, t.stride()


def cast_to_fp8(x: Tensor, scale: Tensor, *, dtype: torch.dtype = E4M3, transpose: bool = False):
    """x (M, N) in fp8 under the dequantization scale `scale` (float32, one element), and with transpose its (N, M)
    transpose, and max |x| (module docstring): (x_fp8, x_fp8_t or None, amax)."""
    fk = hit = None
    # the fast path (as attention_merge_'s): an identical no-grad call's resolution; a training step repeats its
    # shapes every layer
    if type(transpose) is bool and not (is_compiling() or dispatch_modes() or function_modes()) \
            and functorch_level() is None:
        try:
            if not (grad_enabled() and (x.requires_grad or scale.requires_grad)):
                fk = (OP, (_scoped.get() or _policy._global).serial, dtype, transpose, tensor_meta(x), tensor_meta(scale))
                hit = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
    if hit is not None:
        if _tracers:
            dispatch.record(hit.impl.id)
        x8, x8t, amax = hit.run(hit.ctx, x, scale, dtype, transpose)
        return x8, (x8t if transpose else None), amax
    validate(x, scale, dtype, transpose)
    _common.refuse_grad(OP, x=x, scale=scale)
    if x.numel() == 0:                  # M or N of 0: plain torch, no kernel
        x8, x8t, amax = reference_cast(None, x, scale, dtype, transpose)
    elif eager_mode(x, scale) == TORCH_OPS:
        x8, x8t, amax = torch.ops.opsadv.cast_to_fp8(x, scale, dtype, transpose, op_scope())
    else:
        x8, x8t, amax = _route(x, scale, dtype, transpose)
        dispatch.learn(fk, cast_key(OP, x, dtype, transpose))
    return x8, (x8t if transpose else None), amax


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    x, scale = arg(args, kwargs, 0, "x"), arg(args, kwargs, 1, "scale")
    dtype, transpose = kwargs.get("dtype", E4M3), kwargs.get("transpose", False)
    validate(x, scale, dtype, transpose)
    return cast_spec(OP, x, dtype, transpose)


def _case(m, n, *, dtype=E4M3, transpose=True, strided=False, specials=False, zero=False):
    """x (m, n) with rows of different magnitudes, the scale its finite amax / FMAX halved (so some values
    saturate); specials: +-inf and -0.0 in it."""
    def build(cell_dtype, device, g):
        x = rand((m, n), torch.float64, "cpu", g) * 2.0 ** (torch.arange(m) % 7 - 3.0)[:, None]
        if zero:
            x = torch.zeros_like(x)
        if specials and x.numel() >= 4:
            # (no NaN: triton 3.6's interpreter casts it to a number; tests/test_cast_to_fp8.py checks NaN on the GPU)
            x.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), -0.0], dtype=torch.float64)
        fmax = 448.0 if dtype == E4M3 else 57344.0
        big = x[torch.isfinite(x)].abs().amax().to(torch.float32)
        scale = torch.where(big > 0, big / fmax / 2, torch.ones(()))
        x = x.to(device=device, dtype=cell_dtype)
        if strided:
            x = x.t().contiguous().t()
        return (x, scale.reshape(()).to(device)), {"dtype": dtype, "transpose": transpose}
    return build


CASES = [
    Case(OP, "one_element", _case(1, 1), (), kept=frozenset({1})),
    Case(OP, "odd_127x3_e4m3", _case(127, 3), (), kept=frozenset({1})),
    Case(OP, "strided_e5m2", _case(37, 160, dtype=E5M2, strided=True), (), kept=frozenset({1})),
    Case(OP, "no_transpose_specials", _case(65, 129, transpose=False, specials=True), (), kept=frozenset({1})),
    Case(OP, "zeros", _case(3, 5, zero=True), (), kept=frozenset({1}), quick=False),
]

OPDEF = OpDef(OP, cast_to_fp8, Reference(reference_cast, None, FEATURES), explain_spec, custom_ops=(_cast,),
              cases=tuple(CASES), demo=None, description="a matrix into FP8 under a given per-tensor scale, "
              "optionally with its transpose, and its amax, in one pass (delayed-scaling FP8 training's cast)")
