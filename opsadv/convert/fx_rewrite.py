"""torch.fx rewrite for any nn.Module: symbolic_trace, then replace by structure
  softmax(q @ kᵀ · s [+ mask | masked_fill]) @ v          -> opsadv.flash_attention
  x·rsqrt(mean(x²)+eps)[·w]  /  x/sqrt(mean(x²)+eps)[·w]  -> opsadv.rms_norm
  (x-μ)·rsqrt(var+eps)[·w][+b]  (and the sqrt/div form)    -> opsadv.layer_norm
  nn.Linear followed by relu/gelu/gelu(tanh)/silu          -> opsadv.gemm(activation=)
Modules that cannot be traced are skipped with the tracer's reason; their children are tried.
Parameters keep their names (get_attr), so the state_dict is unchanged."""
from __future__ import annotations

import math
import operator
from contextlib import nullcontext

import torch
from torch import fx, nn
from torch.nn import functional as F

from opsadv import ops
from opsadv.core import policy as _policy

from . import modules as _mods

_dynamo_compiling = torch.compiler.is_dynamo_compiling
_exporting = torch.compiler.is_exporting


def _scope(sid: int):
    """The scope of the state registered as `sid` (RuntimeState.sid); while dynamo traces, the id the ops carry."""
    if _dynamo_compiling():
        return nullcontext() if _exporting() else _policy.TracedScope(sid)
    st = _policy.scope_source(sid)
    return st.scope() if st is not None else nullcontext()


# ---- the functions the rewritten graphs call (module level: fx codegen and torch.export see them) ----
def opsadv_fx_attention(q, k, v, mask, scale, divide: bool, fill_mask: bool, sid: int):
    scale = 1.0 / float(scale) if divide else float(scale)   # a constant or a shape-derived number
    squeeze = q.dim() == 3
    if squeeze:                                   # (b, s, d) attention: one head
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)
    if mask is not None:
        mask = ~mask.bool() if fill_mask else (mask if mask.dtype == torch.bool else mask.to(q.dtype))
    with _scope(sid):
        out = ops.flash_attention(q, k, v, scale=scale, attn_mask=mask)
    return out.squeeze(1) if squeeze else out


def opsadv_fx_rms_norm(x, w, eps: float, sid: int):
    with _scope(sid):
        return ops.rms_norm(x, w.to(x.dtype) if w is not None else None, eps)


def opsadv_fx_layer_norm(x, w, b, eps: float, sid: int):
    with _scope(sid):
        return ops.layer_norm(x, w.to(x.dtype) if w is not None else None, b.to(x.dtype) if b is not None else None,
                              eps)


def opsadv_fx_linear_act(x, w, b, activation: str, sid: int):
    with _scope(sid):
        return ops.gemm(x, w.t(), bias=b, activation=activation)


# ---- node predicates -----------------------------------------------------------------------------
def _fn(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _meth(n, *names) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def _arg(n, i, name, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _is_add(n):
    return _fn(n, operator.add, torch.add) or _meth(n, "add")


def _is_mul(n):
    return _fn(n, operator.mul, torch.mul) or _meth(n, "mul")


def _is_div(n):
    return _fn(n, operator.truediv, torch.div) or _meth(n, "div")


def _is_matmul(n):
    return _fn(n, operator.matmul, torch.matmul, torch.bmm) or _meth(n, "matmul", "bmm")


def _num(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _last_dim(d) -> bool:
    return d == -1 or d == [-1] or d == (-1,)


def _is_mean_last(n):
    return (_fn(n, torch.mean) or _meth(n, "mean")) and _last_dim(_arg(n, 1, "dim")) and _arg(n, 2, "keepdim", False)


def _square_of(n):
    """x when n is x**2, x*x or torch.square(x)."""
    if (_fn(n, operator.pow, torch.pow) or _meth(n, "pow")) and _num(_arg(n, 1, "exponent")) == 2.0:
        return n.args[0]
    if _is_mul(n) and len(n.args) == 2 and _same(n.args[0], n.args[1]):
        return n.args[0]
    if _fn(n, torch.square) or _meth(n, "square"):
        return n.args[0]
    return None


def _same(a, b) -> bool:
    if a is b:
        return True
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op and a.target == b.target
            and len(a.args) == len(b.args) and all(_same(x, y) for x, y in zip(a.args, b.args))
            and a.kwargs == b.kwargs and a.op in ("call_function", "call_method"))


def _plus_eps(n):
    """(base, eps) when n is base + eps (eps a number)."""
    if not _is_add(n) or len(n.args) != 2:
        return None, None
    a, b = n.args
    if _num(b) is not None:
        return a, _num(b)
    if _num(a) is not None:
        return b, _num(a)
    return None, None


def _inv_std(n):
    """(denominator base node, eps, 'mul'|'div') for rsqrt(base+eps) / sqrt(base+eps)."""
    if _fn(n, torch.rsqrt) or _meth(n, "rsqrt"):
        base, eps = _plus_eps(n.args[0])
        return base, eps, "mul"
    if _fn(n, torch.sqrt) or _meth(n, "sqrt"):
        base, eps = _plus_eps(n.args[0])
        return base, eps, "div"
    return None, None, None


def _attr(gm, n):
    if isinstance(n, fx.Node) and n.op == "get_attr":
        try:
            t = _resolve(gm, n.target)
        except AttributeError:
            return None
        return t if isinstance(t, torch.Tensor) else None
    return None


def _resolve(root, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _one_user(n):
    users = list(n.users)
    return users[0] if len(users) == 1 else None


# ---- the matchers: each returns the replacement's (function, args, node to replace) or None ---------
def _match_attention(gm, s, sid):
    if not (_fn(s, F.softmax, torch.softmax) or _meth(s, "softmax")) or not _last_dim(_arg(s, 1, "dim")):
        return None
    if _arg(s, 3 if _fn(s, F.softmax) else 2, "dtype") is not None:
        return None
    u = _one_user(s)
    if u is None or not _is_matmul(u) or u.args[0] is not s:
        return None
    v, score, mask, fill = u.args[1], s.args[0], None, False
    if _is_add(score) and len(score.args) == 2:
        for a, b in (score.args, score.args[::-1]):
            if _qk(a) is not None and isinstance(b, fx.Node):
                score, mask = a, b
                break
        else:
            return None
    elif _meth(score, "masked_fill") or _fn(score, torch.masked_fill):
        val = _num(_arg(score, 2, "value"))
        if val is None or not (val == -math.inf or val <= -1e4):
            return None
        score, mask, fill = score.args[0], score.args[1], True
    found = _qk(score)
    if found is None:
        return None
    q, k, scale, divide = found
    if isinstance(scale, float) and not scale > 0:
        return None
    return opsadv_fx_attention, (q, k, v, mask, scale, divide, fill, sid), u, "softmax(q·kᵀ·s + mask)·v -> opsadv.flash_attention"


_SCALAR_FNS = (math.sqrt, operator.floordiv, operator.truediv, operator.mul, operator.pow, operator.getitem)


def _scalar(n) -> bool:
    """A number, or a node computing a Python number from shapes (d ** 0.5, math.sqrt(x.shape[-1]))."""
    if _num(n) is not None:
        return True
    if isinstance(n, fx.Node) and n.op == "call_function" and n.target is getattr:
        return n.args[1] == "shape"
    if isinstance(n, fx.Node) and n.op == "call_method" and n.target == "size":
        return True
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in _SCALAR_FNS and \
        all(_scalar(a) for a in n.args)


def _qk(n):
    """(q, k, scale, divide) when n is (q @ kᵀ) [· c | / c]."""
    scale, divide = 1.0, False
    if (_is_mul(n) or _is_div(n)) and len(n.args) == 2:
        a, b = n.args
        if _scalar(b):
            base, c = a, b
        elif _is_mul(n) and _scalar(a):
            base, c = b, a
        else:
            return None
        scale, divide, n = (float(c) if _num(c) is not None else c), _is_div(n), base
    if not _is_matmul(n):
        return None
    q, kt = n.args[0], n.args[1]
    if (_meth(kt, "transpose") or _fn(kt, torch.transpose)) and sorted(kt.args[1:3]) == [-2, -1]:
        return q, kt.args[0], scale, divide       # (only negative dims: positive ones need the rank to be known)
    if _fn(kt, getattr) and kt.args[1] == "mT":
        return q, kt.args[0], scale, divide
    return None


def _affine(gm, y):
    """Follow y through an optional ·w and +b (1-D parameters): (last node, w, b)."""
    w = b = None
    u = _one_user(y)
    if u is not None and _is_mul(u) and len(u.args) == 2:
        other = u.args[1] if u.args[0] is y else u.args[0]
        t = _attr(gm, other)
        if t is not None and t.dim() == 1:
            w, y = other, u
            u = _one_user(y)
    if u is not None and _is_add(u) and len(u.args) == 2:
        other = u.args[1] if u.args[0] is y else u.args[0]
        t = _attr(gm, other)
        if t is not None and t.dim() == 1:
            b, y = other, u
    return y, w, b


def _match_norm(gm, r, sid):
    base, eps, how = _inv_std(r)
    if base is None or eps is None:
        return None
    u = _one_user(r)
    if u is None or not ((how == "mul" and _is_mul(u)) or (how == "div" and _is_div(u) and u.args[1] is r)):
        return None
    num = u.args[0] if u.args[1] is r else u.args[1]
    if _is_mean_last(base) and _square_of(base.args[0]) is not None and _same(_square_of(base.args[0]), num):
        x = _square_of(base.args[0])
        # LayerNorm: base = mean((x-μ)², -1), num = x - μ
        if (_fn(num, operator.sub, torch.sub) or _meth(num, "sub")) and _is_mean_last(num.args[1]) \
                and num.args[1].args[0] is num.args[0]:
            end, w, b = _affine(gm, u)
            return opsadv_fx_layer_norm, (num.args[0], w, b, eps, sid), end, "LayerNorm in primitives -> opsadv.layer_norm"
        # RMSNorm: base = mean(x², -1)
        end, w, b = _affine(gm, u)
        if b is not None:                         # rms_norm has no bias: leave the pattern alone
            return None
        return opsadv_fx_rms_norm, (x, w, eps, sid), end, "RMSNorm in primitives -> opsadv.rms_norm"
    # LayerNorm: base = x.var(-1, keepdim=True, unbiased=False | correction=0)
    if (_fn(base, torch.var) or _meth(base, "var")) and _last_dim(_arg(base, 1, "dim")) and base.kwargs.get("keepdim") \
            and (base.kwargs.get("unbiased") is False or base.kwargs.get("correction") == 0):
        x0 = base.args[0]
        if (_fn(num, operator.sub, torch.sub) or _meth(num, "sub")) and num.args[0] is x0 and \
                _is_mean_last(num.args[1]) and num.args[1].args[0] is x0:
            end, w, b = _affine(gm, u)
            return opsadv_fx_layer_norm, (x0, w, b, eps, sid), end, "LayerNorm in primitives -> opsadv.layer_norm"
    return None


_ACT_FNS = {F.relu: "relu", torch.relu: "relu", F.silu: "silu", F.gelu: "gelu"}
_ACT_MODS = {nn.ReLU: "relu", nn.SiLU: "silu", nn.GELU: "gelu"}


def _activation(gm, n):
    if _fn(n, *_ACT_FNS):
        act = _ACT_FNS[n.target]
        if act == "gelu" and _arg(n, 1, "approximate", "none") == "tanh":
            act = "gelu_tanh"
        return act if not n.kwargs.get("inplace") else None
    if _meth(n, "relu"):
        return "relu"
    if isinstance(n, fx.Node) and n.op == "call_module":
        m = _resolve(gm, n.target)
        act = _ACT_MODS.get(type(m))
        if act == "gelu" and getattr(m, "approximate", "none") == "tanh":
            act = "gelu_tanh"
        return act
    return None


def _match_linear_act(gm, n, sid):
    if n.op != "call_module" or not isinstance(_resolve(gm, n.target), nn.Linear) or len(n.args) != 1 \
            or _mods.quantized_linear(_resolve(gm, n.target)):
        return None
    u = _one_user(n)
    act = _activation(gm, u) if u is not None else None
    if act is None:
        return None
    lin = _resolve(gm, n.target)
    with gm.graph.inserting_before(n):
        w = gm.graph.get_attr(f"{n.target}.weight")
        b = gm.graph.get_attr(f"{n.target}.bias") if lin.bias is not None else None
    return opsadv_fx_linear_act, (n.args[0], w, b, act, sid), u, f"Linear+{act} -> opsadv.gemm(activation={act!r})"


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        if isinstance(m, (_mods.OpsadvNorm, _mods.QKVProjection, _mods.SwiGLUMLP, _mods.LinearAct,
                          _mods.DenseResidualNorm)) or getattr(m, "_opsadv_fx", False):
            return True
        return super().is_leaf_module(m, qualname)


def rewrite_graph(mod: nn.Module, sid: int, opt_level: int):
    """(GraphModule, [descriptions]) or (None, reason)."""
    try:
        graph = _Tracer().trace(mod)
    except Exception as e:  # untraceable forward (data-dependent control flow, ...)
        return None, f"torch.fx cannot trace it: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    gm = fx.GraphModule(mod, graph, class_name=type(mod).__name__ + "_opsadv")
    done = []
    matchers = [_match_attention, _match_norm] + ([_match_linear_act] if opt_level >= 2 else [])
    for node in list(gm.graph.nodes):
        if node.graph is None:
            continue
        for match in matchers:
            try:
                found = match(gm, node, sid)
            except (AttributeError, IndexError, TypeError):
                found = None
            if found is None:
                continue
            fn, args, last, desc = found
            with gm.graph.inserting_after(last):
                new = gm.graph.call_function(fn, args)
            last.replace_all_uses_with(new)
            new.args = args                        # (replace_all_uses_with must not rewrite our own args)
            done.append(desc)
            break
    if not done:
        return None, None
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    gm._opsadv_fx = True
    return gm, done


def fx_pass(model: nn.Module, report, undo, state, opt_level: int) -> nn.Module:
    """Rewrite model's submodules (children first) and then the model itself; returns the new root
    (the model itself unless its own forward had to be rewritten, then a GraphModule)."""
    sid = state.sid

    def visit(mod, path, parent, name):
        if getattr(mod, "_opsadv_fx", False) or type(mod).__module__.startswith("opsadv."):
            return mod
        for cname, child in list(mod.named_children()):
            visit(child, f"{path}.{cname}" if path else cname, mod, cname)
        if type(mod).__module__.startswith("torch.nn"):
            return mod                            # torch's own modules (Linear, containers): children only
        gm, done = rewrite_graph(mod, sid, opt_level)
        if gm is None:
            if done:
                report.add("skipped", path, type(mod).__name__, done)
            return mod
        gm._opsadv_state = state
        for d in done:
            report.add("fx", path, f"{type(mod).__name__}: {d}")
        if parent is not None:
            undo.swap(parent, name, gm)
        return gm

    root = visit(model, "", None, None)
    if root is not model:
        report.notes.append(f"the model's own forward was rewritten: the result is a torch.fx GraphModule "
                            f"({type(root).__name__}), not a {type(model).__name__}")
    return root
