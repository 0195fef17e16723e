"""layer_norm and rms_norm (optionally fused with a residual add): schema, validation,
torch.library ops, fake kernels and autograd.  Statistics are float32 (float64 for float64).

With residual: s = x + residual; returns (norm(s), s) — one pass over memory in fused impls.
rms_norm:  y = s · rsqrt(mean(s²) + eps) · (offset + weight)   (offset=1 gives Gemma's (1 + w))

Impl contract (xsum is a 0-element tensor without residual; mean/rstd have shape x.shape[:-1]):
  layer_norm  fn(ctx, x, weight, bias, eps, residual) -> (y, xsum, mean, rstd)
              backward(ctx, dy, dsum, xin, weight, bias, mean, rstd) -> (dx, dweight, dbias)
  rms_norm    fn(ctx, x, weight, eps, residual, offset) -> (y, xsum, rstd)
              backward(ctx, dy, dsum, xin, weight, rstd, offset) -> (dx, dweight)
where xin is the normalized input (xsum with a residual, else x), dsum the gradient of xsum
(0-element when absent) and absent weight/bias gradients are 0-element tensors or None.
An impl may also declare `inference` (same arguments as fn): the forward of eager no-grad calls,
which read only y (and xsum with a residual), so it may return None for mean/rstd (and for an
absent xsum) and skip computing and allocating them.  And `train` (same arguments and outputs as
inference): a forward of PyTorch's differentiable ops for eager grad-recording calls, which then run
under torch's autograd, not opsadv's Function.  Those calls resolve in their own bucket
(CallSpec.train), which autotune times forward + backward."""
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
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, FLOAT_DTYPES, INF, carry_policy, carry_scope, check_same, check_tensor, is_empty_call,
                      dispatch_modes, eager_mode, function_modes, functorch_level, grad_enabled, grad_step,
                      is_compiling, len_bucket, raw_apply, register_train_step, resolved_autograd_function, same_kind,
                      shared_empty, transforms_active, unwrap_if_dead)

from . import cases as _cases, reference as _reference


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _well_formed(x, weight, bias, eps, residual, offset) -> bool:
    """The common well-formed call, recognized in few operations (a subset of what validate()
    accepts: anything else, e.g. an int eps, takes the full checks, which name the problem)."""
    if not isinstance(x, Tensor):
        return False
    dt, shape = x.dtype, x.shape
    if dt not in FLOAT_DTYPES or not shape or not x.numel():
        return False
    dev, n = x.device, shape[-1]
    for t in (weight, bias):
        if t is not None and not (same_kind(t, dt, dev) and t.shape == (n,)):
            return False
    if residual is not None and not (same_kind(residual, dt, dev) and residual.shape == shape):
        return False
    return type(eps) is float and 0.0 <= eps < INF and type(offset) is float and -INF < offset < INF


def validate(op, x, weight, bias, eps, residual, offset=0.0) -> None:
    if _well_formed(x, weight, bias, eps, residual, offset):
        return
    check_tensor(op, "x", x, min_ndim=1, allow_empty=True)
    check_same(op, "x", x, weight=weight, bias=bias, residual=residual)
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(op, name, t, ndim=1, allow_empty=True)
            if t.shape[0] != n:
                raise InvalidArgumentError(op, name, f"shape ({n},) (x's last dim)", tuple(t.shape))
    if residual is not None:
        check_tensor(op, "residual", residual, allow_empty=True)
        if residual.shape != x.shape:
            raise InvalidArgumentError(op, "residual", f"shape {tuple(x.shape)} (same as x)", tuple(residual.shape))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (eps >= 0 and math.isfinite(eps)):
        raise InvalidArgumentError(op, "eps", "a finite float >= 0", repr(eps))
    if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
        raise InvalidArgumentError(op, "offset", "a finite float", repr(offset))


def _empty_result(op, x, weight, bias, eps, residual, offset=0.0):
    """The norms on empty operands (no rows, or a last dim of 0), in plain differentiable torch: the maths of the
    reference, so gradients are the zero / empty ones, and no kernel runs."""
    cdt = stat_dtype(x.dtype)
    s = x.to(cdt) + residual.to(cdt) if residual is not None else x.to(cdt)
    if op == "layer_norm":
        c = s - s.mean(-1, keepdim=True)
        y = c * torch.rsqrt((c * c).mean(-1, keepdim=True) + eps)
    else:
        y = s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.to(cdt))
    if bias is not None:
        y = y + bias.to(cdt)
    y = y.to(x.dtype)
    return (y, s.to(x.dtype)) if residual is not None else y


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1]


def _key(op, x, weight, bias, residual, backward, offset=0.0, train=False):
    n = x.shape[-1]
    return (op, "train" if train else backward, device_key(x), x.dtype, n, weight is not None, bias is not None,
            residual is not None, len_bucket(x.numel() // n), offset != 0.0)


def _spec(op, x, weight, bias, residual, backward, offset=0.0, train=False) -> CallSpec:
    f = frozenset(n for n, on in (("weight", weight is not None), ("bias", bias is not None),
                                  ("residual", residual is not None), ("offset", offset != 0.0)) if on)
    return CallSpec(op, x.device.type, x.dtype, f, (x.shape[-1], len_bucket(_rows(x))),
                    shapes=(tuple(x.shape),), backward=backward, train=train, bucket_names=("hidden=", "rows<="),
                    device_index=device_index(x))


# ---- layer_norm ----------------------------------------------------------------------------
def _layer_norm_route(x, weight, bias, eps, residual):
    return dispatch.call(_key("layer_norm", x, weight, bias, residual, False),
                         lambda: _spec("layer_norm", x, weight, bias, residual, False),
                         (x, weight, bias, eps, residual))


def _layer_norm_infer(x, weight, bias, eps, residual):
    """Eager no-grad calls: mean / rstd (and an absent xsum) may come back None."""
    return dispatch.call(_key("layer_norm", x, weight, bias, residual, False),
                         lambda: _spec("layer_norm", x, weight, bias, residual, False),
                         (x, weight, bias, eps, residual), inference=True)


def _layer_norm_train_resolve(x, weight, bias, eps, residual):
    """Eager grad-recording calls resolve in their own bucket (CallSpec.train), once per call: autotune
    times them forward + backward, and an impl with `train` runs under torch's autograd instead of ours."""
    return dispatch.resolve(_key("layer_norm", x, weight, bias, residual, False, train=True),
                            lambda: _spec("layer_norm", x, weight, bias, residual, False, train=True),
                            (x, weight, bias, eps, residual))


@torch.library.custom_op("opsadv::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                residual: Optional[Tensor], scope: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _layer_norm_route(x, weight, bias, eps, residual)


@_layer_norm.register_fake
def _(x, weight, bias, eps, residual, scope=0):
    st = x.new_empty(x.shape[:-1], dtype=stat_dtype(x.dtype))
    return x.new_empty(x.shape), (x.new_empty(x.shape) if residual is not None else x.new_empty((0,))), st, st.clone()


def _layer_norm_backward_route(dy, dsum, xin, weight, bias, mean, rstd):
    has_res = dsum.numel() > 0
    return dispatch.call(_key("layer_norm", xin, weight, bias, has_res or None, True),
                         lambda: _spec("layer_norm", xin, weight, bias, has_res or None, True),
                         (dy, dsum, xin, weight, bias, mean, rstd))


@torch.library.custom_op("opsadv::layer_norm_backward", mutates_args=())
def _layer_norm_backward(dy: Tensor, dsum: Tensor, xin: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                         mean: Tensor, rstd: Tensor, scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    with in_scope(scope):
        dx, dw, db = _layer_norm_backward_route(dy, dsum, xin, weight, bias, mean, rstd)
    # custom ops return tensors: an impl's None for an absent gradient becomes a 0-element tensor
    return dx, (dw if dw is not None else xin.new_empty((0,))), (db if db is not None else xin.new_empty((0,)))


@_layer_norm_backward.register_fake
def _(dy, dsum, xin, weight, bias, mean, rstd, scope=0):
    return (xin.new_empty(xin.shape), weight.new_empty(weight.shape) if weight is not None else xin.new_empty((0,)),
            bias.new_empty(bias.shape) if bias is not None else xin.new_empty((0,)))


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps, residual = inputs
    y, xsum, mean, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(xsum if ctx.has_residual else x, weight, bias, mean, rstd)


def _ln_bwd(ctx, dy, dsum, dmean, drstd):
    xin, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(xin)
    # eager backward (no tracing, no double backward): the router directly, as the forward does,
    # skipping torch.library's dispatcher on the host's critical path between the two kernels
    direct = eager_mode(dy, xin, weight, bias) == DIRECT
    # no gradient for the residual sum (None: unused, not materialized) -> the kernel skips that input;
    # the eager direct call reads the 0-element stand-in only, so it can be a shared one (no allocation)
    if not ctx.has_residual or dsum is None:
        dsum = shared_empty(xin) if direct else xin.new_empty((0,))
    if direct:
        dx, dw, db = _layer_norm_backward_route(dy, dsum, xin, weight, bias, mean, rstd)
    else:
        dx, dw, db = torch.ops.opsadv.layer_norm_backward(dy, dsum, xin, weight, bias, mean, rstd, op_scope())
    return (dx, dw if weight is not None else None, db if bias is not None else None, None,
            dx if ctx.has_residual else None)


_ln_op_setup, _ln_op_bwd = carry_scope(_ln_setup, _ln_bwd)
_layer_norm.register_autograd(_ln_op_bwd, setup_context=_ln_op_setup)
_ln_setup, _ln_bwd = carry_policy(_ln_setup, _ln_bwd)
_ln_eager_autograd = resolved_autograd_function("LayerNormFn", _ln_setup, _ln_bwd, stats=(2, 3))


def _train_step(eager_autograd, residual_at: int):
    """autotune's forward+backward step of a norm impl: its `train` forward under torch's autograd, else
    the opsadv Function running that impl; two outputs (y, sum) when args[residual_at] is given."""
    def step(impl, ctx, args):
        outs = 2 if args[residual_at] is not None else 1
        if impl.train is not None:
            return grad_step(lambda: impl.train(ctx, *args), args, outs)
        r = dispatch.Resolved(impl, ctx, impl.fn)
        return grad_step(lambda: eager_autograd(r, *args), args, outs)
    return step


register_train_step("layer_norm", _train_step(_ln_eager_autograd, 4))


# ---- rms_norm ------------------------------------------------------------------------------
def _rms_norm_route(x, weight, eps, residual, offset):
    return dispatch.call(_key("rms_norm", x, weight, None, residual, False, offset),
                         lambda: _spec("rms_norm", x, weight, None, residual, False, offset),
                         (x, weight, eps, residual, offset))


def _rms_norm_infer(x, weight, eps, residual, offset):
    """Eager no-grad calls: rstd (and an absent xsum) may come back None."""
    return dispatch.call(_key("rms_norm", x, weight, None, residual, False, offset),
                         lambda: _spec("rms_norm", x, weight, None, residual, False, offset),
                         (x, weight, eps, residual, offset), inference=True)


def _rms_norm_train_resolve(x, weight, eps, residual, offset):
    return dispatch.resolve(_key("rms_norm", x, weight, None, residual, False, offset, train=True),
                            lambda: _spec("rms_norm", x, weight, None, residual, False, offset, train=True),
                            (x, weight, eps, residual, offset))


@torch.library.custom_op("opsadv::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, residual: Optional[Tensor],
              offset: float, scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _rms_norm_route(x, weight, eps, residual, offset)


@_rms_norm.register_fake
def _(x, weight, eps, residual, offset, scope=0):
    return (x.new_empty(x.shape), x.new_empty(x.shape) if residual is not None else x.new_empty((0,)),
            x.new_empty(x.shape[:-1], dtype=stat_dtype(x.dtype)))


def _rms_norm_backward_route(dy, dsum, xin, weight, rstd, offset):
    has_res = dsum.numel() > 0
    return dispatch.call(_key("rms_norm", xin, weight, None, has_res or None, True, offset),
                         lambda: _spec("rms_norm", xin, weight, None, has_res or None, True, offset),
                         (dy, dsum, xin, weight, rstd, offset))


@torch.library.custom_op("opsadv::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, dsum: Tensor, xin: Tensor, weight: Optional[Tensor], rstd: Tensor,
                       offset: float, scope: int = 0) -> tuple[Tensor, Tensor]:
    with in_scope(scope):
        dx, dw = _rms_norm_backward_route(dy, dsum, xin, weight, rstd, offset)
    return dx, (dw if dw is not None else xin.new_empty((0,)))     # (an impl's None: absent gradient)


@_rms_norm_backward.register_fake
def _(dy, dsum, xin, weight, rstd, offset, scope=0):
    return xin.new_empty(xin.shape), (weight.new_empty(weight.shape) if weight is not None else xin.new_empty((0,)))


def _rms_setup(ctx, inputs, output):
    x, weight, eps, residual, offset = inputs
    y, xsum, rstd = output
    ctx.has_residual, ctx.offset = residual is not None, offset
    ctx.save_for_backward(xsum if ctx.has_residual else x, weight, rstd)


def _rms_bwd(ctx, dy, dsum, drstd):
    xin, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(xin)
    direct = eager_mode(dy, xin, weight) == DIRECT
    if not ctx.has_residual or dsum is None:        # (as in _ln_bwd)
        dsum = shared_empty(xin) if direct else xin.new_empty((0,))
    if direct:
        dx, dw = _rms_norm_backward_route(dy, dsum, xin, weight, rstd, ctx.offset)
    else:
        dx, dw = torch.ops.opsadv.rms_norm_backward(dy, dsum, xin, weight, rstd, ctx.offset, op_scope())
    return dx, (dw if weight is not None else None), None, (dx if ctx.has_residual else None), None


_rms_op_setup, _rms_op_bwd = carry_scope(_rms_setup, _rms_bwd)
_rms_norm.register_autograd(_rms_op_bwd, setup_context=_rms_op_setup)
_rms_setup, _rms_bwd = carry_policy(_rms_setup, _rms_bwd)
_rms_eager_autograd = resolved_autograd_function("RmsNormFn", _rms_setup, _rms_bwd, stats=(2,))


register_train_step("rms_norm", _train_step(_rms_eager_autograd, 3))


# ---- public ----------------------------------------------------------------------------------
# The fast path: a plain eager call (no tracing, modes or transforms) with float eps / offset looks its exact
# argument metadata up in dispatch._fast, stored by an identical call that took the full path (validate,
# eager_mode, bucket key, memo).  The key holds what those read: each tensor's type, dtype, device and shape,
# whether the call records grads, eps and offset (only validated values were stored), the policy's serial.
_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
_ln_raw, _rms_raw = raw_apply(_ln_eager_autograd), raw_apply(_rms_eager_autograd)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5, *,
               residual: Tensor | None = None):
    """LayerNorm over the last dim.  With residual: returns (layer_norm(x + residual), x + residual)."""
    fk = r = None
    if type(eps) is float and not (is_compiling() or dispatch_modes() or function_modes()) \
            and functorch_level() is None:
        try:
            train = grad_enabled() and (x.requires_grad or weight is not None and weight.requires_grad
                                        or bias is not None and bias.requires_grad
                                        or residual is not None and residual.requires_grad)
            fk = ("layer_norm", (_scoped.get() or _policy._global).serial, train, type(x), x.dtype, x.device,
                  x.shape, eps,
                  None if weight is None else (type(weight), weight.dtype, weight.device, weight.shape),
                  None if bias is None else (type(bias), bias.dtype, bias.device, bias.shape),
                  None if residual is None else (type(residual), residual.dtype, residual.device, residual.shape))
            r = _fast.get(fk)
        except (AttributeError, TypeError):      # not tensors: the full checks say what is wrong
            fk = r = None
    if r is not None:
        if _tracers:
            dispatch.record(r.impl.id)
        if not train:
            y, xsum, _, _ = r.infer(r.ctx, x, weight, bias, eps, residual)
        elif r.impl.train is not None:
            y, xsum, _, _ = r.impl.train(r.ctx, x, weight, bias, eps, residual)
        elif transforms_active():
            y, xsum, _, _ = _ln_eager_autograd(r, x, weight, bias, eps, residual)
        else:
            y, xsum, _, _ = _ln_raw(r, unwrap_if_dead(x), weight if weight is None else unwrap_if_dead(weight),
                                    bias if bias is None else unwrap_if_dead(bias), eps,
                                    residual if residual is None else unwrap_if_dead(residual))
        return (y, xsum) if residual is not None else y
    validate("layer_norm", x, weight, bias, eps, residual)
    if is_empty_call(x, weight, bias):
        return _empty_result("layer_norm", x, weight, bias, eps, residual)
    mode = eager_mode(x, weight, bias, residual)
    eps = float(eps)
    if mode == DIRECT:          # eager no-grad: nothing reads mean / rstd, so the impl need not produce them
        y, xsum, _, _ = _layer_norm_infer(x, weight, bias, eps, residual)
        dispatch.learn(fk, _key("layer_norm", x, weight, bias, residual, False))
    elif mode == AUTOGRAD_FN:       # one resolution picks torch's autograd (impl.train) or ours
        r = _layer_norm_train_resolve(x, weight, bias, eps, residual)
        dispatch.learn(fk, None, r)
        dispatch.record_call(r.impl.id)
        y, xsum, _, _ = (r.impl.train(r.ctx, x, weight, bias, eps, residual) if r.impl.train is not None
                         else _ln_eager_autograd(r, x, weight, bias, eps, residual))
    else:
        y, xsum, _, _ = torch.ops.opsadv.layer_norm(x, weight, bias, eps, residual, op_scope())
    return (y, xsum) if residual is not None else y


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, residual: Tensor | None = None,
             offset: float = 0.0):
    """RMSNorm over the last dim, y = x·rsqrt(mean(x²)+eps)·(offset + weight).  With residual:
    returns (rms_norm(x + residual), x + residual)."""
    fk = r = None
    if type(eps) is float and type(offset) is float and not (is_compiling() or dispatch_modes() or function_modes()) \
            and functorch_level() is None:
        try:
            train = grad_enabled() and (x.requires_grad or weight is not None and weight.requires_grad
                                        or residual is not None and residual.requires_grad)
            fk = ("rms_norm", (_scoped.get() or _policy._global).serial, train, type(x), x.dtype, x.device, x.shape,
                  eps, offset,
                  None if weight is None else (type(weight), weight.dtype, weight.device, weight.shape),
                  None if residual is None else (type(residual), residual.dtype, residual.device, residual.shape))
            r = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = r = None
    if r is not None:
        if _tracers:
            dispatch.record(r.impl.id)
        if not train:
            y, xsum, _ = r.infer(r.ctx, x, weight, eps, residual, offset)
        elif r.impl.train is not None:
            y, xsum, _ = r.impl.train(r.ctx, x, weight, eps, residual, offset)
        elif transforms_active():
            y, xsum, _ = _rms_eager_autograd(r, x, weight, eps, residual, offset)
        else:
            y, xsum, _ = _rms_raw(r, unwrap_if_dead(x), weight if weight is None else unwrap_if_dead(weight), eps,
                                  residual if residual is None else unwrap_if_dead(residual), offset)
        return (y, xsum) if residual is not None else y
    validate("rms_norm", x, weight, None, eps, residual, offset)
    if is_empty_call(x, weight):
        return _empty_result("rms_norm", x, weight, None, eps, residual, offset)
    mode = eager_mode(x, weight, residual)
    eps, offset = float(eps), float(offset)
    if mode == DIRECT:
        y, xsum, _ = _rms_norm_infer(x, weight, eps, residual, offset)
        dispatch.learn(fk, _key("rms_norm", x, weight, None, residual, False, offset))
    elif mode == AUTOGRAD_FN:
        r = _rms_norm_train_resolve(x, weight, eps, residual, offset)
        dispatch.learn(fk, None, r)
        dispatch.record_call(r.impl.id)
        y, xsum, _ = (r.impl.train(r.ctx, x, weight, eps, residual, offset) if r.impl.train is not None
                      else _rms_eager_autograd(r, x, weight, eps, residual, offset))
    else:
        y, xsum, _ = torch.ops.opsadv.rms_norm(x, weight, eps, residual, offset, op_scope())
    return (y, xsum) if residual is not None else y


# ---- the ops' definitions ----------------------------------------------------------------------------------
def _explain(op: str):
    def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
        x, w = arg(args, kwargs, 0, "x"), arg(args, kwargs, 1, "weight")
        bias = arg(args, kwargs, 2, "bias") if op == "layer_norm" else None
        eps = arg(args, kwargs, 3 if op == "layer_norm" else 2, "eps", 1e-5)
        res, offset = kwargs.get("residual"), kwargs.get("offset", 0.0)
        validate(op, x, w, bias, eps, res, offset)
        # an eager call that records gradients resolves in its own bucket (CallSpec.train)
        train = not backward and eager_mode(x, w, bias, res) == AUTOGRAD_FN
        return _spec(op, x, w, bias, res, backward, offset, train=train)
    return explain_spec


LAYER_NORM = OpDef("layer_norm", layer_norm,
                   Reference(_reference.layer_norm_fwd, _reference.layer_norm_bwd, _reference.FEATURES),
                   _explain("layer_norm"), custom_ops=(_layer_norm, _layer_norm_backward),
                   cases=tuple(c for c in _cases.CASES if c.op == "layer_norm"), demo=_cases.demo("layer_norm"))
RMS_NORM = OpDef("rms_norm", rms_norm, Reference(_reference.rms_norm_fwd, _reference.rms_norm_bwd, _reference.FEATURES),
                 _explain("rms_norm"), custom_ops=(_rms_norm, _rms_norm_backward),
                 cases=tuple(c for c in _cases.CASES if c.op == "rms_norm"), demo=_cases.demo("rms_norm"))
OPDEFS = (LAYER_NORM, RMS_NORM)
