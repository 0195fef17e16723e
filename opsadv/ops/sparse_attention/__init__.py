"""sparse_attention: attention restricted by a SparseLayout (see .layout).

Impl contract:  fn(ctx, q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal,
                   window_left, window_right, num_global, scale: float, dense_blocks: bool,
                   max_seqlen: int) -> (out, lse)
                backward(ctx, dout, q, k, v, out, lse, block_mask, key_padding_mask, cu_seqlens,
                         block_size, causal, window_left, window_right, num_global, scale,
                         dense_blocks, max_seqlen) -> (dq, dk, dv)
window_left/right are -1 without a window.  dense_blocks / max_seqlen are the layout's host-side
facts (block mask known all True; bound on the packed segments' lengths, -1 unknown or not packed);
they also show as the hint features "dense_blocks" / "max_seqlen_known", which an impl may require
in its check() but need not declare (kernel.HINT_FEATURES).  Layout of out (dq, dk, dv): as for flash_attention
(contiguous through torch.ops; the impl's own in eager calls)."""
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
from .layout import SparseLayout
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, TORCH_OPS, carry_policy, carry_scope, check_same, check_scale, check_tensor,
                      EXACT_STRIDES, contiguous_lse, dispatch_modes, eager_mode, function_modes, functorch_level,
                      grad_enabled, is_compiling, is_empty_call, len_bucket, own_pair_train_step, pair_backward, raw_apply,
                      register_train_step, resolved_autograd_function, traced_train, train_pair_backward,
                      transforms_active, unwrap_if_dead)
from opsadv.core.opdef import OpDef, Reference, arg
from ..flash_attention import attention_buckets, check_head_dim, default_scale, empty_result, lse_dtype
from . import cases as _cases, packed_segments as _packed_segments, reference as _reference  # noqa: F401 (registers opsadv::packed_segments)


OP = "sparse_attention"


def validate(q, k, v, layout, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(OP, name, t, ndim=4, allow_empty=True)
    check_same(OP, "q", q, k=k, v=v)
    if not isinstance(layout, SparseLayout):
        raise InvalidArgumentError(OP, "layout", "an opsadv.SparseLayout", type(layout).__name__)
    b, hq, sq, d = q.shape
    check_head_dim(OP, d)
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] != d or v.shape[-1] != d:
        raise InvalidArgumentError(OP, "k/v", f"(b={b}, h_kv, s_k, d={d}) with v shaped like k",
                                   f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hq % k.shape[1] if k.shape[1] else hq:
        raise InvalidArgumentError(OP, "k", f"a number of heads dividing q's {hq}", k.shape[1])
    if (layout.seq_q, layout.seq_k) != (sq, k.shape[2]):
        raise InvalidArgumentError(OP, "layout", f"built for s_q={sq}, s_k={k.shape[2]}", (layout.seq_q, layout.seq_k))
    bm = layout.block_mask
    if bm.shape[0] not in (1, b) or bm.shape[1] not in (1, hq):
        raise InvalidArgumentError(OP, "layout.block_mask", f"batch dim 1 or {b}, head dim 1 or {hq}", tuple(bm.shape))
    if layout.key_padding_mask is not None and layout.key_padding_mask.shape[0] != b:
        raise InvalidArgumentError(OP, "layout.key_padding_mask", f"batch {b}", tuple(layout.key_padding_mask.shape))
    if layout.cu_seqlens is not None and b != 1:
        raise InvalidArgumentError(OP, "q", "batch 1 for a packed (cu_seqlens) layout", f"batch {b}")
    for name, t in (("block_mask", bm), ("key_padding_mask", layout.key_padding_mask), ("cu_seqlens", layout.cu_seqlens)):
        if t is not None and t.device != q.device:
            raise InvalidArgumentError(OP, f"layout.{name}", f"on device {q.device}", str(t.device))
    check_scale(OP, scale)


def _features(q, k, kpm, cu, causal, wl, ng, dense, ms) -> frozenset[str]:
    f = {"causal"} if causal else set()
    f |= {n for n, on in (("gqa", q.shape[1] != k.shape[1]), ("key_padding", kpm is not None),
                          ("varlen", cu is not None), ("window", wl >= 0), ("global", ng > 0),
                          ("cross_length", q.shape[2] != k.shape[2]),
                          ("dense_blocks", dense), ("max_seqlen_known", cu is not None and ms >= 0)) if on}
    return frozenset(f)


def _window_bucket(wl: int, wr: int) -> int:
    """A window's span (left + right + 1 keys) bucketed like lengths, 0 without a window: the work per row
    differs by window, and so does the fastest kernel (H200: Triton sparse at w1024, the Gluon ping-pong
    schedule 12% faster at w2048), so windows must not share one measured choice."""
    return len_bucket(wl + max(wr, 0) + 1) if wl >= 0 else 0


def _key(q, k, kpm, cu, bs, causal, wl, wr, ng, dense, ms, backward, train=False, inference=False):
    return (OP, backward, device_key(q), q.dtype, q.shape[-1], bs, causal, _window_bucket(wl, wr), ng > 0,
            kpm is not None, cu is not None, q.shape[1] // k.shape[1], len_bucket(q.shape[2]),
            len_bucket(k.shape[2]), dense, ms >= 0, train, inference)


def _spec(q, k, kpm, cu, bs, causal, wl, wr, ng, dense, ms, backward, train=False, inference=False) -> CallSpec:
    return CallSpec(OP, q.device.type, q.dtype, _features(q, k, kpm, cu, causal, wl, ng, dense, ms),
                    (bs, len_bucket(q.shape[2]), len_bucket(k.shape[2]), _window_bucket(wl, wr)),
                    head_dim=q.shape[-1], shapes=(tuple(q.shape), tuple(k.shape)), backward=backward,
                    train=train, inference=inference, bucket_names=("block_size=", "s_q<=", "s_k<=", "window_span<="),
                    device_index=device_index(q))


def layout_spec(q, k, layout: SparseLayout, backward: bool, train: bool = False, inference: bool = False) -> CallSpec:
    """The CallSpec a call with this layout resolves by (explain, tests)."""
    return _spec(q, k, layout.key_padding_mask, layout.cu_seqlens, layout.block_size, layout.causal,
                 layout.window_left, layout.window_right, layout.num_global, layout.dense_blocks,
                 -1 if layout.max_seqlen is None else layout.max_seqlen, backward, train, inference)


def _route(q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left, window_right,
           num_global, scale, dense_blocks=False, max_seqlen=-1):
    s = default_scale(q, scale)
    kpm, cu, wl, ng = key_padding_mask, cu_seqlens, window_left, num_global
    out, lse = dispatch.call(
        _key(q, k, kpm, cu, block_size, causal, wl, window_right, ng, dense_blocks, max_seqlen, False),
        lambda: _spec(q, k, kpm, cu, block_size, causal, wl, window_right, ng, dense_blocks, max_seqlen, False),
        (q, k, v, block_mask, kpm, cu, block_size, causal, wl, window_right, ng, s, dense_blocks, max_seqlen))
    return out, contiguous_lse(lse)


def _infer_route(q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left, window_right,
                 num_global, scale, dense_blocks=False, max_seqlen=-1):
    """Eager no-grad calls that do not return lse resolve in their own bucket (CallSpec.inference) and run the
    impl's `inference` forward where it has one (the Gluon kernel then skips the lse: its log and store per row)."""
    s = default_scale(q, scale)
    kpm, cu, wl, ng = key_padding_mask, cu_seqlens, window_left, num_global
    return dispatch.call(
        _key(q, k, kpm, cu, block_size, causal, wl, window_right, ng, dense_blocks, max_seqlen, False, inference=True),
        lambda: _spec(q, k, kpm, cu, block_size, causal, wl, window_right, ng, dense_blocks, max_seqlen, False,
                      inference=True),
        (q, k, v, block_mask, kpm, cu, block_size, causal, wl, window_right, ng, s, dense_blocks, max_seqlen),
        inference=True)[0]


def _train_resolve(q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, s, dense, ms):
    """Eager grad-recording calls resolve in their own bucket (CallSpec.train): autotune times each impl's
    forward with its own backward (a forward chosen alone may leave the step slower, as on the dense op)."""
    return dispatch.resolve(_key(q, k, kpm, cu, bs, causal, wl, wr, ng, dense, ms, False, train=True),
                            lambda: _spec(q, k, kpm, cu, bs, causal, wl, wr, ng, dense, ms, False, train=True),
                            (q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, s, dense, ms))


def _bwd_route(dout, q, k, v, out, lse, block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left,
               window_right, num_global, scale, dense_blocks=False, max_seqlen=-1):
    s = default_scale(q, scale)
    kpm, cu, wl, ng = key_padding_mask, cu_seqlens, window_left, num_global
    return dispatch.call(
        _key(q, k, kpm, cu, block_size, causal, wl, window_right, ng, dense_blocks, max_seqlen, True),
        lambda: _spec(q, k, kpm, cu, block_size, causal, wl, window_right, ng, dense_blocks, max_seqlen, True),
        (dout, q, k, v, out, lse, block_mask, kpm, cu, block_size, causal, wl, window_right, ng, s,
         dense_blocks, max_seqlen))


@torch.library.custom_op("opsadv::sparse_attention", mutates_args=(), tags=EXACT_STRIDES)
def _sparse_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Tensor, key_padding_mask: Optional[Tensor],
                      cu_seqlens: Optional[Tensor], block_size: int, causal: bool, window_left: int,
                      window_right: int, num_global: int, scale: Optional[float], dense_blocks: bool = False,
                      max_seqlen: int = -1, train: bool = False, scope: int = 0) -> tuple[Tensor, Tensor]:
    """train: a traced grad-recording call, resolved in the train bucket as an eager one is, the backward
    (sparse_attention_backward(train=True)) then runs the same impl's (see flash_attention).  scope: the
    converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        return _sparse_attention_impl(q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal,
                                      window_left, window_right, num_global, scale, dense_blocks, max_seqlen, train)


def _sparse_attention_impl(q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left,
                           window_right, num_global, scale, dense_blocks, max_seqlen, train):
    if train:
        args = (q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left, window_right,
                num_global, default_scale(q, scale), dense_blocks, max_seqlen)
        r = _train_resolve(*args)
        dispatch.record_call(r.impl.id)
        out, lse = r.run(r.ctx, *args)
        lse = contiguous_lse(lse)
    else:
        out, lse = _route(q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left,
                          window_right, num_global, scale, dense_blocks, max_seqlen)
    return out.contiguous(), lse


@_sparse_attention.register_fake
def _(q, k, v, block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left, window_right,
      num_global, scale, dense_blocks=False, max_seqlen=-1, train=False, scope=0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("opsadv::sparse_attention_backward", mutates_args=(), tags=EXACT_STRIDES)
def _sparse_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               block_mask: Tensor, key_padding_mask: Optional[Tensor], cu_seqlens: Optional[Tensor],
                               block_size: int, causal: bool, window_left: int, window_right: int,
                               num_global: int, scale: Optional[float], dense_blocks: bool = False,
                               max_seqlen: int = -1, train: bool = False,
                               scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """train: the backward of the impl the train bucket resolves for this forward (the memoized choice
    sparse_attention(train=True) ran)."""
    rest = (block_mask, key_padding_mask, cu_seqlens, block_size, causal, window_left, window_right, num_global,
            default_scale(q, scale), dense_blocks, max_seqlen)
    with in_scope(scope):
        grads = train_pair_backward(_train_resolve(q, k, v, *rest) if train else None, dout, q, k, v, out, lse, rest)
        dq, dk, dv = grads if grads is not None else _bwd_route(dout, q, k, v, out, lse, *rest)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_sparse_attention_backward.register_fake
def _(dout, q, k, v, out, lse, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, bm, kpm, cu, *rest = inputs          # rest: block_size ... max_seqlen (plain values)[, train]
    ctx.save_for_backward(q, k, v, output[0], output[1], bm, kpm, cu)
    ctx.rest, ctx.train, ctx.n_inputs = tuple(rest[:8]), len(rest) > 8 and bool(rest[8]), len(inputs)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, bm, kpm, cu = ctx.saved_tensors
    none = (None,) * (ctx.n_inputs - 3)           # block_mask, kpm, cu_seqlens, then the values
    pair = pair_backward(ctx, dout, q, k, v, out, lse, (bm, kpm, cu, *ctx.rest))   # eager training call
    if pair is not None:
        return (*pair, *none)
    if eager_mode(dout, q, k, v) != TORCH_OPS:    # eager: the router directly (no torch.library boundary)
        return (*_bwd_route(dout, q, k, v, out, lse, bm, kpm, cu, *ctx.rest), *none)
    dq, dk, dv = torch.ops.opsadv.sparse_attention_backward(dout, q, k, v, out, lse, bm, kpm, cu, *ctx.rest, ctx.train,
                                                            op_scope())
    return (dq, dk, dv, *none)


# the backward resolves under the forward's policy (the torch.ops path: the scope its call carried)
_op_setup, _op_backward = carry_scope(_setup, _backward)
_sparse_attention.register_autograd(_op_backward, setup_context=_op_setup)
_setup, _backward = carry_policy(_setup, _backward)
# training calls: the impl the train bucket chose runs forward and its own backward (eager: pair_backward; traced:
# the ops' train=True)
_train_autograd = resolved_autograd_function("SparseAttentionTrainFn", _setup, _backward, stats=(1,),
                                             finish=lambda o: (o[0], contiguous_lse(o[1])))
register_train_step(OP, own_pair_train_step)


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
_train_raw = raw_apply(_train_autograd)


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, layout: SparseLayout, *, scale: float | None = None,
                     return_lse: bool = False):
    """Attention restricted to `layout` (block-sparse pattern and/or packed variable-length batch).
    Rows with no allowed key give zeros."""
    fk = r = None
    # the fast path (as the norms', ops/norm): the exact metadata of an identical call that took the full path, the
    # layout's fields and its tensors' type / dtype / device / shape included (all that validate() reads of it)
    if (scale is None or type(scale) is float) and not (is_compiling() or dispatch_modes() or function_modes()) \
            and functorch_level() is None:
        try:
            bm, kpm, cu = layout.block_mask, layout.key_padding_mask, layout.cu_seqlens
            train = grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or bm.requires_grad
                                        or kpm is not None and kpm.requires_grad
                                        or cu is not None and cu.requires_grad)
            lse_out = bool(return_lse)
            fk = (OP, (_scoped.get() or _policy._global).serial, train, lse_out, scale, type(q), q.dtype, q.device,
                  q.shape, type(k), k.dtype, k.device, k.shape, type(v), v.dtype, v.device, v.shape, type(layout),
                  layout.seq_q, layout.seq_k, layout.block_size, layout.causal, layout.window, layout.num_global,
                  layout.dense_blocks, layout.max_seqlen, type(bm), bm.dtype, bm.device, bm.shape,
                  None if kpm is None else (type(kpm), kpm.dtype, kpm.device, kpm.shape),
                  None if cu is None else (type(cu), cu.dtype, cu.device, cu.shape))
            r = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = r = None
    if r is not None:
        if _tracers:
            dispatch.record(r.impl.id)
        w = layout.window
        ms = layout.max_seqlen
        args = (q, k, v, bm, kpm, cu, layout.block_size, layout.causal, -1 if w is None else w[0],
                -1 if w is None else w[1], layout.num_global,
                scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), layout.dense_blocks,
                -1 if ms is None else ms)
        if train:
            if transforms_active():
                out, lse = _train_autograd(r, *args)
            else:
                out, lse = _train_raw(r, unwrap_if_dead(q), unwrap_if_dead(k), unwrap_if_dead(v), *args[3:])
        elif not lse_out:
            return r.infer(r.ctx, *args)[0]
        else:
            out, lse = r.run(r.ctx, *args)
            lse = contiguous_lse(lse)
        return (out, lse.detach()) if lse_out else out
    validate(q, k, v, layout, scale)
    if is_empty_call(q, k, v):      # every row is empty: the layout's mask cannot matter
        out, lse = empty_result(q, k, v, None, False, scale)
        return (out, lse.detach()) if return_lse else out
    mode = eager_mode(q, k, v, layout.block_mask, layout.key_padding_mask, layout.cu_seqlens)
    args = (q, k, v, layout.block_mask, layout.key_padding_mask, layout.cu_seqlens, layout.block_size, layout.causal,
            layout.window_left, layout.window_right, layout.num_global, scale, layout.dense_blocks,
            -1 if layout.max_seqlen is None else layout.max_seqlen)
    if mode == AUTOGRAD_FN:
        s = default_scale(q, scale)
        args = args[:11] + (s,) + args[12:]
        r = _train_resolve(*args)
        dispatch.learn(fk, None, r)
        dispatch.record_call(r.impl.id)
        out, lse = _train_autograd(r, *args)
    elif mode == DIRECT:
        bucket = _key(q, k, *args[4:11], *args[12:], False, inference=not return_lse)
        if not return_lse:
            out = _infer_route(*args)
            dispatch.learn(fk, bucket)
            return out
        out, lse = _route(*args)
        dispatch.learn(fk, bucket)
    else:
        out, lse = torch.ops.opsadv.sparse_attention(*args, traced_train(q, k, v), op_scope())
    return (out, lse.detach()) if return_lse else out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    q, k, v, layout = (arg(args, kwargs, 0, "q"), arg(args, kwargs, 1, "k"), arg(args, kwargs, 2, "v"),
                       arg(args, kwargs, 3, "layout"))
    validate(q, k, v, layout, kwargs.get("scale"))
    mode = eager_mode(q, k, v, layout.block_mask, layout.key_padding_mask, layout.cu_seqlens)
    return layout_spec(q, k, layout, backward, *attention_buckets(mode, backward, kwargs))


OPDEF = OpDef(OP, sparse_attention, Reference(_reference.sparse_fwd, _reference.sparse_bwd, _reference.FEATURES),
              explain_spec, custom_ops=(_sparse_attention, _sparse_attention_backward), cases=tuple(_cases.CASES),
              demo=_cases.demo, precision="attention")
OPDEFS = (OPDEF,)
