"""rotary_embedding: rotary position embedding applied to q and k in one call, (q', k').

q (B, Hq, S, D) and k (B, Hk, S, D), any strides (transformers' (b, s, h, d) memory viewed as (b, h, s, d)
included); cos and sin (S, R), (1 or B, S, R), or with position_ids a (P, R) table indexed by position_ids
(S,) / (1 or B, S).  R = cos.shape[-1] (even, <= D) is the rotated width: the first R features of each head
rotate, the other D - R pass through (partial rotary: GPT-NeoX, Phi).  Half layout (default): the pairs are
(x[i], x[i + R/2]) with cos / sin laid out as transformers' `cat(freqs, freqs)`; interleaved: (x[2i], x[2i+1]).
    y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2          (transformers' x * cos + rotate_half(x) * sin)
Outputs have the inputs' dtype; float32 math.  Gradients flow to q and k (and to cos / sin where they need one).

Impl contract:
  fn(ctx, q, k, cos, sin, position_ids, interleaved) -> (q', k')
  backward(ctx, dq', dk', cos, sin, position_ids, interleaved) -> (dq, dk)      (the rotation by -angle)"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core import policy as _policy
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core.policy import current_policy, in_scope, op_scope
from opsadv.core.op_common import (AUTOGRAD_FN, DIRECT, FLOAT_DTYPES, TORCH_OPS, autograd_function, carry_policy,
                                   carry_scope, check_tensor, dispatch_modes, dt, eager_mode, function_modes, is_empty_call,
                                   functorch_level, grad_enabled, is_compiling, len_bucket, raw_apply,
                                   transforms_active, unwrap_if_dead)

from . import cases as _cases, reference as _reference

OP = "rotary_embedding"
_INT_DTYPES = (torch.int32, torch.int64)


def _well_formed(q, k, cos, sin, position_ids) -> bool:
    """The common call (transformers' layout, no position ids), recognized in few operations."""
    if position_ids is not None or not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(cos, Tensor)
                                        and isinstance(sin, Tensor)):
        return False
    if q.dim() != 4 or k.dim() != 4 or q.dtype not in FLOAT_DTYPES or k.dtype is not q.dtype:
        return False
    b, _, s, d = q.shape
    kb, _, ks, kd = k.shape
    if kb != b or ks != s or kd != d or not q.numel() or not k.numel():
        return False
    cs = cos.shape
    if cos.dtype not in FLOAT_DTYPES or sin.dtype is not cos.dtype or sin.shape != cs or cos.device != q.device \
            or sin.device != q.device or k.device != q.device:
        return False
    r = cs[-1]
    if r % 2 or not 0 < r <= d:
        return False
    return (cos.dim() == 2 and cs[0] == s) or (cos.dim() == 3 and cs[1] == s and cs[0] in (1, b))


def validate(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None) -> None:
    if not isinstance(interleaved, bool):
        raise InvalidArgumentError(OP, "interleaved", "a bool", repr(interleaved))
    if _well_formed(q, k, cos, sin, position_ids) and (rotary_dim is None or (type(rotary_dim) is int
                                                                             and rotary_dim == cos.shape[-1])):
        return
    check_tensor(OP, "q", q, ndim=4, allow_empty=True)
    check_tensor(OP, "k", k, ndim=4, allow_empty=True)
    if k.dtype != q.dtype:
        raise InvalidArgumentError(OP, "k", f"dtype {dt(q.dtype)} (same as q)", dt(k.dtype))
    b, _, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise InvalidArgumentError(OP, "k", f"shape (B={b}, Hk, S={s}, D={d}) (q is (B, Hq, S, D))", tuple(k.shape))
    check_tensor(OP, "cos", cos, ndim=(2, 3), allow_empty=True)
    check_tensor(OP, "sin", sin, ndim=(2, 3), allow_empty=True)
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise InvalidArgumentError(OP, "sin", f"shape {tuple(cos.shape)} and dtype {dt(cos.dtype)} (same as cos)",
                                   f"shape {tuple(sin.shape)}, dtype {dt(sin.dtype)}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin), ("position_ids", position_ids)):
        if t is not None and t.device != q.device:
            raise InvalidArgumentError(OP, name, f"on device {q.device} (same as q)", str(t.device))
    r = cos.shape[-1]
    if r % 2 or r > d:
        raise InvalidArgumentError(OP, "cos", f"an even last dim (the rotated width) <= head dim {d}", f"{r}")
    if rotary_dim is not None and (not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim != r):
        raise InvalidArgumentError(OP, "rotary_dim", f"None or cos.shape[-1] = {r} (the rotated width)",
                                   repr(rotary_dim))
    if position_ids is None:
        ok = (cos.dim() == 2 and cos.shape[0] == s) or (cos.dim() == 3 and cos.shape[1] == s
                                                         and cos.shape[0] in (1, b))
        if not ok:
            raise InvalidArgumentError(OP, "cos", f"shape (S={s}, R) or (1 or B={b}, S={s}, R) (without position_ids)",
                                       tuple(cos.shape))
        return
    if not isinstance(position_ids, Tensor) or position_ids.dtype not in _INT_DTYPES:
        raise InvalidArgumentError(OP, "position_ids", "None or an int32 / int64 tensor",
                                   dt(position_ids.dtype) if isinstance(position_ids, Tensor)
                                   else type(position_ids).__name__)
    ps = tuple(position_ids.shape)
    if not (ps == (s,) or (len(ps) == 2 and ps[1] == s and ps[0] in (1, b))):
        raise InvalidArgumentError(OP, "position_ids", f"shape (S={s},) or (1 or B={b}, S={s})", ps)
    if cos.dim() != 2:
        raise InvalidArgumentError(OP, "cos", "a (P, R) table (with position_ids)", tuple(cos.shape))


def _rotate_plain(x: Tensor, cos: Tensor, sin: Tensor, position_ids, interleaved: bool) -> Tensor:
    """One tensor rotated in plain differentiable torch (the reference's maths)."""
    r = cos.shape[-1]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, sn = cos.to(cdt), sin.to(cdt)
    if position_ids is not None:
        c, sn = c[position_ids], sn[position_ids]
    if c.dim() == 2:
        c, sn = c[None], sn[None]
    c, sn = c[:, None], sn[:, None]
    xf = x.to(cdt)
    xr, xp = xf[..., :r], xf[..., r:]
    if interleaved:
        x1, x2, c1, c2, s1, s2 = xr[..., 0::2], xr[..., 1::2], c[..., 0::2], c[..., 1::2], sn[..., 0::2], sn[..., 1::2]
    else:
        h = r // 2
        x1, x2, c1, c2, s1, s2 = xr[..., :h], xr[..., h:], c[..., :h], c[..., h:], sn[..., :h], sn[..., h:]
    y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    yr = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
    return torch.cat((yr, xp), -1).to(x.dtype)


def _empty_result(q, k, cos, sin, position_ids, interleaved):
    """rotary_embedding with an empty operand (batch, heads or sequence of 0, or R = 0), in plain differentiable
    torch: empty results and gradients, the other tensor rotated as usual; no kernel runs."""
    return _rotate_plain(q, cos, sin, position_ids, interleaved), _rotate_plain(k, cos, sin, position_ids, interleaved)


def _features(cos: Tensor, d: int, position_ids, interleaved: bool) -> frozenset:
    f = set()
    if interleaved:
        f.add("interleaved")
    if cos.shape[-1] < d:
        f.add("partial")
    if position_ids is not None:
        f.add("position_ids")
    return frozenset(f)


def call_key(op: str, q: Tensor, k: Tensor, cos: Tensor, position_ids, interleaved: bool, backward: bool) -> tuple:
    """The dispatch-cache key of a rotary-shaped call of `op` (rotary_embedding, qk_norm_rotary)."""
    b, hq, s, d = q.shape
    return (op, backward, device_key(q), q.dtype, cos.dtype, len_bucket(b * s), hq, k.shape[1], d, cos.shape[-1],
            interleaved, position_ids is not None)


def call_spec(op: str, q: Tensor, k: Tensor, cos: Tensor, position_ids, interleaved: bool,
              backward: bool) -> CallSpec:
    """The CallSpec of a rotary-shaped call of `op`: features from the table, buckets tokens / heads / R."""
    b, hq, s, d = q.shape
    return CallSpec(op, q.device.type, q.dtype, _features(cos, d, position_ids, interleaved),
                    (len_bucket(b * s), hq, k.shape[1], cos.shape[-1]), head_dim=d,
                    shapes=(tuple(q.shape), tuple(k.shape), tuple(cos.shape)), backward=backward,
                    bucket_names=("tokens<=", "Hq=", "Hk=", "R="), device_index=device_index(q))


def _key(q, k, cos, position_ids, interleaved, backward):
    return call_key(OP, q, k, cos, position_ids, interleaved, backward)


def _spec(q, k, cos, position_ids, interleaved, backward):
    return call_spec(OP, q, k, cos, position_ids, interleaved, backward)


def _route(q, k, cos, sin, position_ids, interleaved):
    return dispatch.call(_key(q, k, cos, position_ids, interleaved, False),
                         lambda: _spec(q, k, cos, position_ids, interleaved, False),
                         (q, k, cos, sin, position_ids, interleaved))


def _bwd_route(gq, gk, cos, sin, position_ids, interleaved):
    return dispatch.call(_key(gq, gk, cos, position_ids, interleaved, True),
                         lambda: _spec(gq, gk, cos, position_ids, interleaved, True),
                         (gq, gk, cos, sin, position_ids, interleaved))


def bshd_like(x: Tensor) -> Tensor:
    """An empty (b, h, s, d) tensor stored as (b, s, h, d): transformers' layout, which attention keeps."""
    b, h, s, d = x.shape
    return torch.empty_strided((b, h, s, d), (s * h * d, d, h * d, 1), dtype=x.dtype, device=x.device)


def _in_fake_layout(t: Tensor) -> Tensor:
    """t stored as the fakes say (compiled graphs plan with those strides); an impl may return another layout."""
    b, h, s, d = t.shape
    if t.stride() == (s * h * d, d, h * d, 1) or t.numel() == 0:
        return t
    out = bshd_like(t)
    out.copy_(t)
    return out


@torch.library.custom_op("opsadv::rotary_embedding", mutates_args=())
def _rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
            interleaved: bool, scope: int = 0) -> tuple[Tensor, Tensor]:
    """scope: the converted model's scope id the call carries (core.policy.op_scope; 0: the policy in force)."""
    with in_scope(scope):
        oq, ok = _route(q, k, cos, sin, position_ids, interleaved)
    return _in_fake_layout(oq), _in_fake_layout(ok)


@_rotary.register_fake
def _(q, k, cos, sin, position_ids, interleaved, scope=0):
    return bshd_like(q), bshd_like(k)


@torch.library.custom_op("opsadv::rotary_embedding_backward", mutates_args=())
def _rotary_backward(gq: Tensor, gk: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
                     interleaved: bool, scope: int = 0) -> tuple[Tensor, Tensor]:
    with in_scope(scope):
        dq, dk = _bwd_route(gq, gk, cos, sin, position_ids, interleaved)
    return _in_fake_layout(dq), _in_fake_layout(dk)


@_rotary_backward.register_fake
def _(gq, gk, cos, sin, position_ids, interleaved, scope=0):
    return bshd_like(gq), bshd_like(gk)


def _setup(ctx, inputs, output):
    q, k, cos, sin, position_ids, interleaved = inputs
    ctx.interleaved = interleaved
    ctx.meta = (q.shape, k.shape, q.dtype, q.device)
    ctx.table_grad = cos.requires_grad or sin.requires_grad
    # q and k are kept only where cos / sin need a gradient (rare: transformers' tables are buffers)
    ctx.save_for_backward(cos, sin, position_ids, *((q, k) if ctx.table_grad else ()))


def _materialized(ctx, gq, gk):
    qs, ks, dtype, dev = ctx.meta
    if gq is None:                      # an output nobody used
        gq = torch.zeros(qs, dtype=dtype, device=dev)
    if gk is None:
        gk = torch.zeros(ks, dtype=dtype, device=dev)
    return gq, gk


def _with_table_grads(ctx, dq, dk, gq, gk, cos, position_ids, qk):
    dcos = dsin = None
    if ctx.table_grad:
        dcos, dsin = table_grads(qk[0], qk[1], gq, gk, cos, position_ids, ctx.interleaved)
    return dq, dk, dcos, dsin, None, None


def _backward(ctx, gq, gk):
    cos, sin, position_ids, *qk = ctx.saved_tensors
    gq, gk = _materialized(ctx, gq, gk)
    if eager_mode(gq, gk, cos) != TORCH_OPS:
        dq, dk = _bwd_route(gq, gk, cos, sin, position_ids, ctx.interleaved)
    else:
        dq, dk = torch.ops.opsadv.rotary_embedding_backward(gq, gk, cos, sin, position_ids, ctx.interleaved, op_scope())
    return _with_table_grads(ctx, dq, dk, gq, gk, cos, position_ids, qk)


def _pairs(t: Tensor, r: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    t = t[..., :r]
    return (t[..., 0::2], t[..., 1::2]) if interleaved else (t[..., : r // 2], t[..., r // 2:])


def _join(a: Tensor, b: Tensor, interleaved: bool) -> Tensor:
    return torch.stack((a, b), -1).flatten(-2) if interleaved else torch.cat((a, b), -1)


def table_grads(q, k, gq, gk, cos, position_ids, interleaved):
    """(dcos, dsin) in torch (float32): per position, summed over heads (and the batch where cos is shared)."""
    r = cos.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dc = ds = 0
    for x, g in ((q, gq), (k, gk)):
        x1, x2 = _pairs(x.to(acc), r, interleaved)
        g1, g2 = _pairs(g.to(acc), r, interleaved)
        dc = dc + _join(g1 * x1, g2 * x2, interleaved).sum(1)          # (B, S, R)
        ds = ds + _join(-g1 * x2, g2 * x1, interleaved).sum(1)
    if position_ids is not None:
        pos = position_ids.expand(dc.shape[0], dc.shape[1]) if position_ids.dim() == 2 else \
            position_ids.expand(dc.shape[0], -1)
        out = []
        for t in (dc, ds):
            tab = torch.zeros(cos.shape, dtype=acc, device=cos.device)
            out.append(tab.index_put_((pos.reshape(-1),), t.reshape(-1, r), accumulate=True).to(cos.dtype))
        return tuple(out)
    shape = cos.shape if cos.dim() == 3 else (1,) + tuple(cos.shape)
    return tuple(t.sum_to_size(shape).reshape(cos.shape).to(cos.dtype) for t in (dc, ds))


_setup_op, _backward_op = carry_scope(_setup, _backward)
_rotary.register_autograd(_backward_op, setup_context=_setup_op)
_carried_setup, _carried_backward = carry_policy(_setup, _backward)
_eager_autograd = autograd_function("RotaryEmbeddingFn", _route, _carried_setup, _carried_backward)


class RotaryEmbeddingFn(torch.autograd.Function):
    """An eager training call of the fast path, whose forward impl r and backward impl rb are both resolved (under
    the call's policy, in its buckets): the backward runs rb with no dispatch (no bucket key, no policy scope, no
    mode check beyond one), counted in the forward's traces.  Backward under a dispatch / function mode or a
    functorch transform: _backward as the full path runs it.  (Named as the full path's Function: the same node
    name in autograd graphs either way.)"""

    @staticmethod
    def forward(ctx, r, rb, q, k, cos, sin, position_ids, interleaved):
        out = r.run(r.ctx, q, k, cos, sin, position_ids, interleaved)
        _setup(ctx, (q, k, cos, sin, position_ids, interleaved), out)
        ctx.rb, ctx.opsadv_traces, ctx.opsadv_policy = rb, dispatch._local.get(), current_policy()
        return out

    @staticmethod
    def backward(ctx, gq, gk):
        if dispatch_modes() or function_modes() or functorch_level() is not None:
            return (None, None, *_carried_backward(ctx, gq, gk))
        cos, sin, position_ids, *qk = ctx.saved_tensors
        gq, gk = _materialized(ctx, gq, gk)
        rb = ctx.rb
        if _tracers or ctx.opsadv_traces:
            dispatch.record_carried(rb.impl.id, ctx.opsadv_traces)
        dq, dk = rb.run(rb.ctx, gq, gk, cos, sin, position_ids, ctx.interleaved)
        return (None, None, *_with_table_grads(ctx, dq, dk, gq, gk, cos, position_ids, qk))


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped
_resolved_raw = raw_apply(RotaryEmbeddingFn.apply)


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, position_ids: Tensor | None = None,
                     interleaved: bool = False, rotary_dim: int | None = None) -> tuple[Tensor, Tensor]:
    """(q', k'): q (B, Hq, S, D) and k (B, Hk, S, D) rotated by cos / sin ((S, R) or (1 or B, S, R); with
    position_ids (S,) / (1 or B, S) a (P, R) table).  The first R = cos.shape[-1] features of each head rotate
    (rotary_dim, if given, must equal R), the rest pass through.  interleaved: pairs (x[2i], x[2i+1]) instead of
    (x[i], x[i + R/2])."""
    fk = hit = None
    # the fast path (as the norms', norm.py): the exact metadata of an identical call that took the full path
    if type(interleaved) is bool and not (is_compiling() or dispatch_modes() or function_modes()) \
            and functorch_level() is None:
        try:
            train = grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad)
            fk = (OP, (_scoped.get() or _policy._global).serial, train, interleaved, type(rotary_dim), rotary_dim,
                  type(q), q.dtype, q.device, q.shape, type(k), k.dtype, k.device, k.shape, type(cos), cos.dtype,
                  cos.device, cos.shape, type(sin), sin.dtype, sin.device, sin.shape,
                  None if position_ids is None else (type(position_ids), position_ids.dtype, position_ids.device,
                                                     position_ids.shape))
            hit = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
    if hit is not None:
        if not train:
            if _tracers:
                dispatch.record(hit.impl.id)
            return hit.run(hit.ctx, q, k, cos, sin, position_ids, interleaved)
        r, rb = hit
        if _tracers:
            dispatch.record(r.impl.id)
        if transforms_active():
            return RotaryEmbeddingFn.apply(r, rb, q, k, cos, sin, position_ids, interleaved)
        return _resolved_raw(r, rb, unwrap_if_dead(q), unwrap_if_dead(k), unwrap_if_dead(cos), unwrap_if_dead(sin),
                             position_ids if position_ids is None else unwrap_if_dead(position_ids), interleaved)
    validate(q, k, cos, sin, position_ids, interleaved, rotary_dim)
    if is_empty_call(q, k, cos, sin):
        return _empty_result(q, k, cos, sin, position_ids, interleaved)
    mode = eager_mode(q, k, cos, sin)
    if mode == DIRECT:
        out = _route(q, k, cos, sin, position_ids, interleaved)
        dispatch.learn(fk, _key(q, k, cos, position_ids, interleaved, False))
        return out
    if mode == AUTOGRAD_FN:
        out = _eager_autograd(q, k, cos, sin, position_ids, interleaved)
        if fk is not None:           # both directions resolved (after a first backward): the fast path from now on
            serial = current_policy().serial
            r = dispatch._memo.get((serial, _key(q, k, cos, position_ids, interleaved, False)))
            rb = dispatch._memo.get((serial, _key(q, k, cos, position_ids, interleaved, True)))
            if r is not None and rb is not None:
                dispatch.learn(fk, None, (r, rb))
        return out
    return torch.ops.opsadv.rotary_embedding(q, k, cos, sin, position_ids, interleaved, op_scope())


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    q, k, cos, sin = (arg(args, kwargs, 0, "q"), arg(args, kwargs, 1, "k"), arg(args, kwargs, 2, "cos"),
                      arg(args, kwargs, 3, "sin"))
    pos, inter = kwargs.get("position_ids"), kwargs.get("interleaved", False)
    validate(q, k, cos, sin, pos, inter, kwargs.get("rotary_dim"))
    return _spec(q, k, cos, pos, inter, backward)


OPDEF = OpDef(OP, rotary_embedding, Reference(_reference.rotary_fwd, _reference.rotary_bwd, _reference.FEATURES),
              explain_spec, custom_ops=(_rotary, _rotary_backward), cases=tuple(_cases.CASES), demo=_cases.demo)
OPDEFS = (OPDEF,)
