"""attention_merge_: absorb a partial attention result into running accumulators by log-sum-exp, in place.

    acc_out, acc_lse = attention_merge_(acc_out, acc_lse, out, lse)

Two partial results over disjoint key sets, (acc_out, acc_lse) and (out, lse), combine exactly into
    new = logaddexp(acc_lse, lse),   acc_out = acc_out * exp(acc_lse - new) + out * exp(lse - new),   acc_lse = new
(FlashInfer's merge_state_in_place; the combine step of ring attention and of split-KV decoding).  A row with no
key on either side (acc_lse = lse = -inf) stays acc_out * 0 + out * 0 = 0 (for finite values), acc_lse = -inf: the
exponents are taken against 0 there, never -inf - -inf (NaN).  A side with lse = -inf gets weight 0.

- acc_out (b, h, s, d) and acc_lse (b, h, s): float32 (float64 stays float64: the reference impl), the same dtype;
  any strides (views such as a slice of rows of a bigger accumulator, or (b, s, h, d) memory), but no broadcast
  (stride-0) dims: they are written in place, and only their own elements are.
- out (b, h, s, d): float16 / bfloat16 / float32 / float64, any strides (the attention kernels' (b, s, h, d) memory
  viewed as (b, h, s, d)); lse (b, h, s): float32 / float64, natural log (flash_attention(return_lse=True)'s).
- Arithmetic in the accumulators' dtype.  Returns (acc_out, acc_lse), the tensors given, updated.  No gradients:
  a call whose inputs require grad (with grad enabled) is refused (ring attention merges inside its own autograd
  Function, whose backward does not differentiate the merge).

Impl contract:
  fn(ctx, acc_out, acc_lse, out, lse) -> None      acc_out / acc_lse updated in place; no other memory written"""
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
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core.policy import in_scope, op_scope

from . import cases as _cases, reference as _reference

OP = "attention_merge_"
ACC_DTYPES = (torch.float32, torch.float64)
_NAMES = ("acc_out", "acc_lse", "out", "lse")


def validate(acc_out, acc_lse, out, lse) -> None:
    """Shapes, dtypes, devices and the accumulators' layout (cheap: no tensor value is read)."""
    check_tensor(OP, "acc_out", acc_out, ndim=4, dtypes=ACC_DTYPES, allow_empty=True)
    check_tensor(OP, "acc_lse", acc_lse, ndim=3, dtypes=ACC_DTYPES, allow_empty=True)
    check_tensor(OP, "out", out, ndim=4, dtypes=FLOAT_DTYPES, allow_empty=True)
    check_tensor(OP, "lse", lse, ndim=3, dtypes=ACC_DTYPES, allow_empty=True)
    if acc_lse.dtype != acc_out.dtype:
        raise InvalidArgumentError(OP, "acc_lse", f"dtype {dt(acc_out.dtype)} (same as acc_out)", dt(acc_lse.dtype))
    rows = tuple(acc_out.shape[:-1])
    if tuple(acc_lse.shape) != rows:
        raise InvalidArgumentError(OP, "acc_lse", f"shape {rows} (acc_out's (b, h, s, d) without d)",
                                   tuple(acc_lse.shape))
    if out.shape != acc_out.shape:
        raise InvalidArgumentError(OP, "out", f"shape {tuple(acc_out.shape)} (same as acc_out)", tuple(out.shape))
    if tuple(lse.shape) != rows:
        raise InvalidArgumentError(OP, "lse", f"shape {rows} (same as acc_lse)", tuple(lse.shape))
    for name, t in (("acc_lse", acc_lse), ("out", out), ("lse", lse)):
        if t.device != acc_out.device:
            raise InvalidArgumentError(OP, name, f"on device {acc_out.device} (same as acc_out)", str(t.device))
    for name, t in (("acc_out", acc_out), ("acc_lse", acc_lse)):
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise InvalidArgumentError(OP, name, "a tensor without broadcast (stride 0) dims: it is written in place",
                                       f"strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def _refuse_grad(acc_out, acc_lse, out, lse) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in zip(_NAMES, (acc_out, acc_lse, out, lse)):
        if t.requires_grad:
            raise InvalidArgumentError(OP, name, "a tensor that does not require grad (attention_merge_ has no "
                                       "backward: run it under torch.no_grad(), or detach)", "requires_grad=True")


def _key(acc_out: Tensor, out: Tensor, lse: Tensor) -> tuple:
    b, h, s, d = acc_out.shape
    return (OP, device_key(acc_out), acc_out.dtype, out.dtype, lse.dtype, d, len_bucket(b * h * s))


def _spec(acc_out: Tensor, out: Tensor, backward: bool = False) -> CallSpec:
    b, h, s, d = acc_out.shape
    return CallSpec(OP, acc_out.device.type, acc_out.dtype, frozenset(), (len_bucket(b * h * s), d), head_dim=d,
                    shapes=(tuple(acc_out.shape), tuple(out.shape)), backward=backward,
                    bucket_names=("rows<=", "D="), device_index=device_index(acc_out))


def _route(acc_out, acc_lse, out, lse) -> None:
    dispatch.call(_key(acc_out, out, lse), lambda: _spec(acc_out, out), (acc_out, acc_lse, out, lse))


@torch.library.custom_op("opsadv::attention_merge_", mutates_args=("acc_out", "acc_lse"))
def _merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, scope: int = 0) -> None:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        _route(acc_out, acc_lse, out, lse)


@_merge.register_fake
def _(acc_out, acc_lse, out, lse, scope=0):
    return None


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped


def _meta(t):
    return type(t), t.dtype, t.device, t.shape, t.stride()


def attention_merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """acc_out (b, h, s, d) and acc_lse (b, h, s), float32 / float64 accumulators, absorb the partial result (out,
    lse) in place by log-sum-exp (module docstring); returns (acc_out, acc_lse)."""
    fk = hit = None
    # the fast path (as paged_attention's): the exact metadata (strides included: validate reads them) of an
    # identical no-grad call that took the full path; a ring step repeats its shapes every layer
    if not (is_compiling() or dispatch_modes() or function_modes()) and functorch_level() is None:
        try:
            if not (grad_enabled() and (acc_out.requires_grad or acc_lse.requires_grad or out.requires_grad
                                        or lse.requires_grad)):
                fk = (OP, (_scoped.get() or _policy._global).serial, _meta(acc_out), _meta(acc_lse), _meta(out),
                      _meta(lse))
                hit = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
    if hit is not None:
        if _tracers:
            dispatch.record(hit.impl.id)
        hit.run(hit.ctx, acc_out, acc_lse, out, lse)
        return acc_out, acc_lse
    validate(acc_out, acc_lse, out, lse)
    _refuse_grad(acc_out, acc_lse, out, lse)
    if acc_out.numel() == 0:            # no row (b, h or s of 0), or d = 0: plain torch, no kernel
        _reference.merge_fwd(None, acc_out, acc_lse, out, lse)
        return acc_out, acc_lse
    if eager_mode(acc_out, acc_lse, out, lse) == TORCH_OPS:
        torch.ops.opsadv.attention_merge_(acc_out, acc_lse, out, lse, op_scope())
    else:
        _route(acc_out, acc_lse, out, lse)
        dispatch.learn(fk, _key(acc_out, out, lse))
    return acc_out, acc_lse


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    acc_out, acc_lse, out, lse = (arg(args, kwargs, i, n) for i, n in enumerate(_NAMES))
    validate(acc_out, acc_lse, out, lse)
    return _spec(acc_out, out, backward)


OPDEF = OpDef(OP, attention_merge_, Reference(_reference.merge_fwd, None, _reference.FEATURES), explain_spec,
              custom_ops=(_merge,), cases=tuple(_cases.CASES), demo=None,
              description="merge a partial attention result into float32 accumulators by lse, in place")
OPDEFS = (OPDEF,)
