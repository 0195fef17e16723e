"""linear_cross_entropy: a causal LM's head and loss, cross_entropy(hidden @ weight.T + bias, labels), without the
(tokens, vocab) logits in memory.

hidden (..., H), weight (V, H), labels (...) int (ignore_index: no loss, no gradient), bias (V,).  Per token:
    z = softcap * tanh(z / softcap)                                    (softcap set: Gemma-2's final logit softcap)
    loss = (1 - eps) (lse - z_y) + eps (lse - mean z) + z_loss lse^2     (eps = label_smoothing, as F.cross_entropy)
reduction "mean" (over the tokens not ignored; none of them: nan, as torch), "sum" or "none" (per token).  The loss
and lse are float32 (float64 for float64 inputs); gradients flow to hidden, weight and bias.

Impls run over chunks of tokens, so only a chunk's logits exist at a time.  A call that records gradients with
reduction "mean" / "sum" gets them from the forward (each chunk's d loss / d logits is known once its lse is, so
the chunk's dh and dW are computed there and the logits are never recomputed: three GEMMs in all); the backward
scales them by the loss's gradient.  reduction "none" needs the per-token gradients, so its backward recomputes.

Impl contract:
  fn(ctx, hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap, grads_in_forward)
      -> (loss, lse, dh, dw, db)      hidden (N, H), labels (N,); dh / dw / db for a loss gradient of 1 when
                                       grads_in_forward, else 0-element tensors (db too without a bias)
  backward(ctx, grad, hidden, weight, labels, bias, lse, ignore_index, label_smoothing, reduction, z_loss, softcap)
      -> (dh, dw, db or a 0-element tensor)"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, TORCH_OPS, acc_dtype, autograd_function, carry_policy,
                                   carry_scope, check_choice, eager_mode, grad_enabled,
                                   len_bucket)
from opsadv.core.policy import in_scope, op_scope

from . import cases as _cases, reference as _reference, stats as _stats
from .checks import validate_head

OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")

# opsadv.distributed installs it once torch.distributed.tensor loads (no DTensor exists before): the call on a weight
# split over its vocabulary (vocab-parallel: opsadv/distributed/vocab_parallel.py), None for any other weight
_vocab_parallel: Callable | None = None


def install_vocab_parallel(fn: Callable) -> None:
    global _vocab_parallel
    _vocab_parallel = fn


def validate(hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, reduction="mean",
             z_loss=0.0, softcap=None) -> None:
    validate_head(OP, hidden, weight, labels, bias, ignore_index, softcap)
    if not isinstance(label_smoothing, (int, float)) or isinstance(label_smoothing, bool) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise InvalidArgumentError(OP, "label_smoothing", "a float in [0, 1]", repr(label_smoothing))
    check_choice(OP, "reduction", reduction, REDUCTIONS)
    if not isinstance(z_loss, (int, float)) or isinstance(z_loss, bool) or not (z_loss >= 0.0 and math.isfinite(z_loss)):
        raise InvalidArgumentError(OP, "z_loss", "a finite float >= 0", repr(z_loss))


def _features(bias, label_smoothing, reduction, z_loss, softcap) -> frozenset:
    f = set()
    if bias is not None:
        f.add("bias")
    if label_smoothing:
        f.add("label_smoothing")
    if z_loss:
        f.add("z_loss")
    if softcap is not None:
        f.add("softcap")
    if reduction != "mean":
        f.add(f"reduction_{reduction}")
    return frozenset(f)


def _key(hidden, weight, bias, label_smoothing, reduction, z_loss, softcap, backward) -> tuple:
    return (OP, backward, device_key(hidden), hidden.dtype, len_bucket(hidden.shape[0]), weight.shape[0],
            hidden.shape[1], bias is not None, bool(label_smoothing), reduction, bool(z_loss), softcap is not None)


def _spec(hidden, weight, bias, label_smoothing, reduction, z_loss, softcap, backward) -> CallSpec:
    return CallSpec(OP, hidden.device.type, hidden.dtype, _features(bias, label_smoothing, reduction, z_loss, softcap),
                    (len_bucket(hidden.shape[0]), weight.shape[0], hidden.shape[1]),
                    shapes=(tuple(hidden.shape), tuple(weight.shape)), backward=backward,
                    bucket_names=("tokens<=", "V=", "H="), device_index=device_index(hidden))


def _route(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap, grads_in_forward):
    return dispatch.call(_key(hidden, weight, bias, label_smoothing, reduction, z_loss, softcap, False),
                         lambda: _spec(hidden, weight, bias, label_smoothing, reduction, z_loss, softcap, False),
                         (hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap,
                          grads_in_forward))


def _bwd_route(grad, hidden, weight, labels, bias, lse, ignore_index, label_smoothing, reduction, z_loss, softcap):
    return dispatch.call(_key(hidden, weight, bias, label_smoothing, reduction, z_loss, softcap, True),
                         lambda: _spec(hidden, weight, bias, label_smoothing, reduction, z_loss, softcap, True),
                         (grad, hidden, weight, labels, bias, lse, ignore_index, label_smoothing, reduction, z_loss,
                          softcap))


def _fake_grads(hidden, weight, bias, grads_in_forward):
    if not grads_in_forward:
        return tuple(hidden.new_empty((0,)) for _ in range(3))
    return (hidden.new_empty(hidden.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,)))


@torch.library.custom_op("opsadv::linear_cross_entropy", mutates_args=())
def _lce(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
         label_smoothing: float, reduction: str, z_loss: float, softcap: Optional[float], grads_in_forward: bool,
         scope: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        loss, lse, dh, dw, db = _route(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction,
                                       z_loss, softcap, grads_in_forward)
    return loss, lse, dh, dw, db if db is not None else hidden.new_empty((0,))


@_lce.register_fake
def _(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap, grads_in_forward,
      scope=0):
    adt = acc_dtype(hidden)
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=adt)
    return (loss, hidden.new_empty((n,), dtype=adt), *_fake_grads(hidden, weight, bias, grads_in_forward))


@torch.library.custom_op("opsadv::linear_cross_entropy_backward", mutates_args=())
def _lce_backward(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], lse: Tensor,
                  ignore_index: int, label_smoothing: float, reduction: str, z_loss: float, softcap: Optional[float],
                  scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    with in_scope(scope):
        dh, dw, db = _bwd_route(grad, hidden, weight, labels, bias, lse, ignore_index, label_smoothing, reduction,
                                z_loss, softcap)
    return dh, dw, db if db is not None else hidden.new_empty((0,))


@_lce_backward.register_fake
def _(grad, hidden, weight, labels, bias, lse, ignore_index, label_smoothing, reduction, z_loss, softcap, scope=0):
    return _fake_grads(hidden, weight, bias, True)


_ARGS = ("ignore_index", "label_smoothing", "reduction", "z_loss", "softcap")


def _setup(ctx, inputs, output):
    hidden, weight, labels, bias, *rest = inputs
    ctx.args = tuple(rest[:5])
    ctx.grads_in_forward = rest[5]
    ctx.has_bias = bias is not None
    _, lse, dh, dw, db = output
    if ctx.grads_in_forward:
        ctx.save_for_backward(dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, labels, bias, lse)


def _backward(ctx, grad, *_unused):
    if ctx.grads_in_forward:
        # scaled in place: a second weight-sized gradient would double the op's peak memory; so a second backward
        # through the same graph (retain_graph) is refused rather than scaled twice
        if getattr(ctx, "consumed", False):
            raise RuntimeError("opsadv.linear_cross_entropy: a call whose gradients were computed in the forward "
                               "(reduction 'mean' / 'sum') supports one backward; use reduction='none' and sum it to "
                               "backpropagate twice")
        ctx.consumed = True
        dh, dw, db = ctx.saved_tensors
        g = grad.to(dh.dtype) if grad.dtype != dh.dtype else grad
        # in place only on eager tensors: a traced backward (AOT, functionalized) must stay out of place
        eager = not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in (dh, dw, g))
        scale = torch.Tensor.mul_ if eager else torch.mul
        dbias = scale(db, g.to(db.dtype)) if ctx.has_bias else None
        return (scale(dh, g), scale(dw, g.to(dw.dtype)), None, dbias, *(None,) * 6)
    hidden, weight, labels, bias, lse = ctx.saved_tensors
    if eager_mode(grad, hidden, weight) != TORCH_OPS:
        dh, dw, db = _bwd_route(grad, hidden, weight, labels, bias, lse, *ctx.args)
    else:
        dh, dw, db = torch.ops.opsadv.linear_cross_entropy_backward(grad, hidden, weight, labels, bias, lse, *ctx.args,
                                                                    op_scope())
    return (dh, dw, None, db if ctx.has_bias else None, *(None,) * 6)


_op_setup, _op_backward = carry_scope(_setup, _backward)
_lce.register_autograd(_op_backward, setup_context=_op_setup)
_setup, _backward = carry_policy(_setup, _backward)
_eager_autograd = autograd_function("LinearCrossEntropyFn", _route, _setup, _backward, stats=(1, 2, 3, 4))


def _empty_call(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap, return_lse):
    """No tokens, no vocabulary or no hidden features: the plain differentiable expression (no kernel runs)."""
    h2, l1 = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    loss = _reference.lce_plain(h2, weight, l1, bias, ignore_index, float(label_smoothing), reduction, float(z_loss),
                                softcap)
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    if not return_lse:
        return loss
    z, _ = _reference.logits_of(h2, weight, bias, softcap)
    return loss, torch.logsumexp(z, -1).detach().reshape(labels.shape)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                         z_loss: float = 0.0, softcap: float | None = None, return_lse: bool = False):
    """cross_entropy(hidden @ weight.T + bias, labels) without materializing the logits (module docstring).
    Returns the loss (a float32 scalar, or per token with reduction="none"), or (loss, lse) with return_lse=True
    (lse per token, not differentiable).  A DTensor weight split over the vocabulary (Shard(0), as ColwiseParallel
    leaves lm_head's) runs vocab-parallel, without gathering it (docs/distributed.md)."""
    validate(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap)
    if not isinstance(return_lse, bool):
        raise InvalidArgumentError(OP, "return_lse", "a bool", repr(return_lse))
    label_smoothing, z_loss = float(label_smoothing), float(z_loss)
    softcap = float(softcap) if softcap is not None else None
    if _vocab_parallel is not None and type(weight) is not Tensor:     # (a DTensor: the distributed paths)
        out = _vocab_parallel(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap,
                              return_lse)
        if out is not None:
            return out
    if hidden.numel() == 0 or weight.numel() == 0:
        return _empty_call(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap,
                           return_lse)
    h2, l1 = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    mode = eager_mode(h2, weight, bias)
    needs = grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                or bias is not None and bias.requires_grad)
    in_fwd = needs and reduction != "none"
    args = (h2, weight, l1, bias, ignore_index, label_smoothing, reduction, z_loss, softcap, in_fwd)
    if mode == TORCH_OPS:
        loss, lse, *_ = torch.ops.opsadv.linear_cross_entropy(*args, op_scope())
    elif mode == AUTOGRAD_FN:
        loss, lse, *_ = _eager_autograd(*args)
    else:
        loss, lse, *_ = _route(*args)
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    return (loss, lse.reshape(labels.shape)) if return_lse else loss


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    hidden, weight, labels = (arg(args, kwargs, i, n) for i, n in enumerate(("hidden", "weight", "labels")))
    kw = {n: kwargs[n] for n in ("bias", *_ARGS) if n in kwargs}
    validate(hidden, weight, labels, **kw)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    return _spec(h2, weight, kw.get("bias"), kw.get("label_smoothing", 0.0), kw.get("reduction", "mean"),
                 kw.get("z_loss", 0.0), kw.get("softcap"), backward)


OPDEF = OpDef(OP, linear_cross_entropy, Reference(_reference.lce_fwd, _reference.lce_bwd, _reference.FEATURES),
              explain_spec, custom_ops=(_lce, _lce_backward), cases=tuple(_cases.CASES), demo=_cases.demo,
              precision="matmul")
OPDEFS = (OPDEF, _stats.OPDEF)
linear_cross_entropy_stats = _stats.linear_cross_entropy_stats
