"""linear_cross_entropy_stats: per token, three statistics of the logits over a slice of a vocabulary, without the
(tokens, rows) logits in memory: the per-shard work of the vocab-parallel loss (opsadv/distributed/vocab_parallel.py).

    stats = linear_cross_entropy_stats(hidden, weight, labels, bias=None, ignore_index=-100, softcap=None,
                                       vocab_start=0)

weight (V_r, H) holds rows [vocab_start, vocab_start + V_r) of a vocabulary (bias (V_r,) alike); hidden (..., H),
labels (...) int.  z = hidden @ weight.T + bias, softcapped (softcap * tanh(z / softcap)) where asked.  stats
(3, ...) float32 (float64 for float64 inputs):
    stats[0] = logsumexp_j z_j       (-inf for a slice of no row)
    stats[1] = z_{label - vocab_start} where label != ignore_index and it falls in the slice, else 0
    stats[2] = sum_j z_j
Differentiable w.r.t. hidden, weight and bias: for gradients (g0, g1, g2) of the three, d / d z_j = g0 softmax_j +
g1 [j = label - vocab_start] + g2.  Ranks holding the slices of one vocabulary combine their stats into the loss
(lse = logsumexp over slices, target and sum added); `stats_backward` runs the backward for gradients the caller
computed itself (the vocab-parallel loss's autograd Function).

Impl contract:
  fn(ctx, hidden, weight, labels, bias, ignore_index, softcap, vocab_start) -> stats (3, N)
                                                                       hidden (N, H), labels (N,)
  backward(ctx, grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start)
      -> (dh, dw, db or a 0-element tensor)                            grad (3, N), stats the forward's"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.op_common import (AUTOGRAD_FN, TORCH_OPS, acc_dtype, autograd_function, carry_policy, carry_scope,
                                   eager_mode, len_bucket)
from opsadv.core.opdef import Case, OpDef, Reference, arg, rand
from opsadv.core.policy import in_scope, op_scope

from . import reference as _reference
from .checks import validate_head

OP = "linear_cross_entropy_stats"


def validate(hidden, weight, labels, bias=None, ignore_index=-100, softcap=None, vocab_start=0) -> None:
    validate_head(OP, hidden, weight, labels, bias, ignore_index, softcap)
    if type(vocab_start) is not int or vocab_start < 0:
        raise InvalidArgumentError(OP, "vocab_start", "an int >= 0 (the slice's first vocabulary row)",
                                   repr(vocab_start))


def _validate_grad(grad, hidden, stats) -> None:
    n = hidden.shape[0]
    for name, t in (("grad", grad), ("stats", stats)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (3, n) or not t.is_floating_point():
            raise InvalidArgumentError(OP, name, f"a float tensor of shape (3, {n}) (the forward's stats' shape)",
                                       tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__)
        if t.device != hidden.device:
            raise InvalidArgumentError(OP, name, f"on device {hidden.device} (same as hidden)", str(t.device))


def _features(bias, softcap) -> frozenset:
    return frozenset(n for n, on in (("bias", bias is not None), ("softcap", softcap is not None)) if on)


def _key(hidden, weight, bias, softcap, backward) -> tuple:
    return (OP, backward, device_key(hidden), hidden.dtype, len_bucket(hidden.shape[0]), weight.shape[0],
            hidden.shape[1], bias is not None, softcap is not None)


def _spec(hidden, weight, bias, softcap, backward) -> CallSpec:
    return CallSpec(OP, hidden.device.type, hidden.dtype, _features(bias, softcap),
                    (len_bucket(hidden.shape[0]), weight.shape[0], hidden.shape[1]),
                    shapes=(tuple(hidden.shape), tuple(weight.shape)), backward=backward,
                    bucket_names=("tokens<=", "V=", "H="), device_index=device_index(hidden))


def _route(hidden, weight, labels, bias, ignore_index, softcap, vocab_start):
    return dispatch.call(_key(hidden, weight, bias, softcap, False), lambda: _spec(hidden, weight, bias, softcap, False),
                         (hidden, weight, labels, bias, ignore_index, softcap, vocab_start))


def _bwd_route(grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start):
    return dispatch.call(_key(hidden, weight, bias, softcap, True), lambda: _spec(hidden, weight, bias, softcap, True),
                         (grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start))


@torch.library.custom_op("opsadv::linear_cross_entropy_stats", mutates_args=())
def _stats(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
           softcap: Optional[float], vocab_start: int, scope: int = 0) -> Tensor:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _route(hidden, weight, labels, bias, ignore_index, softcap, vocab_start)


@_stats.register_fake
def _(hidden, weight, labels, bias, ignore_index, softcap, vocab_start, scope=0):
    return hidden.new_empty((3, hidden.shape[0]), dtype=acc_dtype(hidden))


@torch.library.custom_op("opsadv::linear_cross_entropy_stats_backward", mutates_args=())
def _stats_backward(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor],
                    stats: Tensor, ignore_index: int, softcap: Optional[float], vocab_start: int,
                    scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    with in_scope(scope):
        dh, dw, db = _bwd_route(grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start)
    return dh, dw, db if db is not None else hidden.new_empty((0,))


@_stats_backward.register_fake
def _(grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start, scope=0):
    return (hidden.new_empty(hidden.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,)))


def _empty(hidden, weight) -> bool:
    return hidden.numel() == 0 or weight.numel() == 0


def stats_backward(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, stats: Tensor,
                   ignore_index: int = -100, softcap: float | None = None,
                   vocab_start: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dh, dw, db or None) of linear_cross_entropy_stats for gradients grad (3, N) of its stats (3, N), on hidden
    (N, H) and labels (N,): for callers that run their own autograd (the vocab-parallel loss)."""
    validate(hidden, weight, labels, bias, ignore_index, softcap, vocab_start)
    if hidden.dim() != 2:
        raise InvalidArgumentError(OP, "hidden", "a 2-d (N, H) tensor (stats_backward takes the flattened tokens)",
                                   tuple(hidden.shape))
    _validate_grad(grad, hidden, stats)
    softcap = float(softcap) if softcap is not None else None
    if _empty(hidden, weight):          # no token, row or feature: plain torch, no kernel
        dh, dw, db = _reference.stats_bwd(None, grad, hidden, weight, labels, bias, stats, ignore_index, softcap,
                                          vocab_start)
    elif eager_mode(grad, hidden, weight, bias) == TORCH_OPS:
        dh, dw, db = torch.ops.opsadv.linear_cross_entropy_stats_backward(grad, hidden, weight, labels, bias, stats,
                                                                          ignore_index, softcap, vocab_start,
                                                                          op_scope())
    else:
        dh, dw, db = _bwd_route(grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start)
    return dh, dw, db if bias is not None else None


def _setup(ctx, inputs, output):
    hidden, weight, labels, bias, *rest = inputs
    ctx.args = tuple(rest[:3])
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, labels, bias, output)


def _backward(ctx, grad):
    hidden, weight, labels, bias, stats = ctx.saved_tensors
    if eager_mode(grad, hidden, weight) != TORCH_OPS:
        dh, dw, db = _bwd_route(grad, hidden, weight, labels, bias, stats, *ctx.args)
    else:
        dh, dw, db = torch.ops.opsadv.linear_cross_entropy_stats_backward(grad, hidden, weight, labels, bias, stats,
                                                                          *ctx.args, op_scope())
    return dh, dw, None, db if ctx.has_bias else None, None, None, None


_op_setup, _op_backward = carry_scope(_setup, _backward)
_stats.register_autograd(_op_backward, setup_context=_op_setup)
_setup, _backward = carry_policy(_setup, _backward)
_eager_autograd = autograd_function("LinearCrossEntropyStatsFn", _route, _setup, _backward)


def linear_cross_entropy_stats(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                               ignore_index: int = -100, softcap: float | None = None, vocab_start: int = 0) -> Tensor:
    """(3, ...) per token over weight's rows (a vocabulary slice from row vocab_start): logsumexp of the logits, the
    label's logit where it is in the slice (else 0), the logits' sum (module docstring).  Differentiable."""
    validate(hidden, weight, labels, bias, ignore_index, softcap, vocab_start)
    softcap = float(softcap) if softcap is not None else None
    h2, l1 = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    args = (h2, weight, l1, bias, ignore_index, softcap, vocab_start)
    if _empty(hidden, weight):          # no token, row or feature: the plain differentiable expression
        out = _reference.stats_fwd(None, *args)
    else:
        mode = eager_mode(h2, weight, bias)
        if mode == TORCH_OPS:
            out = torch.ops.opsadv.linear_cross_entropy_stats(*args, op_scope())
        elif mode == AUTOGRAD_FN:
            out = _eager_autograd(*args)
        else:
            out = _route(*args)
    return out.reshape((3, *labels.shape))


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    hidden, weight, labels = (arg(args, kwargs, i, n) for i, n in enumerate(("hidden", "weight", "labels")))
    kw = {n: kwargs[n] for n in ("bias", "ignore_index", "softcap", "vocab_start") if n in kwargs}
    validate(hidden, weight, labels, **kw)
    return _spec(hidden.reshape(-1, hidden.shape[-1]), weight, kw.get("bias"), kw.get("softcap"), backward)


def _case(n, h, v, start, ignored=0.0, with_bias=False, **kw):
    def build(dtype, device, g):
        hidden = rand((n, h), dtype, device, g)
        weight = rand((v, h), dtype, device, g, scale=h ** -0.5)
        # labels over a vocabulary three times the slice: some in it, some before, some after
        labels = torch.randint(0, 3 * v + start, (n,), generator=g)
        if ignored:
            labels[torch.rand(n, generator=g) < ignored] = -100
        extra = dict(kw, vocab_start=start)
        if with_bias:
            extra["bias"] = rand((v,), dtype, device, g, scale=0.5)
        return (hidden, weight, labels.to(device)), extra
    return build


CASES = [
    Case(OP, "one_token", _case(1, 8, 5, 0), (0, 1)),
    Case(OP, "odd_slice_bias", _case(127, 24, 203, 100, ignored=0.2, with_bias=True), (0, 1)),
    Case(OP, "softcap", _case(19, 8, 37, 7, ignored=0.3, softcap=5.0), (0, 1), quick=False),
]

OPDEF = OpDef(OP, linear_cross_entropy_stats,
              Reference(_reference.stats_fwd, _reference.stats_bwd, _reference.STATS_FEATURES), explain_spec,
              custom_ops=(_stats, _stats_backward), cases=tuple(CASES), precision="matmul",
              description="the vocab-parallel loss's per-shard statistics (lse, target logit, logit sum)")
