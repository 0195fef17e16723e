"""swiglu: the gated activation on its own, y = silu(g) * u for gate_up = [g | u] (..., 2N) -> (..., N).

The same halves as swiglu_gemm's [W_g | W_u] output, so `swiglu(x @ w_gate_up)` equals `swiglu_gemm(x, w_gate_up)`.
It serves models whose gate and up projections are separate GEMMs, and swiglu_gemm's training calls
(ops/gemm): there the GEMM runs alone and this op keeps gate_up for its backward, one pass over memory each way
(torch's silu-then-mul takes five forward and about thirteen backward passes of (rows, N), and saves silu(g) too).

Impl contract:
  fn(ctx, gate_up) -> y                       y (..., N), gate_up's dtype
  backward(ctx, grad, gate_up) -> d_gate_up   (..., 2N): [grad * u * silu'(g) | grad * silu(g)]"""
from __future__ import annotations

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core import policy as _policy
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.policy import in_scope, op_scope
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, FLOAT_DTYPES, TORCH_OPS, autograd_function, carry_policy, carry_scope, check_tensor,
                      dispatch_modes, eager_mode, function_modes, functorch_level, grad_enabled, is_compiling,
                      len_bucket, raw_apply, resolved_autograd_function, transforms_active, unwrap_if_dead)

from . import cases as _cases, reference as _reference

OP = "swiglu"


def validate_swiglu_act(gate_up) -> None:
    if isinstance(gate_up, Tensor) and gate_up.dtype in FLOAT_DTYPES and gate_up.dim() and gate_up.numel() \
            and gate_up.shape[-1] % 2 == 0:
        return
    check_tensor(OP, "gate_up", gate_up, min_ndim=1, allow_empty=True)
    if gate_up.shape[-1] % 2:
        raise InvalidArgumentError(OP, "gate_up", "an even last dim (the gate half, then the up half)",
                                   f"shape {tuple(gate_up.shape)}")


def _empty_result(gate_up: Tensor) -> Tensor:
    """swiglu of an empty gate_up, in plain differentiable torch (empty result, empty gradient); no kernel runs."""
    n = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :n]) * gate_up[..., n:]


def _key(gate_up: Tensor, backward: bool) -> tuple:
    n2 = gate_up.shape[-1]
    return (OP, backward, gate_up.device.type, gate_up.dtype, len_bucket(gate_up.numel() // n2), n2)


def _spec(gate_up: Tensor, backward: bool) -> CallSpec:
    n2 = gate_up.shape[-1]
    feats = frozenset({"batched"} if gate_up.dim() > 2 else ())
    return CallSpec(OP, gate_up.device.type, gate_up.dtype, feats, (len_bucket(gate_up.numel() // n2), n2 // 2),
                    shapes=(tuple(gate_up.shape),), backward=backward, bucket_names=("rows<=", "N="))


def _route(gate_up: Tensor) -> Tensor:
    return dispatch.call(_key(gate_up, False), lambda: _spec(gate_up, False), (gate_up,))


@torch.library.custom_op("opsadv::swiglu", mutates_args=())
def _swiglu(gate_up: Tensor, scope: int = 0) -> Tensor:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _route(gate_up)


@_swiglu.register_fake
def _(gate_up, scope=0):
    return gate_up.new_empty(tuple(gate_up.shape[:-1]) + (gate_up.shape[-1] // 2,))


def _bwd_route(grad: Tensor, gate_up: Tensor) -> Tensor:
    return dispatch.call(_key(gate_up, True), lambda: _spec(gate_up, True), (grad, gate_up))


@torch.library.custom_op("opsadv::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: Tensor, gate_up: Tensor, scope: int = 0) -> Tensor:
    with in_scope(scope):
        return _bwd_route(grad, gate_up)


@_swiglu_backward.register_fake
def _(grad, gate_up, scope=0):
    return gate_up.new_empty(gate_up.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    # eager: the router directly; traced: the op
    # (impls take any strides: the Triton one copies only a strided last dim)
    if eager_mode(grad, gate_up) != TORCH_OPS:
        return _bwd_route(grad, gate_up)
    return torch.ops.opsadv.swiglu_backward(grad, gate_up, op_scope())


_op_setup, _op_backward = carry_scope(_setup, _backward)
_swiglu.register_autograd(_op_backward, setup_context=_op_setup)
_setup, _backward = carry_policy(_setup, _backward)
_eager_autograd = autograd_function("SwigluFn", _route, _setup, _backward)


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
# = SwigluFn, r given (its backward returns the one gradient as a tuple, as resolved_autograd_function expects)
_resolved_autograd = resolved_autograd_function("SwigluFn", _setup, lambda ctx, grad: (_backward(ctx, grad),))
_raw = raw_apply(_resolved_autograd)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(g) * u for gate_up = [g | u] along the last dim: (..., 2N) -> (..., N)."""
    fk = r = None
    # the fast path (as the norms', ops/norm): the exact metadata of an identical call that took the full path
    if not (is_compiling() or dispatch_modes() or function_modes()) and functorch_level() is None:
        try:
            train = grad_enabled() and gate_up.requires_grad
            fk = (OP, (_scoped.get() or _policy._global).serial, train, type(gate_up), gate_up.dtype, gate_up.device,
                  gate_up.shape)
            r = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = r = None
    if r is not None:
        if _tracers:
            dispatch.record(r.impl.id)
        if not train:
            return r.run(r.ctx, gate_up)
        if transforms_active():
            return _resolved_autograd(r, gate_up)
        return _raw(r, unwrap_if_dead(gate_up))
    validate_swiglu_act(gate_up)
    if gate_up.numel() == 0:
        return _empty_result(gate_up)
    mode = eager_mode(gate_up)
    if mode == TORCH_OPS:
        return torch.ops.opsadv.swiglu(gate_up, op_scope())
    out = (_route if mode == DIRECT else _eager_autograd)(gate_up)
    dispatch.learn(fk, _key(gate_up, False))
    return out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    gate_up = arg(args, kwargs, 0, "gate_up")
    validate_swiglu_act(gate_up)
    return _spec(gate_up, backward)


OPDEF = OpDef(OP, swiglu, Reference(_reference.swiglu_act_fwd, _reference.swiglu_act_bwd, _reference.FEATURES),
              explain_spec, custom_ops=(_swiglu, _swiglu_backward), cases=tuple(_cases.CASES), demo=_cases.demo)
OPDEFS = (OPDEF,)
