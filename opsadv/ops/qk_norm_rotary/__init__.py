"""qk_norm_rotary: a per-head RMSNorm of q and of k followed by rotary position embedding, (q', k') in one call.

What Qwen3 and Gemma-3 attention do between the projections and attention: each (token, head) row x of q and k
(head_dim D) is normalized, scaled and rotated,
    n = x * rsqrt(mean(x^2) + eps) * (weight_offset + w)          w: (D,), one weight for q, one for k
    y = rotary(n)                                                  as opsadv.ops.rotary_embedding
in float32 (float64 for float64), rounded once to the inputs' dtype.  weight_offset=0 is Qwen3's
Qwen3RMSNorm (w * x_hat), weight_offset=1 Gemma-3's Gemma3RMSNorm (x_hat * (1 + w)).  Only norms over
one head are this op (weights of size head_dim): OLMo-2 normalizes the whole projection (weights of size
heads * head_dim) before splitting heads, which no per-row op can compute; such weights are refused.

q, k, cos, sin, position_ids, interleaved and rotary_dim take exactly what rotary_embedding takes (q (B, Hq, S, D)
and k (B, Hk, S, D) with any strides, transformers' (b, s, h, d) projections viewed as (b, h, s, d) included; cos
/ sin (S, R), (1 or B, S, R) or a (P, R) table indexed by position_ids; partial rotary: the first R features
rotate, the rest are only normalized).  Outputs are (b, h, s, d) tensors stored as (b, s, h, d).  Gradients flow
to q, k, q_weight and k_weight (and to cos / sin where they need one).  The backward recomputes the norm from
the saved inputs: it reads each row of q and k anyway, so saving rstd would only add bytes.

Impl contract:
  fn(ctx, q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved) -> (q', k')
  backward(ctx, dq', dk', q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved)
      -> (dq, dk, dq_weight, dk_weight)"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core import policy as _policy
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core.policy import current_policy, in_scope, op_scope
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, INF, TORCH_OPS, autograd_function,
                                   carry_policy, carry_scope, check_tensor, dispatch_modes, dt, eager_mode,
                                   function_modes, functorch_level, grad_enabled, is_compiling, is_empty_call,
                                   raw_apply, same_kind, transforms_active, unwrap_if_dead)
from opsadv.ops.rotary_embedding import bshd_like, call_key, call_spec, table_grads, validate as _rotary_validate

from . import cases as _cases, reference as _reference

OP = "qk_norm_rotary"


def _well_formed(q, k, q_weight, k_weight, eps, weight_offset) -> bool:
    """The norm's part of the common call (weights of q's dtype and device, shape (D,); float eps and offset),
    recognized in few operations; the rotary part is rotary_embedding's check."""
    if not isinstance(q, Tensor):
        return False
    d, dtype, dev = q.shape[-1], q.dtype, q.device
    for w in (q_weight, k_weight):
        if not (same_kind(w, dtype, dev) and w.shape == (d,)):
            return False
    return type(eps) is float and 0.0 <= eps < INF and type(weight_offset) is float and -INF < weight_offset < INF


def _rotary_error(e: InvalidArgumentError) -> InvalidArgumentError:
    """rotary_embedding's complaint about an argument the two ops share, under this op's name."""
    return InvalidArgumentError(OP, e.arg, e.expected, e.given)


def validate(q, k, cos, sin, q_weight, k_weight, eps=1e-6, weight_offset=0.0, position_ids=None, interleaved=False,
             rotary_dim=None) -> None:
    try:
        _rotary_validate(q, k, cos, sin, position_ids, interleaved, rotary_dim)
    except InvalidArgumentError as e:
        raise _rotary_error(e) from None
    if _well_formed(q, k, q_weight, k_weight, eps, weight_offset):
        return
    d = q.shape[-1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(OP, name, w, allow_empty=True)
        if w.dtype != q.dtype:
            raise InvalidArgumentError(OP, name, f"dtype {dt(q.dtype)} (same as q)", dt(w.dtype))
        if w.device != q.device:
            raise InvalidArgumentError(OP, name, f"on device {q.device} (same as q)", str(w.device))
        if tuple(w.shape) != (d,):
            extra = (" (= heads x head_dim: a norm over the whole projection, as OLMo-2's, is not a per-head "
                     "norm; normalize before splitting heads and use rotary_embedding)"
                     if w.dim() == 1 and w.shape[0] > d and w.shape[0] % d == 0 else "")
            raise InvalidArgumentError(OP, name, f"shape (D={d},): a per-head norm's weight over head_dim "
                                       "(Qwen3, Gemma-3)", f"{tuple(w.shape)}{extra}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (eps >= 0 and math.isfinite(eps)):
        raise InvalidArgumentError(OP, "eps", "a finite float >= 0", repr(eps))
    if (not isinstance(weight_offset, (int, float)) or isinstance(weight_offset, bool)
            or not math.isfinite(weight_offset)):
        raise InvalidArgumentError(OP, "weight_offset", "a finite float (0: w * x_hat, Qwen3; 1: (1 + w) * x_hat, "
                                   "Gemma-3)", repr(weight_offset))


def _plain(x, w, cos, sin, eps, offset, position_ids, interleaved):
    """One tensor normalized and rotated in plain differentiable torch (the reference's maths)."""
    return _reference.rotate(_reference.normed(None, x, w, eps, offset), cos, sin, position_ids, interleaved,
                             False).to(x.dtype)


def _empty_result(q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved):
    """qk_norm_rotary with an empty operand (batch, heads, sequence or head_dim of 0, or R = 0), in plain
    differentiable torch: empty results and gradients, the other tensor as usual; no kernel runs."""
    return (_plain(q, q_weight, cos, sin, eps, offset, position_ids, interleaved),
            _plain(k, k_weight, cos, sin, eps, offset, position_ids, interleaved))


def _key(q, k, cos, position_ids, interleaved, backward):
    return call_key(OP, q, k, cos, position_ids, interleaved, backward)


def _spec(q, k, cos, position_ids, interleaved, backward):
    return call_spec(OP, q, k, cos, position_ids, interleaved, backward)


def _route(q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved):
    return dispatch.call(_key(q, k, cos, position_ids, interleaved, False),
                         lambda: _spec(q, k, cos, position_ids, interleaved, False),
                         (q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved))


def _bwd_route(gq, gk, q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved):
    return dispatch.call(_key(q, k, cos, position_ids, interleaved, True),
                         lambda: _spec(q, k, cos, position_ids, interleaved, True),
                         (gq, gk, q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved))


def _in_fake_layout(t: Tensor) -> Tensor:
    """t stored as the fakes say (compiled graphs plan with those strides); an impl may return another layout."""
    b, h, s, d = t.shape
    if t.stride() == (s * h * d, d, h * d, 1) or t.numel() == 0:
        return t
    out = bshd_like(t)
    out.copy_(t)
    return out


def _weight_layout(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


@torch.library.custom_op("opsadv::qk_norm_rotary", mutates_args=())
def _qknr(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
          weight_offset: float, position_ids: Optional[Tensor], interleaved: bool,
          scope: int = 0) -> tuple[Tensor, Tensor]:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        oq, ok = _route(q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved)
    return _in_fake_layout(oq), _in_fake_layout(ok)


@_qknr.register_fake
def _(q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved, scope=0):
    return bshd_like(q), bshd_like(k)


@torch.library.custom_op("opsadv::qk_norm_rotary_backward", mutates_args=())
def _qknr_backward(gq: Tensor, gk: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor,
                   k_weight: Tensor, eps: float, weight_offset: float, position_ids: Optional[Tensor],
                   interleaved: bool, scope: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with in_scope(scope):
        dq, dk, dqw, dkw = _bwd_route(gq, gk, q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids,
                                      interleaved)
    return _in_fake_layout(dq), _in_fake_layout(dk), _weight_layout(dqw), _weight_layout(dkw)


@_qknr_backward.register_fake
def _(gq, gk, q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved, scope=0):
    return bshd_like(q), bshd_like(k), q_weight.new_empty(q_weight.shape), k_weight.new_empty(k_weight.shape)


def _setup(ctx, inputs, output):
    q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved = inputs
    ctx.eps, ctx.offset, ctx.interleaved = eps, offset, interleaved
    ctx.table_grad = cos.requires_grad or sin.requires_grad
    # the inputs, not rstd: the backward reads every row of q and k anyway, and the norm's sum of squares costs
    # no bytes beside that read (saving rstd would write and read 4 more bytes a row)
    ctx.save_for_backward(q, k, cos, sin, q_weight, k_weight, position_ids)


def _materialized(q, k, gq, gk):
    if gq is None:                      # an output nobody used
        gq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if gk is None:
        gk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    return gq, gk


def _grads(ctx, dq, dk, dqw, dkw, gq, gk, saved):
    q, k, cos, sin, qw, kw, position_ids = saved
    dcos = dsin = None
    if ctx.table_grad:                  # (rare: transformers' tables are buffers) the normed q, k in torch
        with torch.no_grad():
            nq = _reference.normed(None, q, qw, ctx.eps, ctx.offset)
            nk = _reference.normed(None, k, kw, ctx.eps, ctx.offset)
        dcos, dsin = table_grads(nq, nk, gq, gk, cos, position_ids, ctx.interleaved)
    return dq, dk, dcos, dsin, dqw, dkw, None, None, None, None


def _backward(ctx, gq, gk):
    saved = ctx.saved_tensors
    q, k, cos, sin, qw, kw, position_ids = saved
    gq, gk = _materialized(q, k, gq, gk)
    if eager_mode(gq, gk, q, k, cos, qw, kw) != TORCH_OPS:
        dq, dk, dqw, dkw = _bwd_route(gq, gk, q, k, cos, sin, qw, kw, ctx.eps, ctx.offset, position_ids,
                                      ctx.interleaved)
    else:
        dq, dk, dqw, dkw = torch.ops.opsadv.qk_norm_rotary_backward(gq, gk, q, k, cos, sin, qw, kw, ctx.eps,
                                                                    ctx.offset, position_ids, ctx.interleaved,
                                                                    op_scope())
    return _grads(ctx, dq, dk, dqw, dkw, gq, gk, saved)


_setup_op, _backward_op = carry_scope(_setup, _backward)
_qknr.register_autograd(_backward_op, setup_context=_setup_op)
_carried_setup, _carried_backward = carry_policy(_setup, _backward)
_eager_autograd = autograd_function("QkNormRotaryFn", _route, _carried_setup, _carried_backward)


class QkNormRotaryFn(torch.autograd.Function):
    """An eager training call of the fast path, whose forward impl r and backward impl rb are both resolved (under
    the call's policy, in its buckets): the backward runs rb with no dispatch, counted in the forward's traces.
    Backward under a dispatch / function mode or a functorch transform: _backward as the full path runs it.
    (Named as the full path's Function: the same node name in autograd graphs either way.)"""

    @staticmethod
    def forward(ctx, r, rb, q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved):
        out = r.run(r.ctx, q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved)
        _setup(ctx, (q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved), out)
        ctx.rb, ctx.opsadv_traces, ctx.opsadv_policy = rb, dispatch._local.get(), current_policy()
        return out

    @staticmethod
    def backward(ctx, gq, gk):
        if dispatch_modes() or function_modes() or functorch_level() is not None:
            return (None, None, *_carried_backward(ctx, gq, gk))
        saved = ctx.saved_tensors
        q, k, cos, sin, qw, kw, position_ids = saved
        gq, gk = _materialized(q, k, gq, gk)
        rb = ctx.rb
        if _tracers or ctx.opsadv_traces:
            dispatch.record_carried(rb.impl.id, ctx.opsadv_traces)
        dq, dk, dqw, dkw = rb.run(rb.ctx, gq, gk, q, k, cos, sin, qw, kw, ctx.eps, ctx.offset, position_ids,
                                  ctx.interleaved)
        return (None, None, *_grads(ctx, dq, dk, dqw, dkw, gq, gk, saved))


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
_resolved_raw = raw_apply(QkNormRotaryFn.apply)


def _meta(t):
    return type(t), t.dtype, t.device, t.shape


def qk_norm_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor, k_weight: Tensor, *,
                   eps: float = 1e-6, weight_offset: float = 0.0, position_ids: Tensor | None = None,
                   interleaved: bool = False, rotary_dim: int | None = None) -> tuple[Tensor, Tensor]:
    """(q', k'): each (token, head) row of q (B, Hq, S, D) and k (B, Hk, S, D) RMS-normalized over D, scaled by
    (weight_offset + q_weight) / (weight_offset + k_weight) (both (D,)), then rotated as rotary_embedding rotates
    (cos / sin (S, R) or (1 or B, S, R); with position_ids (S,) / (1 or B, S) a (P, R) table; the first R features
    rotate; interleaved: pairs (x[2i], x[2i+1])).  weight_offset=1.0 is Gemma-3's (1 + w)."""
    fk = hit = None
    # the fast path (as rotary_embedding's): the exact metadata of an identical call that took the full path
    if type(interleaved) is bool and type(eps) is float and type(weight_offset) is float \
            and not (is_compiling() or dispatch_modes() or function_modes()) and functorch_level() is None:
        try:
            train = grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad
                                        or q_weight.requires_grad or k_weight.requires_grad)
            fk = (OP, (_scoped.get() or _policy._global).serial, train, interleaved, eps, weight_offset,
                  type(rotary_dim), rotary_dim, _meta(q), _meta(k), _meta(cos), _meta(sin), _meta(q_weight),
                  _meta(k_weight), None if position_ids is None else _meta(position_ids))
            hit = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
    if hit is not None:
        if not train:
            if _tracers:
                dispatch.record(hit.impl.id)
            return hit.run(hit.ctx, q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved)
        r, rb = hit
        if _tracers:
            dispatch.record(r.impl.id)
        if transforms_active():
            return QkNormRotaryFn.apply(r, rb, q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids,
                                        interleaved)
        return _resolved_raw(r, rb, unwrap_if_dead(q), unwrap_if_dead(k), unwrap_if_dead(cos), unwrap_if_dead(sin),
                             unwrap_if_dead(q_weight), unwrap_if_dead(k_weight), eps, weight_offset,
                             position_ids if position_ids is None else unwrap_if_dead(position_ids), interleaved)
    validate(q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved, rotary_dim)
    eps, weight_offset = float(eps), float(weight_offset)
    if is_empty_call(q, k, cos, sin):
        return _empty_result(q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved)
    mode = eager_mode(q, k, cos, sin, q_weight, k_weight)
    args = (q, k, cos, sin, q_weight, k_weight, eps, weight_offset, position_ids, interleaved)
    if mode == DIRECT:
        out = _route(*args)
        dispatch.learn(fk, _key(q, k, cos, position_ids, interleaved, False))
        return out
    if mode == AUTOGRAD_FN:
        out = _eager_autograd(*args)
        if fk is not None:           # both directions resolved (after a first backward): the fast path from now on
            serial = current_policy().serial
            r = dispatch._memo.get((serial, _key(q, k, cos, position_ids, interleaved, False)))
            rb = dispatch._memo.get((serial, _key(q, k, cos, position_ids, interleaved, True)))
            if r is not None and rb is not None:
                dispatch.learn(fk, None, (r, rb))
        return out
    return torch.ops.opsadv.qk_norm_rotary(*args, op_scope())


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    q, k, cos, sin = (arg(args, kwargs, 0, "q"), arg(args, kwargs, 1, "k"), arg(args, kwargs, 2, "cos"),
                      arg(args, kwargs, 3, "sin"))
    qw, kw = arg(args, kwargs, 4, "q_weight"), arg(args, kwargs, 5, "k_weight")
    pos, inter = kwargs.get("position_ids"), kwargs.get("interleaved", False)
    validate(q, k, cos, sin, qw, kw, kwargs.get("eps", 1e-6), kwargs.get("weight_offset", 0.0), pos, inter,
             kwargs.get("rotary_dim"))
    return _spec(q, k, cos, pos, inter, backward)


OPDEF = OpDef(OP, qk_norm_rotary,
              Reference(_reference.qk_norm_rotary_fwd, _reference.qk_norm_rotary_bwd, _reference.FEATURES),
              explain_spec, custom_ops=(_qknr, _qknr_backward), cases=tuple(_cases.CASES), demo=_cases.demo)
OPDEFS = (OPDEF,)
