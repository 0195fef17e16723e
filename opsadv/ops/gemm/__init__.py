"""gemm and swiglu_gemm: schema, validation, torch.library ops, fake kernels and autograd.

gemm:         out = activation(alpha · (a @ b) + bias) + residual
              a (..., K), b (K, N), bias (N,), residual (..., N)
swiglu_gemm:  out = silu(x @ W_g + b_g) * (x @ W_u + b_u), one GEMM over w_gate_up = [W_g | W_u] (K, 2N)

Impl contract:
  gemm         fn(ctx, a, b, bias, activation, residual, alpha) -> out
               backward(ctx, grad, a, b, bias, activation, alpha) -> (da, db, dbias or 0-element tensor)
  swiglu_gemm  fn(ctx, x, w_gate_up, bias) -> out
               backward(ctx, grad, x, w_gate_up, bias) -> (dx, dw, dbias or 0-element tensor)
(the residual's gradient is the output gradient itself; core handles it).

Grad-recording calls with an activation (and every grad-recording swiglu_gemm) are composed: the GEMM (+ bias,
alpha) through this op with activation "none", the activation and residual add through torch's differentiable
ops (_composed_for_training; for swiglu_gemm the swiglu op, ops/swiglu: one pass over gate_up each way).  The
pre-activation z is kept, so the backward runs two GEMMs (da, db) on grad * act'(z) from one pointwise kernel;
an impl's own activation backward has only a, b, bias and recomputes z with a third GEMM (H200,
16384x12288x4096 bias+gelu_tanh fwd+bwd: 10.71 ms that way vs 7.74 for torch.compile;
7.75 ms composed).  No-grad calls keep the fused epilogue."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core import policy as _policy
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.policy import in_scope, op_scope
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core.activations import ACT
from ..swiglu import swiglu
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, FLOAT_DTYPES, INF, TORCH_OPS, autograd_function, carry_policy, carry_scope,
                      check_choice, check_same, check_tensor, dispatch_modes, eager_mode, function_modes,
                      functorch_level, grad_enabled, is_compiling, is_empty_call, len_bucket, none_if_empty, raw_apply,
                      resolved_autograd_function, same_kind, transforms_active, unwrap_if_dead,
                      as_weight_grad_layout, empty_weight_grad)
from . import cases as _cases, reference as _reference

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")


def _gemm_well_formed(a, b, bias, activation, residual, alpha) -> bool:
    """The common well-formed call in few operations (a subset of what validate_gemm accepts;
    anything else takes the full checks, which name the problem)."""
    if not isinstance(a, Tensor) or a.dtype not in FLOAT_DTYPES or not same_kind(b, a.dtype, a.device):
        return False
    sa, sb = a.shape, b.shape
    if not sa or len(sb) != 2 or not a.numel() or not b.numel() or sb[0] != sa[-1]:
        return False
    n = sb[1]
    if bias is not None and not (same_kind(bias, a.dtype, a.device) and bias.shape == (n,)):
        return False
    if residual is not None and not (same_kind(residual, a.dtype, a.device) and residual.shape == sa[:-1] + (n,)):
        return False
    return activation in ACTIVATIONS and type(alpha) is float and -INF < alpha < INF


def validate_gemm(a, b, bias, activation, residual, alpha) -> None:
    if _gemm_well_formed(a, b, bias, activation, residual, alpha):
        return
    op = "gemm"
    check_tensor(op, "a", a, min_ndim=1, allow_empty=True)
    check_tensor(op, "b", b, ndim=2, allow_empty=True)
    check_same(op, "a", a, b=b, bias=bias, residual=residual)
    if a.shape[-1] != b.shape[0]:
        raise InvalidArgumentError(op, "b", f"shape (K, N) with K = {a.shape[-1]} (a's last dim)", tuple(b.shape))
    n = b.shape[1]
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, allow_empty=True)
        if bias.shape[0] != n:
            raise InvalidArgumentError(op, "bias", f"shape ({n},)", tuple(bias.shape))
    check_choice(op, "activation", activation, ACTIVATIONS)
    if residual is not None:
        check_tensor(op, "residual", residual, allow_empty=True)
        want = tuple(a.shape[:-1]) + (n,)
        if tuple(residual.shape) != want:
            raise InvalidArgumentError(op, "residual", f"shape {want} (the output's)", tuple(residual.shape))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidArgumentError(op, "alpha", "a finite float", repr(alpha))


def _swiglu_well_formed(x, w, bias) -> bool:
    """As _gemm_well_formed, for swiglu_gemm."""
    if not isinstance(x, Tensor) or x.dtype not in FLOAT_DTYPES or not same_kind(w, x.dtype, x.device):
        return False
    sx, sw = x.shape, w.shape
    if not sx or len(sw) != 2 or not x.numel() or not w.numel() or sw[0] != sx[-1] or sw[1] % 2:
        return False
    return bias is None or (same_kind(bias, x.dtype, x.device) and bias.shape == (sw[1],))


def validate_swiglu(x, w, bias) -> None:
    if _swiglu_well_formed(x, w, bias):
        return
    op = "swiglu_gemm"
    check_tensor(op, "x", x, min_ndim=1, allow_empty=True)
    check_tensor(op, "w_gate_up", w, ndim=2, allow_empty=True)
    check_same(op, "x", x, w_gate_up=w, bias=bias)
    if w.shape[0] != x.shape[-1] or w.shape[1] % 2:
        raise InvalidArgumentError(op, "w_gate_up", f"shape (K, 2N) with K = {x.shape[-1]} and an even second dim",
                                   tuple(w.shape))
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, allow_empty=True)
        if bias.shape[0] != w.shape[1]:
            raise InvalidArgumentError(op, "bias", f"shape ({w.shape[1]},) (gate|up)", tuple(bias.shape))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gemm_empty(a, b, bias, activation, residual, alpha):
    """gemm on empty operands (no rows, K = 0 or N = 0), in plain differentiable torch: with K = 0 the product is
    zero and the epilogue still applies (activation(bias) + residual); no kernel runs."""
    cdt = _acc_dtype(a.dtype)
    z = alpha * (a.to(cdt) @ b.to(cdt))
    if bias is not None:
        z = z + bias.to(cdt)
    y = ACT[activation](z)
    if residual is not None:
        y = y + residual.to(cdt)
    return y.to(a.dtype)


def _swiglu_empty(x, w, bias):
    """swiglu_gemm on empty operands, as _gemm_empty."""
    cdt = _acc_dtype(x.dtype)
    gu = x.to(cdt) @ w.to(cdt)
    if bias is not None:
        gu = gu + bias.to(cdt)
    n = w.shape[1] // 2
    return (torch.nn.functional.silu(gu[..., :n]) * gu[..., n:]).to(x.dtype)


def _rows(a: Tensor) -> int:
    return a.numel() // a.shape[-1] if a.shape[-1] else 0


def _gemm_key(a, b, bias, activation, residual, alpha, backward):
    k, n = b.shape
    return ("gemm", backward, device_key(a), a.dtype, activation, bias is not None, residual is not None,
            alpha != 1.0, len_bucket(a.numel() // k if k else 0), k, n)


def _gemm_spec(a, b, bias, activation, residual, alpha, backward) -> CallSpec:
    f = {f"act_{activation}"} if activation != "none" else set()
    f |= {n for n, on in (("bias", bias is not None), ("residual", residual is not None), ("alpha", alpha != 1.0),
                          ("batched", a.dim() > 2)) if on}
    return CallSpec("gemm", a.device.type, a.dtype, frozenset(f), (len_bucket(_rows(a)), b.shape[0], b.shape[1]),
                    shapes=(tuple(a.shape), tuple(b.shape)), backward=backward, bucket_names=("rows<=", "K=", "N="),
                    device_index=device_index(a))


def _gemm_route(a, b, bias, activation, residual, alpha):
    args = (a, b, bias, activation, residual, alpha)
    return dispatch.call(_gemm_key(*args, False), lambda: _gemm_spec(*args, False), args)


@torch.library.custom_op("opsadv::gemm", mutates_args=())
def _gemm(a: Tensor, b: Tensor, bias: Optional[Tensor], activation: str, residual: Optional[Tensor],
          alpha: float, scope: int = 0) -> Tensor:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _gemm_route(a, b, bias, activation, residual, alpha)


@_gemm.register_fake
def _(a, b, bias, activation, residual, alpha, scope=0):
    return a.new_empty(tuple(a.shape[:-1]) + (b.shape[1],))


def _gemm_bwd_route(grad, a, b, bias, activation, alpha):
    key = _gemm_key(a, b, bias, activation, None, alpha, True)
    da, db, dbias = dispatch.call(key, lambda: _gemm_spec(a, b, bias, activation, None, alpha, True),
                                  (grad, a, b, bias, activation, alpha))
    return da, as_weight_grad_layout(db, b), dbias      # b's layout, as the fake says (_common.weight_grad)


@torch.library.custom_op("opsadv::gemm_backward", mutates_args=())
def _gemm_backward(grad: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], activation: str,
                   alpha: float, scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    with in_scope(scope):
        return _gemm_bwd_route(grad, a, b, bias, activation, alpha)


@_gemm_backward.register_fake
def _(grad, a, b, bias, activation, alpha, scope=0):
    return a.new_empty(a.shape), empty_weight_grad(b), (bias.new_empty(bias.shape) if bias is not None else a.new_empty((0,)))


def _gemm_setup(ctx, inputs, output):
    a, b, bias, activation, residual, alpha = inputs
    ctx.save_for_backward(a, b, bias)
    ctx.activation, ctx.alpha, ctx.has_residual = activation, alpha, residual is not None


def _gemm_bwd(ctx, grad):
    a, b, bias = ctx.saved_tensors
    # eager: the router directly (no torch.library boundary: tens of us per call); traced: the op
    if eager_mode(grad, a, b, bias) != TORCH_OPS:
        da, db, dbias = _gemm_bwd_route(grad, a, b, bias, ctx.activation, ctx.alpha)
    else:
        da, db, dbias = torch.ops.opsadv.gemm_backward(grad, a, b, bias, ctx.activation, ctx.alpha, op_scope())
    return da, db, none_if_empty(dbias) if bias is not None else None, None, (grad if ctx.has_residual else None), None


_gemm_op_setup, _gemm_op_bwd = carry_scope(_gemm_setup, _gemm_bwd)
_gemm.register_autograd(_gemm_op_bwd, setup_context=_gemm_op_setup)
_gemm_setup, _gemm_bwd = carry_policy(_gemm_setup, _gemm_bwd)
_gemm_eager_autograd = autograd_function("GemmFn", _gemm_route, _gemm_setup, _gemm_bwd)


def _swiglu_key(x, w, bias, backward):
    k, n2 = w.shape
    return ("swiglu_gemm", backward, device_key(x), x.dtype, bias is not None, len_bucket(x.numel() // k if k else 0),
            k, n2)


def _swiglu_spec(x, w, bias, backward) -> CallSpec:
    f = frozenset(n for n, on in (("bias", bias is not None), ("batched", x.dim() > 2)) if on)
    return CallSpec("swiglu_gemm", x.device.type, x.dtype, f, (len_bucket(_rows(x)), w.shape[0], w.shape[1]),
                    shapes=(tuple(x.shape), tuple(w.shape)), backward=backward, bucket_names=("rows<=", "K=", "2N="),
                    device_index=device_index(x))


def _swiglu_route(x, w_gate_up, bias):
    return dispatch.call(_swiglu_key(x, w_gate_up, bias, False), lambda: _swiglu_spec(x, w_gate_up, bias, False),
                         (x, w_gate_up, bias))


@torch.library.custom_op("opsadv::swiglu_gemm", mutates_args=())
def _swiglu_gemm(x: Tensor, w_gate_up: Tensor, bias: Optional[Tensor], scope: int = 0) -> Tensor:
    with in_scope(scope):
        return _swiglu_route(x, w_gate_up, bias)


@_swiglu_gemm.register_fake
def _(x, w_gate_up, bias, scope=0):
    return x.new_empty(tuple(x.shape[:-1]) + (w_gate_up.shape[1] // 2,))


@torch.library.custom_op("opsadv::swiglu_gemm_backward", mutates_args=())
def _swiglu_gemm_backward(grad: Tensor, x: Tensor, w_gate_up: Tensor,
                          bias: Optional[Tensor], scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    with in_scope(scope):
        dx, dw, dbias = dispatch.call(_swiglu_key(x, w_gate_up, bias, True),
                                      lambda: _swiglu_spec(x, w_gate_up, bias, True), (grad, x, w_gate_up, bias))
    return dx, as_weight_grad_layout(dw, w_gate_up), dbias


@_swiglu_gemm_backward.register_fake
def _(grad, x, w_gate_up, bias, scope=0):
    return x.new_empty(x.shape), empty_weight_grad(w_gate_up), (bias.new_empty(bias.shape) if bias is not None else x.new_empty((0,)))


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_bwd(ctx, grad):
    x, w, bias = ctx.saved_tensors
    dx, dw, dbias = torch.ops.opsadv.swiglu_gemm_backward(grad, x, w, bias, op_scope())
    return dx, dw, (dbias if bias is not None else None)


_swiglu_setup, _swiglu_bwd = carry_scope(_swiglu_setup, _swiglu_bwd)
_swiglu_gemm.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _trains(mode: int, *tensors) -> bool:
    """Whether a call records gradients: eager AUTOGRAD_FN calls do; traced ones (TORCH_OPS) when an input does."""
    return mode == AUTOGRAD_FN or (mode == TORCH_OPS and _records_grad(*tensors))


def _composed_for_training(a, b, bias, activation, residual, alpha):
    """A grad-recording gemm with an activation: z = alpha a @ b + bias through opsadv (fused bias / alpha,
    the impl measured for that bucket; its backward is the activation-free one: two GEMMs and a column sum),
    then activation and residual add as torch's differentiable ops, whose autograd saves z and computes
    grad * act'(z) in one pointwise kernel.  The fused-epilogue forward saves no z: its backward would
    recompute it with a third GEMM (module docstring)."""
    y = ACT[activation](gemm(a, b, bias=bias, alpha=alpha))
    return y + residual if residual is not None else y


# The fast path (as the norms', ops/norm): a plain eager call whose exact argument metadata (each tensor's type,
# dtype, device and shape; activation, alpha, grad recording, the policy's serial) an identical call stored in
# dispatch._fast after the full path validated and resolved it.  _COMPOSED marks a grad-recording call with an
# activation, which runs _composed_for_training (its gemm() call takes its own fast path).
_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
_COMPOSED = "composed"
_gemm_resolved_autograd = resolved_autograd_function("GemmFn", _gemm_setup, _gemm_bwd)   # = GemmFn, r given
_gemm_raw = raw_apply(_gemm_resolved_autograd)


def gemm(a: Tensor, b: Tensor, *, bias: Tensor | None = None, activation: str = "none",
         residual: Tensor | None = None, alpha: float = 1.0) -> Tensor:
    """activation(alpha · (a @ b) + bias) + residual in one fused kernel where the backend has one.
    a (..., K), b (K, N) — for an nn.Linear weight W (N, K) pass W.t().  Calls that record gradients run
    the GEMM fused with bias / alpha and the activation as torch ops (module docstring: _composed_for_training)."""
    fk = r = None
    if type(alpha) is float and type(activation) is str and not (is_compiling() or dispatch_modes()
                                                                 or function_modes()) and functorch_level() is None:
        try:
            train = grad_enabled() and (a.requires_grad or b.requires_grad or bias is not None and bias.requires_grad
                                        or residual is not None and residual.requires_grad)
            fk = ("gemm", (_scoped.get() or _policy._global).serial, train, activation, alpha, type(a), a.dtype,
                  a.device, a.shape, type(b), b.dtype, b.device, b.shape,
                  None if bias is None else (type(bias), bias.dtype, bias.device, bias.shape),
                  None if residual is None else (type(residual), residual.dtype, residual.device, residual.shape))
            r = _fast.get(fk)
        except (AttributeError, TypeError):      # not tensors: the full checks say what is wrong
            fk = r = None
    if r is not None:
        if r is _COMPOSED:
            return _composed_for_training(a, b, bias, activation, residual, alpha)
        if _tracers:
            dispatch.record(r.impl.id)
        if not train:
            return r.run(r.ctx, a, b, bias, activation, residual, alpha)
        if transforms_active():
            return _gemm_resolved_autograd(r, a, b, bias, activation, residual, alpha)
        return _gemm_raw(r, unwrap_if_dead(a), unwrap_if_dead(b), bias if bias is None else unwrap_if_dead(bias),
                         activation, residual if residual is None else unwrap_if_dead(residual), alpha)
    validate_gemm(a, b, bias, activation, residual, alpha)
    if is_empty_call(a, b, bias, residual):
        return _gemm_empty(a, b, bias, activation, residual, alpha)
    mode = eager_mode(a, b, bias, residual)
    if activation != "none" and _trains(mode, a, b, bias, residual):
        if mode == AUTOGRAD_FN:
            dispatch.learn(fk, None, _COMPOSED)
        return _composed_for_training(a, b, bias, activation, residual, alpha)
    if mode == TORCH_OPS:
        return torch.ops.opsadv.gemm(a, b, bias, activation, residual, float(alpha), op_scope())
    out = (_gemm_route if mode == DIRECT else _gemm_eager_autograd)(a, b, bias, activation, residual, float(alpha))
    dispatch.learn(fk, _gemm_key(a, b, bias, activation, residual, alpha, False))
    return out


def swiglu_gemm(x: Tensor, w_gate_up: Tensor, *, bias: Tensor | None = None) -> Tensor:
    """silu(x @ W_g + b_g) * (x @ W_u + b_u) from one concatenated weight [W_g | W_u] of shape (K, 2N).
    Calls that record gradients run the GEMM through gemm() and the activation through the swiglu op, which
    keeps gate_up for its backward (module docstring)."""
    fk = r = None
    if not (is_compiling() or dispatch_modes() or function_modes()) and functorch_level() is None:
        try:
            train = grad_enabled() and (x.requires_grad or w_gate_up.requires_grad
                                        or bias is not None and bias.requires_grad)
            fk = ("swiglu_gemm", (_scoped.get() or _policy._global).serial, train, type(x), x.dtype, x.device,
                  x.shape, type(w_gate_up), w_gate_up.dtype, w_gate_up.device, w_gate_up.shape,
                  None if bias is None else (type(bias), bias.dtype, bias.device, bias.shape))
            r = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = r = None
    if r is not None:
        if r is _COMPOSED:
            return swiglu(gemm(x, w_gate_up, bias=bias))
        if _tracers:
            dispatch.record(r.impl.id)
        return r.run(r.ctx, x, w_gate_up, bias)
    validate_swiglu(x, w_gate_up, bias)
    if is_empty_call(x, w_gate_up, bias):
        return _swiglu_empty(x, w_gate_up, bias)
    mode = eager_mode(x, w_gate_up, bias)
    if _trains(mode, x, w_gate_up, bias):
        if mode == AUTOGRAD_FN:
            dispatch.learn(fk, None, _COMPOSED)
        return swiglu(gemm(x, w_gate_up, bias=bias))
    # (torch.ops.opsadv.swiglu_gemm keeps its registered autograd for callers of the op itself)
    out = _swiglu_route(x, w_gate_up, bias) if mode == DIRECT else torch.ops.opsadv.swiglu_gemm(x, w_gate_up, bias,
                                                                                                 op_scope())
    if mode == DIRECT:
        dispatch.learn(fk, _swiglu_key(x, w_gate_up, bias, False))
    return out


# ---- the ops' definitions ----------------------------------------------------------------------------------
def explain_gemm(args: tuple, kwargs: dict, backward: bool):
    a, b = arg(args, kwargs, 0, "a"), arg(args, kwargs, 1, "b")
    bias, act, res, alpha = (kwargs.get("bias"), kwargs.get("activation", "none"), kwargs.get("residual"),
                             kwargs.get("alpha", 1.0))
    validate_gemm(a, b, bias, act, res, alpha)
    if act != "none" and _records_grad(a, b, bias, res):     # as _composed_for_training runs it
        return _gemm_spec(a, b, bias, "none", None, alpha, backward), (
            f"grad-recording call: this GEMM runs with activation 'none', then {act}"
            + (" and the residual add" if res is not None else "") + " as torch ops (z kept for the backward)")
    return _gemm_spec(a, b, bias, act, res, alpha, backward)


def explain_swiglu_gemm(args: tuple, kwargs: dict, backward: bool):
    x, w, bias = arg(args, kwargs, 0, "x"), arg(args, kwargs, 1, "w_gate_up"), kwargs.get("bias")
    validate_swiglu(x, w, bias)
    if _records_grad(x, w, bias):
        return _gemm_spec(x, w, bias, "none", None, 1.0, backward), (
            "grad-recording call: this GEMM runs alone, then the swiglu op (opsadv.explain('swiglu', gate_up))")
    return _swiglu_spec(x, w, bias, backward)


GEMM = OpDef("gemm", gemm, Reference(_reference.gemm_fwd, _reference.gemm_bwd, _reference.FEATURES), explain_gemm,
             custom_ops=(_gemm, _gemm_backward), cases=tuple(_cases.CASES), demo=_cases.demo, precision="matmul")
SWIGLU_GEMM = OpDef("swiglu_gemm", swiglu_gemm,
                    Reference(_reference.swiglu_fwd, _reference.swiglu_bwd, _reference.SWIGLU_FEATURES),
                    explain_swiglu_gemm, custom_ops=(_swiglu_gemm, _swiglu_gemm_backward),
                    cases=tuple(_cases.SWIGLU_CASES), demo=_cases.demo_swiglu, precision="matmul")
OPDEFS = (GEMM, SWIGLU_GEMM)
