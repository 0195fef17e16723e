"""flash_attention: schema, validation, torch.library op, fake kernel and autograd.

Layout (batch, heads, seq, head_dim).  GQA/MQA when q heads are a multiple of kv heads.
q and kv lengths may differ; causal is aligned bottom-right (query i sees keys
j <= i + s_k - s_q, as when decoding with a KV cache).  `attn_mask` is a bool mask
(True = attend, SDPA's convention) or an additive float mask, broadcastable to
(b, h_q, s_q, s_k).  A fully masked row yields zeros and lse = -inf (never NaN); a row with a +inf or NaN
score yields NaN out and lse, as SDPA; empty operands give the empty / zero result without a kernel.  Gradients
flow to q, k, v and to an additive float mask that requires one (T5's relative position bias reaches the scores
that way): the mask's is dS, recomputed in torch in the op's backward (the kernels compute dS but return none).

Impl contract:  fn(ctx, q, k, v, attn_mask, causal, scale: float) -> (out, lse)
                backward(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale) -> (dq, dk, dv)
lse is (b, h_q, s_q), float32 (float64 for float64 inputs), natural log.
Layout: through torch.ops (compile, export) out, dq, dk, dv are contiguous, as the fake kernels
say (an impl returning another layout is copied there); eager calls return the impl's layout as it
is (the cuda Triton kernels write (b, s, h, d) memory, so a transformers transpose back is free)."""
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
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, FLOAT_DTYPES, INF, TORCH_OPS, carry_policy, carry_scope, check_same, check_scale,
                      check_tensor, EXACT_STRIDES, contiguous_lse, dispatch_modes, dt, eager_mode, function_modes,
                      functorch_level, grad_enabled, is_compiling, is_empty_call, len_bucket, own_pair_train_step, pair_backward,
                      raw_apply, register_train_step, resolved_autograd_function, same_kind, traced_train,
                      train_pair_backward, transforms_active, unwrap_if_dead)

from . import cases as _cases, reference as _reference

OP = "flash_attention"


def default_scale(q: Tensor, scale: float | None) -> float:
    """The softmax scale a call uses: its own, else 1 / sqrt(head_dim) (shared with sparse_attention)."""
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _well_formed(q, k, v, attn_mask, causal, scale) -> bool:
    """The common call without a mask, in few operations (a subset of what validate() accepts;
    anything else, masks included, takes the full checks, which name the problem)."""
    if attn_mask is not None or type(causal) is not bool or not isinstance(q, Tensor):
        return False
    if scale is not None and not (type(scale) is float and 0.0 < scale < INF):
        return False
    dtype, dev = q.dtype, q.device
    if dtype not in FLOAT_DTYPES:
        return False
    for t in (k, v):
        if not same_kind(t, dtype, dev):
            return False
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or ks != vs or not q.numel() or not k.numel():
        return False
    return ks[0] == qs[0] and ks[3] == qs[3] and qs[1] % ks[1] == 0


def validate(q, k, v, attn_mask, causal, scale) -> None:
    if _well_formed(q, k, v, attn_mask, causal, scale):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(OP, name, t, ndim=4, allow_empty=True)
    check_same(OP, "q", q, k=k, v=v)
    b, hq, sq, d = q.shape
    check_head_dim(OP, d)
    if k.shape[0] != b or v.shape[0] != b:
        raise InvalidArgumentError(OP, "k/v", f"batch {b} (same as q)", f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-1] != d:
        raise InvalidArgumentError(OP, "k", f"head_dim {d} (same as q)", f"head_dim {k.shape[-1]}")
    if v.shape[:3] != k.shape[:3]:
        raise InvalidArgumentError(OP, "v", f"(batch, heads, seq) = {tuple(k.shape[:3])} (same as k)", tuple(v.shape))
    if v.shape[-1] != d:
        raise InvalidArgumentError(OP, "v", f"head_dim {d} (same as q)", f"head_dim {v.shape[-1]}")
    hkv = k.shape[1]
    if hq % hkv if hkv else hq:
        raise InvalidArgumentError(OP, "k", f"a number of heads dividing q's {hq} (GQA/MQA)", f"{hkv} heads")
    if not isinstance(causal, bool):
        raise InvalidArgumentError(OP, "causal", "a bool", repr(causal))
    check_scale(OP, scale)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise InvalidArgumentError(OP, "attn_mask", "None or a tensor", type(attn_mask).__name__)
        if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
            raise InvalidArgumentError(OP, "attn_mask", f"dtype bool or {dt(q.dtype)} (additive)", dt(attn_mask.dtype))
        if attn_mask.device != q.device:
            raise InvalidArgumentError(OP, "attn_mask", f"on device {q.device}", str(attn_mask.device))
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, hq, sq, k.shape[2]))
            ok = attn_mask.dim() <= 4
        except RuntimeError:
            ok = False
        if not ok:
            raise InvalidArgumentError(OP, "attn_mask", f"broadcastable to (b, h_q, s_q, s_k) = {(b, hq, sq, k.shape[2])}",
                                       tuple(attn_mask.shape))


def check_head_dim(op: str, d: int) -> None:
    if d < 1:
        raise InvalidArgumentError(op, "q", "head_dim >= 1 (the softmax scale is 1 / sqrt(head_dim))", f"head_dim {d}")


def empty_result(q, k, v, attn_mask, causal, scale):
    """(out, lse) of attention on empty operands (batch, heads, s_q or s_k of 0; shared with sparse_attention), in
    plain differentiable torch: a row with no keys gives out 0 and lse -inf (the NaN / Inf policy), gradients are
    the zero / empty ones, and no kernel runs."""
    cdt = lse_dtype(q.dtype)
    hq, hk = q.shape[1], k.shape[1]
    rep = hq // hk if hk else 1
    kf, vf = k.to(cdt).repeat_interleave(rep, 1), v.to(cdt).repeat_interleave(rep, 1)
    s = (q.to(cdt) @ kf.transpose(-1, -2)) * default_scale(q, scale)      # no element: causality cannot matter
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -INF) if attn_mask.dtype == torch.bool else s + attn_mask.to(cdt)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vf
    return out.to(q.dtype), lse


def features(q, k, attn_mask, causal) -> frozenset[str]:
    f = set()
    if causal:
        f.add("causal")
    if attn_mask is not None:
        f.add("attn_mask_bool" if attn_mask.dtype == torch.bool else "attn_mask_float")
    if q.shape[1] != k.shape[1]:
        f.add("gqa")
    if q.shape[2] != k.shape[2]:
        f.add("cross_length")
    return frozenset(f)


def _key(q, k, attn_mask, causal, backward: bool, train: bool = False, inference: bool = False) -> tuple:
    # Everything the verdict of any impl may depend on, cheaply (no allocation).
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    return (OP, backward, device_key(q), q.dtype, d, causal,
            None if attn_mask is None else attn_mask.dtype, hq // hk, sq != sk,
            len_bucket(sq), len_bucket(sk), len_bucket(b * hq),
            sq == 1, sk == 1,   # single-token q/kv: some vendor kernels refuse them
            train, inference)


def _spec(q, k, attn_mask, causal, backward: bool, train: bool = False, inference: bool = False) -> CallSpec:
    return CallSpec(op=OP, device_type=q.device.type, dtype=q.dtype, features=features(q, k, attn_mask, causal),
                    bucket=(len_bucket(q.shape[2]), len_bucket(k.shape[2]), len_bucket(q.shape[0] * q.shape[1])),
                    head_dim=q.shape[-1], shapes=(tuple(q.shape), tuple(k.shape)), backward=backward,
                    train=train, inference=inference, bucket_names=("s_q<=", "s_k<=", "batch*heads<="),
                    device_index=device_index(q))


def _route(q, k, v, attn_mask, causal, scale):
    s = default_scale(q, scale)
    out, lse = dispatch.call(_key(q, k, attn_mask, causal, False), lambda: _spec(q, k, attn_mask, causal, False),
                             (q, k, v, attn_mask, causal, s))
    return out, contiguous_lse(lse)


def _infer_route(q, k, v, attn_mask, causal, scale):
    """Eager no-grad calls that do not return lse resolve in their own bucket (CallSpec.inference) and run
    the impl's `inference` forward where it has one: cuDNN computes the lse only when asked (a 3-8% longer
    forward at d64 on the H200, where SDPA's own no-grad calls skip it)."""
    s = default_scale(q, scale)
    return dispatch.call(_key(q, k, attn_mask, causal, False, inference=True),
                         lambda: _spec(q, k, attn_mask, causal, False, inference=True),
                         (q, k, v, attn_mask, causal, s), inference=True)[0]


def _train_resolve(q, k, v, attn_mask, causal, s):
    """Eager grad-recording calls resolve in their own bucket (CallSpec.train): autotune times each impl's
    forward with its own backward, as the step pays.  Chosen on forward time alone, a forward whose backward
    is slower (or whose output the best backward reads slower) cost up to 15% of fwd+bwd on the H200."""
    return dispatch.resolve(_key(q, k, attn_mask, causal, False, train=True),
                            lambda: _spec(q, k, attn_mask, causal, False, train=True),
                            (q, k, v, attn_mask, causal, s))


def _bwd_route(dout, q, k, v, out, lse, attn_mask, causal, scale):
    s = default_scale(q, scale)
    return dispatch.call(_key(q, k, attn_mask, causal, True), lambda: _spec(q, k, attn_mask, causal, True),
                         (dout, q, k, v, out, lse, attn_mask, causal, s))


@torch.library.custom_op("opsadv::flash_attention", mutates_args=(), tags=EXACT_STRIDES)
def _flash_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: bool,
                     scale: Optional[float], train: bool = False, scope: int = 0) -> tuple[Tensor, Tensor]:
    """train: a traced grad-recording call (torch.compile / export of a training step): resolved in the train
    bucket like an eager one, and flash_attention_backward(train=True) runs the same impl's backward.
    scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _flash_attention_impl(q, k, v, attn_mask, causal, scale, train)


def _flash_attention_impl(q, k, v, attn_mask, causal, scale, train):
    if train:
        s = default_scale(q, scale)
        r = _train_resolve(q, k, v, attn_mask, causal, s)
        dispatch.record_call(r.impl.id)
        out, lse = r.run(r.ctx, q, k, v, attn_mask, causal, s)
        lse = contiguous_lse(lse)
    else:
        out, lse = _route(q, k, v, attn_mask, causal, scale)
    return out.contiguous(), lse


@_flash_attention.register_fake
def _(q, k, v, attn_mask, causal, scale, train=False, scope=0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("opsadv::flash_attention_backward", mutates_args=(), tags=EXACT_STRIDES)
def _flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              attn_mask: Optional[Tensor], causal: bool, scale: Optional[float],
                              train: bool = False, scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """train: the backward of the impl the train bucket resolves for this forward (what
    flash_attention(train=True) ran; the bucket's choice is memoized, so it is the same impl)."""
    s = default_scale(q, scale)
    with in_scope(scope):
        grads = train_pair_backward(_train_resolve(q, k, v, attn_mask, causal, s) if train else None,
                                    dout, q, k, v, out, lse, (attn_mask, causal, s))
        dq, dk, dv = grads if grads is not None else _bwd_route(dout, q, k, v, out, lse, attn_mask, causal, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flash_attention_backward.register_fake
def _(dout, q, k, v, out, lse, attn_mask, causal, scale, train=False, scope=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, causal, scale, *train = inputs     # train: the torch.ops path's last argument
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.causal, ctx.scale, ctx.train, ctx.n_inputs = causal, scale, bool(train and train[0]), len(inputs)
    ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad and attn_mask.is_floating_point()


def mask_grad(dout, q, k, v, attn_mask, causal, scale) -> Tensor:
    """The gradient of an additive float mask: dS = P * (dO Vᵀ - rowsum(P * dO Vᵀ)), P the softmax recomputed from
    q, k and the mask (float32; float64 stays float64), summed to the mask's (broadcast) shape.  Fully masked rows
    have no probability and give none."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    kf, vf = (t.to(acc).repeat_interleave(rep, dim=1) for t in (k, v))
    s = (q.to(acc) @ kf.transpose(-1, -2)) * default_scale(q, scale) + attn_mask.to(acc)
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    dp = dout.to(acc) @ vf.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return ds.sum_to_size(attn_mask.shape).to(attn_mask.dtype)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    # the mask's slot, then the plain values
    none = (mask_grad(dout, q, k, v, attn_mask, ctx.causal, ctx.scale) if ctx.mask_grad else None,
            *(None,) * (ctx.n_inputs - 4))
    pair = pair_backward(ctx, dout, q, k, v, out, lse, (attn_mask, ctx.causal, ctx.scale))   # eager training call
    if pair is not None:
        return (*pair, *none)
    if eager_mode(dout, q, k, v) != TORCH_OPS:     # eager: the router directly (no torch.library boundary)
        return (*_bwd_route(dout, q, k, v, out, lse, attn_mask, ctx.causal, ctx.scale), *none)
    dq, dk, dv = torch.ops.opsadv.flash_attention_backward(dout, q, k, v, out, lse, attn_mask, ctx.causal, ctx.scale,
                                                           ctx.train, op_scope())
    return (dq, dk, dv, *none)


# the backward resolves under the forward's policy (the torch.ops path: the scope its call carried)
_op_setup, _op_backward = carry_scope(_setup_context, _backward)
_flash_attention.register_autograd(_op_backward, setup_context=_op_setup)
_setup_context, _backward = carry_policy(_setup_context, _backward)
# training calls: the impl the train bucket chose (timing each impl's forward + own backward) runs forward and its
# own backward: eager ones through this Function (pair_backward), or, for an impl with a `train` forward (an aten
# op with torch's derivative, e.g. cuDNN's), that forward under torch's own autograd, which skips the Function's
# Python forward and backward and the backward's dispatch (host cost); traced ones through the ops' train=True
_train_autograd = resolved_autograd_function("FlashAttentionTrainFn", _setup_context, _backward, stats=(1,),
                                             finish=lambda o: (o[0], contiguous_lse(o[1])))
register_train_step(OP, own_pair_train_step)


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
_train_raw = raw_apply(_train_autograd)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                    attn_mask: Tensor | None = None, return_lse: bool = False):
    """Fused softmax(q kᵀ · scale [+ mask]) v.  Returns out (b, h_q, s_q, d), or (out, lse) with
    return_lse=True (lse is not differentiable).  Gradients flow to q, k, v and to a float mask that requires one."""
    fk = r = None
    # the fast path (as the norms', ops/norm): the exact metadata of an identical call that took the full path
    if type(causal) is bool and (scale is None or type(scale) is float) \
            and not (is_compiling() or dispatch_modes() or function_modes()) and functorch_level() is None:
        try:
            train = grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or attn_mask is not None and attn_mask.requires_grad)
            lse_out = bool(return_lse)
            fk = (OP, (_scoped.get() or _policy._global).serial, train, lse_out, causal, scale, type(q), q.dtype,
                  q.device, q.shape, type(k), k.dtype, k.device, k.shape, type(v), v.dtype, v.device, v.shape,
                  None if attn_mask is None else (type(attn_mask), attn_mask.dtype, attn_mask.device, attn_mask.shape))
            r = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = r = None
    if r is not None:
        if _tracers:
            dispatch.record(r.impl.id)
        s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if train:
            if r.impl.train is not None:            # torch's own autograd (KernelImpl.train)
                out, lse = r.impl.train(r.ctx, q, k, v, attn_mask, causal, s)
                lse = contiguous_lse(lse)
            elif transforms_active():
                out, lse = _train_autograd(r, q, k, v, attn_mask, causal, s)
            else:
                out, lse = _train_raw(r, unwrap_if_dead(q), unwrap_if_dead(k), unwrap_if_dead(v),
                                      attn_mask if attn_mask is None else unwrap_if_dead(attn_mask), causal, s)
        elif not lse_out:
            return r.infer(r.ctx, q, k, v, attn_mask, causal, s)[0]
        else:
            out, lse = r.run(r.ctx, q, k, v, attn_mask, causal, s)
            lse = contiguous_lse(lse)
        return (out, lse.detach()) if lse_out else out
    validate(q, k, v, attn_mask, causal, scale)
    if is_empty_call(q, k, v):
        out, lse = empty_result(q, k, v, attn_mask, causal, scale)
        return (out, lse.detach()) if return_lse else out
    mode = eager_mode(q, k, v, attn_mask)
    if mode == DIRECT:
        if not return_lse:
            out = _infer_route(q, k, v, attn_mask, causal, scale)
            dispatch.learn(fk, _key(q, k, attn_mask, causal, False, inference=True))
            return out
        out, lse = _route(q, k, v, attn_mask, causal, scale)
        dispatch.learn(fk, _key(q, k, attn_mask, causal, False))
    elif mode == AUTOGRAD_FN:
        s = default_scale(q, scale)
        r = _train_resolve(q, k, v, attn_mask, causal, s)
        dispatch.learn(fk, None, r)
        dispatch.record_call(r.impl.id)
        if r.impl.train is not None:        # an impl built from torch's differentiable ops: torch's autograd
            out, lse = r.impl.train(r.ctx, q, k, v, attn_mask, causal, s)
            lse = contiguous_lse(lse)
        else:
            out, lse = _train_autograd(r, q, k, v, attn_mask, causal, s)
    else:
        out, lse = torch.ops.opsadv.flash_attention(q, k, v, attn_mask, causal, scale, traced_train(q, k, v),
                                                    op_scope())
    return (out, lse.detach()) if return_lse else out


# ---- the op's definition -----------------------------------------------------------------------------------
def attention_buckets(mode, backward: bool, kwargs: dict) -> tuple[bool, bool]:
    """(train, inference) of an attention call, as the attention ops route it: grad-recording eager calls in the
    train bucket, no-grad ones that do not return lse in the inference bucket."""
    train = not backward and mode == AUTOGRAD_FN
    inference = not backward and mode == DIRECT and not kwargs.get("return_lse", False)
    return train, inference


def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    q, k, v = arg(args, kwargs, 0, "q"), arg(args, kwargs, 1, "k"), arg(args, kwargs, 2, "v")
    mask, causal, scale = kwargs.get("attn_mask"), kwargs.get("causal", False), kwargs.get("scale")
    validate(q, k, v, mask, causal, scale)
    train, inference = attention_buckets(eager_mode(q, k, v, mask), backward, kwargs)
    return _spec(q, k, mask, causal, backward, train=train, inference=inference)


OPDEF = OpDef(OP, flash_attention, Reference(_reference.attention_fwd, _reference.attention_bwd, _reference.FEATURES),
              explain_spec, custom_ops=(_flash_attention, _flash_attention_backward), cases=tuple(_cases.CASES),
              demo=_cases.demo, precision="attention")
OPDEFS = (OPDEF,)
