"""The rotary pass: transformers' attention modules call a module-level `apply_rotary_pos_emb(q, k, cos, sin)`
(about six elementwise kernels per layer and direction); this points each attention module of the converted
model, and only those, at `opsadv.ops.rotary_embedding` (one kernel).

How: the attention class's forward (under its decorators) looks the function up in its module's globals.  Each
converted class gets a copy of that forward whose code reads a name of its own instead (`_opsadv_rotary_<n>`, one
new global of the modeling module that nothing else reads), bound as each converted instance's `forward`; the
class, the modeling module's function and every other model are untouched, and undo deletes the instance
attribute and the global.  The copy keeps the module's globals (torch.compile guards and resumes functions
through their module).  Before anything is swapped, the model's function is checked numerically (float64,
random inputs, GQA, full and partial rotary width) against the op; a function that computes something else
(GPT-J's interleaved sincos, a different signature) is reported as skipped with the reason.

Per-head q / k norms (Qwen3, Gemma-3: `q = self.q_norm(x).transpose(1, 2)` or `q = self.q_norm(q)`, then
`apply_rotary_pos_emb(q, k, cos, sin)`) fuse into `opsadv.ops.qk_norm_rotary`, where the forward's source shows
that the two norms' outputs reach the rotary call and nothing else (norm_sites: each norm attribute read once, its
result assigned to the variable the rotary call takes, at most transposed over dims other than the last in
between, and that variable not read between the two statements).  The copied forward then reads
`self._opsadv_q_norm` / `self._opsadv_k_norm` instead of `self.q_norm` / `self.k_norm` (instance attributes of the
converted modules; the norm modules stay where they are, in state_dict and named_modules): each returns a
Deferred holding the un-normalized tensor and the norm module the forward would have called, and the rotary
replacement fuses both norms into the op, reading the norm's weight, eps and offset at call time (the norm pass's
OpsadvNorm, or the model's own module as probe_norm found it).  Any call it cannot fuse (another norm module
than the probed one, hooks on the norm, dtypes that differ, a call form rotary does not serve) first runs the
norm module on the deferred tensor: a norm over the last dim commutes with the transpose, so that is the
original computation.  OLMo-2 (a norm over the whole projection, applied before the heads are split) does not
match the pattern and keeps rotary_embedding alone."""
from __future__ import annotations

import ast
import dis
import functools
import inspect
import itertools
import textwrap
import types

import torch
from torch import nn

from opsadv import ops
from opsadv.core.policy import use_backend

from .modules import OpsadvNorm
from .passes import probe_norm
from .report import ConversionReport
from .state import scope_of

_compiling = torch.compiler.is_compiling
NAMES = ("apply_rotary_pos_emb",)       # transformers' name in every modeling file that uses rotary


def _innermost(fn):
    """fn and the chain of functools.wraps wrappers above the function that holds the code."""
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 8:
        chain.append(chain[-1].__wrapped__)
    return chain


def _copy_fn(f, code=None, closure=None):
    g = types.FunctionType(f.__code__ if code is None else code, f.__globals__, f.__name__, f.__defaults__,
                           f.__closure__ if closure is None else closure)
    g.__kwdefaults__ = f.__kwdefaults__
    g.__qualname__ = f.__qualname__
    g.__dict__.update(f.__dict__)
    g.__module__ = f.__module__
    return g


_GLOBAL_READ = frozenset({"LOAD_GLOBAL"})
_ATTR_READ = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _renamed(code: types.CodeType, old: str, new: str, reads=_GLOBAL_READ) -> types.CodeType | None:
    """code (and the code it nests) reading `new` where it read `old` (a global, or with reads=_ATTR_READ an
    attribute); None where `old` is also used otherwise (stored, or as the other kind of name: the names table is
    shared by every use)."""
    if old in code.co_names:
        if any(ins.argval == old and ins.opname not in reads for ins in dis.get_instructions(code)):
            return None
    consts = []
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            c = _renamed(c, old, new, reads)
            if c is None:
                return None
        consts.append(c)
    names = tuple(new if n == old else n for n in code.co_names)
    return code.replace(co_names=names, co_consts=tuple(consts))


def rebind(forward, name: str, alias: str, attrs: dict[str, str] | None = None):
    """A copy of `forward` (through its functools.wraps chain) whose code reads global `alias` for `name` (and
    attribute attrs[a] for each attribute a in attrs); None when that cannot be done faithfully (a wrapper that
    holds the function other than in a closure cell: a copy would skip the wrapper; a name used other than as the
    read it is renamed as)."""
    chain = _innermost(forward)
    inner = chain[-1]
    code = _renamed(inner.__code__, name, alias)
    for old, new in (attrs or {}).items():
        code = _renamed(code, old, new, _ATTR_READ) if code is not None else None
    if code is None:
        return None
    new = _copy_fn(inner, code=code)
    for i in range(len(chain) - 2, -1, -1):       # re-close each wrapper over the copy below it
        w, old = chain[i], chain[i + 1]
        cells = getattr(w, "__closure__", None) or ()       # a decorator object has none: cannot be re-closed
        hit = [j for j, c in enumerate(cells) if _cell(c) is old]
        if len(hit) != 1:
            return None
        closure = tuple(types.CellType(new) if j == hit[0] else c for j, c in enumerate(cells))
        below = new
        new = _copy_fn(w, closure=closure)
        new.__wrapped__ = below
    return new


_serial = itertools.count()


class _DropGlobal:
    """An undo hook: the alias leaves the modeling module with the rewrite."""

    def __init__(self, globals_: dict, name: str):
        self.globals, self.name = globals_, name

    def remove(self) -> None:
        self.globals.pop(self.name, None)


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:                     # an empty cell
        return None


def _rotary_global(cls):
    """(name, function) of the rotary function the class's forward calls, else None."""
    fwd = getattr(cls, "forward", None)
    if fwd is None or fwd is nn.Module.forward:
        return None
    inner = _innermost(fwd)[-1]          # (through any functools.wraps wrapper, function or object)
    if not isinstance(inner, types.FunctionType):
        return None
    for name in NAMES:
        if name in inner.__code__.co_names and callable(inner.__globals__.get(name)):
            return name, inner.__globals__[name]
    return None


def _probe(fn) -> tuple[bool, bool, str]:
    """(matches the op at full width, matches at partial width, why not): float64, random q/k, GQA."""
    gen = torch.Generator().manual_seed(0)
    b, hq, hk, s, d = 2, 4, 2, 5, 8
    q = torch.randn(b, hq, s, d, dtype=torch.float64, generator=gen)
    k = torch.randn(b, hk, s, d, dtype=torch.float64, generator=gen)

    def same(r):
        ang = torch.randn(b, s, r // 2, dtype=torch.float64, generator=gen)
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos(), emb.sin()
        try:
            with torch.no_grad():
                got = fn(q, k, cos, sin)
        except Exception as e:                       # noqa: BLE001 - any failure means "not this function"
            return False, f"{type(e).__name__}: {e}"
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return False, "it does not return (q, k)"
        want = ops.rotary_embedding(q, k, cos, sin)
        ok = all(a.shape == w.shape and torch.allclose(a.double(), w, rtol=1e-9, atol=1e-9) for a, w in zip(got, want))
        return ok, "" if ok else "it computes another rotation than transformers' rotate_half form"
    with use_backend("reference"):        # the float64 oracle on the CPU
        full, why = same(d)
        part, _ = same(d // 2) if full else (False, "")
    return full, part, why


# ---- per-head q / k norms deferred to the rotary call -----------------------------------------------------------
_SCOPE_ESCAPES = frozenset({"locals", "vars", "eval", "exec", "globals"})


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _norm_attr(stmt: ast.stmt, var: str, me: str) -> str | None:
    """The attribute `a` where stmt is `var = me.a(x)`, optionally followed by .transpose(i, j) with int constants
    (Deferred.transpose decides at run time whether they leave the last dim alone), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == var):
        return None
    v = stmt.value
    while (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "transpose"
           and not v.keywords and len(v.args) == 2
           and all(isinstance(a, ast.Constant) and type(a.value) is int for a in v.args)):
        v = v.func.value
    if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and isinstance(v.func.value, ast.Name)
            and v.func.value.id == me and len(v.args) == 1 and not v.keywords
            and not isinstance(v.args[0], ast.Starred)):
        return v.func.attr
    return None


def _attr_reads(code: types.CodeType, attr: str) -> int:
    """How many instructions of code (and the code it nests) use the name `attr`."""
    n = sum(1 for ins in dis.get_instructions(code) if ins.argval == attr and ins.opname in _ATTR_READ)
    return n + sum(_attr_reads(c, attr) for c in code.co_consts if isinstance(c, types.CodeType))


def norm_sites(forward, rope: str) -> tuple[dict[str, str] | None, str]:
    """({"q": attr, "k": attr}, "") where the forward's source norms q and k by `self.<attr>(x)` whose results
    reach the rotary call `rope(q, k, ...)` and nothing else; else (None, why not).  What is checked: the rotary
    call is one assignment statement of the function's body taking two plain names; the last statement of the
    body before it that mentions each name assigns it `self.<attr>(x)` (optionally .transpose(i, j)-ed), so
    nothing between the two statements reads it; each such attribute is named once in the whole function; the
    names appear in no nested scope (lambda, comprehension, inner function), and the function calls none of
    locals / vars / eval / exec / globals."""
    inner = _innermost(forward)[-1]
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
    except (OSError, TypeError, SyntaxError):
        return None, "its source is not available"
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef) or fdef.name != inner.__name__ or not fdef.args.args:
        return None, "its source is not the forward's"
    me = fdef.args.args[0].arg
    calls = [n for n in ast.walk(fdef) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == rope]
    if len(calls) != 1:
        return None, f"it calls {rope} {len(calls)} times"
    call = calls[0]
    at = next((i for i, st in enumerate(fdef.body) if isinstance(st, ast.Assign) and st.value is call), None)
    if at is None or len(call.args) < 2 or not all(isinstance(a, ast.Name) for a in call.args[:2]):
        return None, f"its {rope} call is not `q, k = {rope}(q, k, ...)` in the forward's body"
    if any(isinstance(n, ast.Name) and n.id in _SCOPE_ESCAPES for n in ast.walk(fdef)):
        return None, "it reads its variables by name (locals / vars / eval / exec / globals)"
    nested = [n for n in ast.walk(fdef) if n is not fdef and isinstance(
        n, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ListComp, ast.SetComp, ast.DictComp,
            ast.GeneratorExp))]
    out = {}
    for role, arg0 in zip("qk", call.args[:2]):
        var = arg0.id
        if any(_mentions(a, var) for a in (*call.args[2:], *call.keywords)) or any(_mentions(n, var) for n in nested):
            return None, f"{var} is read elsewhere than as the rotary call's {role}"
        before = [i for i in range(at) if _mentions(fdef.body[i], var)]
        attr = _norm_attr(fdef.body[before[-1]], var, me) if before else None
        if attr is None:
            return None, f"{var} does not come straight from a norm module (`{var} = {me}.<norm>(x)`)"
        uses = [n for n in ast.walk(fdef) if (isinstance(n, ast.Attribute) and n.attr == attr)
                or (isinstance(n, ast.Name) and n.id == attr) or (isinstance(n, ast.Constant) and n.value == attr)]
        if len(uses) != 1 or _attr_reads(inner.__code__, attr) != 1:     # (and the code is the source's)
            return None, f"{me}.{attr} is named more than once"
        out[role] = attr
    if out["q"] == out["k"]:
        return None, "q and k share one norm module"
    return out, ""


try:
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
except ImportError:                       # (private names of torch: where they are gone, no global hooks are seen)
    _global_forward_hooks, _global_forward_pre_hooks = {}, {}


class Deferred:
    """q or k whose per-head norm a converted attention forward left to the rotary call: base is the tensor the
    norm module `norm` would have been called on, dims the transposes the forward applied to the norm's result
    since (none of them moves the last dim, so the norm commutes with them); probed is what probe_norm found the
    model's own module to be at conversion ((module, eps attribute, offset), or None)."""

    def __init__(self, base, norm, probed, dims: tuple = ()):
        self.base, self.norm, self.probed, self.dims = base, norm, probed, dims

    def _transposed(self, t):
        for a, b in self.dims:
            t = t.transpose(a, b)
        return t

    @property
    def x(self):
        """The un-normalized tensor as the forward has transposed it."""
        return self._transposed(self.base)

    def transpose(self, a: int, b: int):
        nd = self.base.dim()
        if a % nd == nd - 1 or b % nd == nd - 1:        # the normalized dim moves: the norm runs first
            return self.materialize().transpose(a, b)
        return Deferred(self.base, self.norm, self.probed, self.dims + ((a, b),))

    def materialize(self):
        """What the original forward computed: the norm module on the tensor it was given, then the transposes."""
        return self._transposed(self.norm(self.base))

    def params(self):
        """(weight, eps, offset) of an RMSNorm the op computes, read now; None: run the module instead."""
        norm = self.norm
        if norm._forward_hooks or norm._forward_pre_hooks or _global_forward_hooks or _global_forward_pre_hooks:
            return None                                   # (hooks must see the call)
        if type(norm) is OpsadvNorm:
            ok = norm.kind == "rms" and norm.bias is None and norm.weight is not None
            return (norm.weight, norm.eps, norm.offset) if ok else None
        p = self.probed
        if p is not None and p[0] is norm:
            return norm.weight, float(getattr(norm, p[1])), p[2]
        return None


def _materialized(t):
    return t.materialize() if type(t) is Deferred else t


def _fusable(q, k, cos, partial: bool):
    """(q, k, q_weight, k_weight, eps, offset) of a qk_norm_rotary call computing what the norms and the rotary
    call would, else None."""
    if type(q) is not Deferred or type(k) is not Deferred:
        return None
    pq, pk = q.params(), k.params()
    if pq is None or pk is None or pq[1:] != pk[1:]:
        return None
    (wq, eps, off), wk = pq, pk[0]
    xq, xk = q.x, k.x
    if xq.dim() != 4 or xk.dim() != 4 or cos.dim() not in (2, 3):
        return None
    d = xq.shape[-1]
    if (cos.shape[-1] != d and not partial) or xk.dtype != xq.dtype or wq.shape != (d,) or wk.shape != (d,):
        return None
    if any(w.dtype != xq.dtype or w.device != xq.device for w in (wq, wk)):
        return None
    return xq, xk, wq, wk, eps, off


def _deferral(attr: str):
    """The converted forward's `self._opsadv_<attr>(x)`: a Deferred in place of `self.<attr>(x)` (the module the
    attribute holds at call time: the norm pass's replacement, or the model's own)."""
    def defer(self, x):
        return Deferred(x, getattr(self, attr), self._opsadv_qk_probed.get(attr))
    defer.__name__ = f"_opsadv_{attr}"
    return defer


def _make_rope(original, partial: bool, state):
    """The replacement: the op where the call is one it serves (the probe's forms), the original otherwise.  Eager
    calls run inside their attention module's scope (the instance forward below enters it: a deepcopy's own);
    under torch.compile the forward enters none (an explicit backend's scope breaks the graph: only here).
    Deferred q / k (norm_sites) fuse into qk_norm_rotary where _fusable says so, else their norms run first."""
    rope_op, fused_op = ops.rotary_embedding, ops.qk_norm_rotary

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        served = not args and (not kwargs or kwargs == {"unsqueeze_dim": 1})
        if type(q) is Deferred or type(k) is Deferred:
            f = _fusable(q, k, cos, partial) if served else None
            if f is not None:
                xq, xk, wq, wk, eps, off = f
                if _compiling():
                    with state.scope():
                        return fused_op(xq, xk, cos, sin, wq, wk, eps=eps, weight_offset=off)
                return fused_op(xq, xk, cos, sin, wq, wk, eps=eps, weight_offset=off)
            q, k = _materialized(q), _materialized(k)
        if not served or q.dim() != 4 or cos.dim() not in (2, 3) or (cos.shape[-1] != q.shape[-1] and not partial):
            return original(q, k, cos, sin, *args, **kwargs)
        if _compiling():
            with state.scope():
                return rope_op(q, k, cos, sin)
        return rope_op(q, k, cos, sin)
    apply_rotary_pos_emb.__opsadv_original__ = original
    return apply_rotary_pos_emb


def _scoped(rebound):
    """The instance forward: the rebound class forward under the module's own policy (a deepcopy of the model
    rebinds it to the copy, whose state it then reads)."""
    @functools.wraps(rebound)
    def forward(self, *args, **kwargs):
        if _compiling():
            return rebound(self, *args, **kwargs)
        with scope_of(self):
            return rebound(self, *args, **kwargs)
    return forward


_PROBED: dict = {}          # function -> _probe's answer (modeling functions live as long as their modules)


def _install_deferrals(m: nn.Module, attrs, undo) -> bool:
    """m's `_opsadv_<attr>` deferrals and what probe_norm finds its norms to be; True where both are RMSNorms the
    op computes (else every call runs the modules: still the original's results)."""
    probed = {}
    for attr in attrs:
        m.__dict__[f"_opsadv_{attr}"] = types.MethodType(_deferral(attr), m)
        undo.instance_attrs.append((m, f"_opsadv_{attr}"))
        norm = getattr(m, attr, None)
        p = probe_norm(norm) if isinstance(norm, nn.Module) else None
        probed[attr] = (norm, p[3], p[1]) if p is not None and p[0] == "rms" else None
    m.__dict__["_opsadv_qk_probed"] = probed
    undo.instance_attrs.append((m, "_opsadv_qk_probed"))
    return all(v is not None for v in probed.values())


def rotary_pass(model: nn.Module, report: ConversionReport, undo, state) -> int:
    forwards: dict[type, object] = {}          # one rebound forward per class (shared by its instances)
    deferred: dict[type, tuple[str, ...]] = {}  # the norm attributes each class's rebound forward defers
    skipped: dict[type, str] = {}
    n = 0
    for path, m in model.named_modules():
        found = _rotary_global(type(m))
        if found is None:
            continue
        name, fn = found
        cls = type(m)
        if cls in skipped:
            report.add("skipped", path, f"{cls.__name__}: {name}", skipped[cls])
            continue
        if cls not in forwards:
            if fn not in _PROBED:
                _PROBED[fn] = _probe(fn)
            full, part, why = _PROBED[fn]
            alias = f"_opsadv_rotary_{next(_serial)}"
            sites = norm_sites(cls.forward, name)[0] if full else None
            attrs = tuple(sites.values()) if sites else ()
            new = rebind(cls.forward, name, alias, {a: f"_opsadv_{a}" for a in attrs}) if full else None
            if new is None and attrs:               # (the attributes could not be renamed: rotary alone)
                attrs = ()
                new = rebind(cls.forward, name, alias)
            if new is None:
                skipped[cls] = (f"{fn.__module__}.{name} does not compute opsadv.rotary_embedding ({why})" if not full
                                else f"{cls.__name__}.forward is wrapped by a decorator opsadv cannot copy")
                report.add("skipped", path, f"{cls.__name__}: {name}", skipped[cls])
                continue
            glob = _innermost(new)[-1].__globals__
            glob[alias] = _make_rope(fn, part, state)
            undo.hooks.append(_DropGlobal(glob, alias))
            forwards[cls], deferred[cls] = _scoped(new), attrs
        m.__dict__["forward"] = types.MethodType(forwards[cls], m)
        undo.instance_attrs.append((m, "forward"))
        if "_opsadv_state" not in m.__dict__:        # (the attention step sets it too; whichever comes first owns it)
            m.__dict__["_opsadv_state"] = state
            undo.instance_attrs.append((m, "_opsadv_state"))
        attrs = deferred[cls]
        if attrs and _install_deferrals(m, attrs, undo):
            report.add("replaced", path, f"{cls.__name__}: {' / '.join(attrs)} + {name} -> opsadv.qk_norm_rotary "
                       "(opsadv.rotary_embedding where a call cannot fuse)")
        else:
            report.add("replaced", path, f"{cls.__name__}: {name} -> opsadv.rotary_embedding")
        n += 1
    return n
