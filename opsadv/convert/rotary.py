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
(GPT-J's interleaved sincos, a different signature) is reported as skipped with the reason."""
from __future__ import annotations

import dis
import functools
import itertools
import types

import torch
from torch import nn

from opsadv import ops
from opsadv.core.policy import use_backend

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


def _renamed(code: types.CodeType, old: str, new: str) -> types.CodeType | None:
    """code (and the code it nests) reading global `new` where it read `old`; None where `old` is also used as
    an attribute or stored (the names table is shared by both uses)."""
    if old in code.co_names:
        if any(ins.argval == old and ins.opname != "LOAD_GLOBAL" for ins in dis.get_instructions(code)):
            return None
    consts = []
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            c = _renamed(c, old, new)
            if c is None:
                return None
        consts.append(c)
    names = tuple(new if n == old else n for n in code.co_names)
    return code.replace(co_names=names, co_consts=tuple(consts))


def rebind(forward, name: str, alias: str):
    """A copy of `forward` (through its functools.wraps chain) whose code reads global `alias` for `name`; None
    when that cannot be done faithfully (a wrapper that holds the function other than in a closure cell: a copy
    would skip the wrapper; the name used other than as a global read)."""
    chain = _innermost(forward)
    inner = chain[-1]
    code = _renamed(inner.__code__, name, alias)
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


def _make_rope(original, partial: bool, state):
    """The replacement: the op where the call is one it serves (the probe's forms), the original otherwise.  Eager
    calls run inside their attention module's scope (the instance forward below enters it: a deepcopy's own);
    under torch.compile the forward enters none (an explicit backend's scope breaks the graph: only here)."""
    rope_op = ops.rotary_embedding

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (args or (kwargs and kwargs != {"unsqueeze_dim": 1}) or q.dim() != 4 or cos.dim() not in (2, 3)
                or (cos.shape[-1] != q.shape[-1] and not partial)):
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


def rotary_pass(model: nn.Module, report: ConversionReport, undo, state) -> int:
    forwards: dict[type, object] = {}          # one rebound forward per class (shared by its instances)
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
            new = rebind(cls.forward, name, alias) if full else None
            if new is None:
                skipped[cls] = (f"{fn.__module__}.{name} does not compute opsadv.rotary_embedding ({why})" if not full
                                else f"{cls.__name__}.forward is wrapped by a decorator opsadv cannot copy")
                report.add("skipped", path, f"{cls.__name__}: {name}", skipped[cls])
                continue
            glob = _innermost(new)[-1].__globals__
            glob[alias] = _make_rope(fn, part, state)
            undo.hooks.append(_DropGlobal(glob, alias))
            forwards[cls] = _scoped(new)
        m.__dict__["forward"] = types.MethodType(forwards[cls], m)
        undo.instance_attrs.append((m, "forward"))
        if "_opsadv_state" not in m.__dict__:        # (the attention step sets it too; whichever comes first owns it)
            m.__dict__["_opsadv_state"] = state
            undo.instance_attrs.append((m, "_opsadv_state"))
        report.add("replaced", path, f"{cls.__name__}: {name} -> opsadv.rotary_embedding")
        n += 1
    return n
