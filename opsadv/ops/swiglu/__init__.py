"""swiglu: the gated activation on its own, y = act(g) * u for gate_up = [g | u] (..., 2N) -> (..., N), act silu
(SwiGLU, the default) or gelu_tanh (GeGLU: Gemma's gelu_pytorch_tanh MLP).

The same halves as swiglu_gemm's [W_g | W_u] output, so `swiglu(x @ w_gate_up)` equals `swiglu_gemm(x, w_gate_up)`
(silu; swiglu_gemm has no other activation).  It serves models whose gate and up projections are separate GEMMs,
swiglu_gemm's training calls (ops/gemm) and converted MLPs (convert/modules.py SwiGLUMLP, GeGLU included): there the
GEMM runs alone and this op keeps gate_up for its backward, one pass over memory each way (torch's silu-then-mul
takes five forward and about thirteen backward passes of (rows, N), and saves silu(g) too).

Impl contract:
  fn(ctx, gate_up) -> y                       y (..., N), gate_up's dtype; act = silu
  backward(ctx, grad, gate_up) -> d_gate_up   (..., 2N): [grad * u * act'(g) | grad * act(g)]
An impl that declares feature "act_gelu_tanh" also serves GeGLU calls, which it gets with the activation as a third
argument: fn(ctx, gate_up, "gelu_tanh"), backward(ctx, grad, gate_up, "gelu_tanh").  SwiGLU calls keep the
two-argument form, so impls written for silu alone keep working, and are refused (the spec names the feature they
lack) for GeGLU calls rather than run silu."""
from __future__ import annotations

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
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, FLOAT_DTYPES, TORCH_OPS, autograd_function, carry_policy, carry_scope, check_tensor,
                      dispatch_modes, eager_mode, function_modes, functorch_level, grad_enabled, is_compiling,
                      len_bucket, raw_apply, resolved_autograd_function, transforms_active, unwrap_if_dead)

from . import cases as _cases, reference as _reference

OP = "swiglu"
ACTIVATIONS = ("silu", "gelu_tanh")     # SwiGLU, GeGLU (tanh-approximated GELU, Gemma's gelu_pytorch_tanh)


def validate_swiglu_act(gate_up, activation: str = "silu") -> None:
    if isinstance(gate_up, Tensor) and gate_up.dtype in FLOAT_DTYPES and gate_up.dim() and gate_up.numel() \
            and gate_up.shape[-1] % 2 == 0 and (activation == "silu" or activation == "gelu_tanh"):
        return
    check_tensor(OP, "gate_up", gate_up, min_ndim=1, allow_empty=True)
    if gate_up.shape[-1] % 2:
        raise InvalidArgumentError(OP, "gate_up", "an even last dim (the gate half, then the up half)",
                                   f"shape {tuple(gate_up.shape)}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise InvalidArgumentError(OP, "activation", f"one of {list(ACTIVATIONS)} (act in act(g) * u)",
                                   repr(activation))


def _empty_result(gate_up: Tensor, activation: str) -> Tensor:
    """swiglu of an empty gate_up, in plain differentiable torch (empty result, empty gradient); no kernel runs."""
    n = gate_up.shape[-1] // 2
    return ACT[activation](gate_up[..., :n]) * gate_up[..., n:]


def _key(gate_up: Tensor, backward: bool, activation: str = "silu") -> tuple:
    n2 = gate_up.shape[-1]
    return (OP, backward, device_key(gate_up), gate_up.dtype, len_bucket(gate_up.numel() // n2), n2, activation)


def _spec(gate_up: Tensor, backward: bool, activation: str = "silu") -> CallSpec:
    n2 = gate_up.shape[-1]
    feats = {"batched"} if gate_up.dim() > 2 else set()
    if activation != "silu":
        feats.add("act_" + activation)          # impls that lack it are refused for the call, with the reason
    return CallSpec(OP, gate_up.device.type, gate_up.dtype, frozenset(feats),
                    (len_bucket(gate_up.numel() // n2), n2 // 2), shapes=(tuple(gate_up.shape),), backward=backward,
                    bucket_names=("rows<=", "N="), device_index=device_index(gate_up))


def _args(gate_up: Tensor, activation: str) -> tuple:
    """The impl's arguments after ctx: SwiGLU calls keep the contract's one-tensor form (module docstring)."""
    return (gate_up,) if activation == "silu" else (gate_up, activation)


def _route(gate_up: Tensor, activation: str = "silu") -> Tensor:
    return dispatch.call(_key(gate_up, False, activation), lambda: _spec(gate_up, False, activation),
                         _args(gate_up, activation))


@torch.library.custom_op("opsadv::swiglu", mutates_args=())
def _swiglu(gate_up: Tensor, activation: str = "silu", scope: int = 0) -> Tensor:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _route(gate_up, activation)


@_swiglu.register_fake
def _(gate_up, activation="silu", scope=0):
    return gate_up.new_empty(tuple(gate_up.shape[:-1]) + (gate_up.shape[-1] // 2,))


def _bwd_route(grad: Tensor, gate_up: Tensor, activation: str = "silu") -> Tensor:
    return dispatch.call(_key(gate_up, True, activation), lambda: _spec(gate_up, True, activation),
                         (grad, *_args(gate_up, activation)))


@torch.library.custom_op("opsadv::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: Tensor, gate_up: Tensor, activation: str = "silu", scope: int = 0) -> Tensor:
    with in_scope(scope):
        return _bwd_route(grad, gate_up, activation)


@_swiglu_backward.register_fake
def _(grad, gate_up, activation="silu", scope=0):
    return gate_up.new_empty(gate_up.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.activation = inputs[1] if len(inputs) > 1 else "silu"
    ctx.n_inputs = len(inputs)


def _backward(ctx, grad):
    """One gradient per forward input: (d gate_up,) or (d gate_up, None) with the activation passed."""
    (gate_up,) = ctx.saved_tensors
    # eager: the router directly; traced: the op
    # (impls take any strides: the Triton one copies only a strided last dim)
    if eager_mode(grad, gate_up) != TORCH_OPS:
        dgu = _bwd_route(grad, gate_up, ctx.activation)
    else:
        dgu = torch.ops.opsadv.swiglu_backward(grad, gate_up, ctx.activation, op_scope())
    return (dgu,) if ctx.n_inputs == 1 else (dgu, None)


_op_setup, _op_backward = carry_scope(_setup, _backward)
_swiglu.register_autograd(_op_backward, setup_context=_op_setup)
_setup, _backward = carry_policy(_setup, _backward)
_eager_autograd = autograd_function("SwigluFn", _route, _setup, _backward)


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
_resolved_autograd = resolved_autograd_function("SwigluFn", _setup, _backward)     # = SwigluFn, r given
_raw = raw_apply(_resolved_autograd)


def swiglu(gate_up: Tensor, *, activation: str = "silu") -> Tensor:
    """act(g) * u for gate_up = [g | u] along the last dim: (..., 2N) -> (..., N); activation "silu" (SwiGLU) or
    "gelu_tanh" (GeGLU: tanh-approximated GELU, transformers' gelu_pytorch_tanh)."""
    fk = r = None
    # the fast path (as the norms', ops/norm): the exact metadata of an identical call that took the full path
    if not (is_compiling() or dispatch_modes() or function_modes()) and functorch_level() is None:
        try:
            train = grad_enabled() and gate_up.requires_grad
            fk = (OP, (_scoped.get() or _policy._global).serial, train, activation, type(gate_up), gate_up.dtype,
                  gate_up.device, gate_up.shape)
            r = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = r = None
    if r is not None:
        if _tracers:
            dispatch.record(r.impl.id)
        if activation == "silu":
            if not train:
                return r.run(r.ctx, gate_up)
            if transforms_active():
                return _resolved_autograd(r, gate_up)
            return _raw(r, unwrap_if_dead(gate_up))
        if not train:
            return r.run(r.ctx, gate_up, activation)
        if transforms_active():
            return _resolved_autograd(r, gate_up, activation)
        return _raw(r, unwrap_if_dead(gate_up), activation)
    validate_swiglu_act(gate_up, activation)
    if gate_up.numel() == 0:
        return _empty_result(gate_up, activation)
    mode = eager_mode(gate_up)
    if mode == TORCH_OPS:
        return torch.ops.opsadv.swiglu(gate_up, activation, op_scope())
    out = (_route if mode == DIRECT else _eager_autograd)(*_args(gate_up, activation))
    dispatch.learn(fk, _key(gate_up, False, activation))
    return out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    gate_up = arg(args, kwargs, 0, "gate_up")
    activation = arg(args, kwargs, 1, "activation", "silu")
    validate_swiglu_act(gate_up, activation)
    return _spec(gate_up, backward, activation)


OPDEF = OpDef(OP, swiglu, Reference(_reference.swiglu_act_fwd, _reference.swiglu_act_bwd, _reference.FEATURES),
              explain_spec, custom_ops=(_swiglu, _swiglu_backward), cases=tuple(_cases.CASES), demo=_cases.demo)
OPDEFS = (OPDEF,)
