"""The dispatch policy: which backend(s), strictness, profile, options.

`use_backend(...)` sets the process default.  `with use_backend(...):` changes only the current thread /
async context (a ContextVar set on enter, reset on exit) and never touches the process default, so
concurrent scopes in other threads neither see nor overwrite it.

A converted model's scope is a registered *scope source* (register_scope): its id is what the ops' torch.library
calls carry as their last argument (op_scope), so a compiled graph runs each op under its model's policy without a
ContextVar in the traced code (dynamo cannot trace one: it broke the graph once per converted module)."""
from __future__ import annotations

import dis
import itertools
import os
import sys
import threading
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from . import hooks
from .errors import BackendUnavailableError, InvalidArgumentError
from .kernel import Profile
from .opdef import OPS
from .precision import PrecisionPolicy

_serial = itertools.count(1)
_serials: dict[str, int] = {}           # policy content -> serial
_serials_lock = threading.Lock()
SERIALS_MAX = 4096


@dataclass(frozen=True)
class Policy:
    backend: str = "auto"                 # "auto" or a backend name
    strict: bool = False                  # strict: no reference fallback even under "auto"
    profile: str | None = None            # force a profile of the primary backend
    experimental: bool = False            # allow impls marked experimental
    deterministic: bool = False           # only impls that declare determinism
    autotune: bool = False                # measure candidates on first call of a bucket
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    options: tuple[tuple[str, Any], ...] = ()   # backend-specific (aoe_mode, memory_budget, ...)
    impls: tuple[tuple[str, str], ...] = ()     # pinned impl per op: ((op, impl id), ...)
    # how autotune times candidates (and which measurements a resolution reads): "wall" = back-to-back
    # eager calls (host cost counts where it dominates: eager code); "graph" = GPU time of CUDA-graph
    # replays (code that runs under CUDA graphs, e.g. convert_model(cuda_graphs=True))
    timing: str = "wall"
    # the dispatch memo's key: equal content, equal serial (set in __post_init__; dataclasses.replace recomputes it),
    # so switching between a few policies any number of times keeps the memo at a few entries per bucket
    serial: int = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        # repr, not ==: 1, 1.0 and True are equal but may be read differently by a backend's options
        key = repr(tuple(getattr(self, f.name) for f in fields(self) if f.name != "serial"))
        with _serials_lock:
            serial = _serials.get(key)
            if serial is None:
                if len(_serials) >= SERIALS_MAX:     # bounded: a forgotten policy only costs a memo miss
                    _serials.clear()
                serial = _serials[key] = next(_serial)
        object.__setattr__(self, "serial", serial)

    def describe(self) -> str:
        extra = [f"profile={self.profile}"] if self.profile else []
        extra += [k for k in ("strict", "experimental", "deterministic", "autotune") if getattr(self, k)]
        extra += [f"{op} pinned to {impl}" for op, impl in self.impls]
        extra += [f"timing={self.timing}"] if self.timing != "wall" else []
        extra += [f"precision {k}={v}" for k, v in self.precision.changed().items()]
        return f"backend={self.backend!r}" + (" (" + ", ".join(extra) + ")" if extra else "")

    @property
    def option_dict(self) -> dict[str, Any]:
        return dict(self.options)


def _default_policy() -> Policy:
    # " reference" / "REFERENCE" name the reference backend; an unknown name fails at dispatch, listing the known ones
    return Policy(backend=os.environ.get("OPSADV_BACKEND", "").strip().lower() or "auto")


_global_lock = threading.Lock()
_global: Policy = _default_policy()
_scoped: ContextVar[Policy | None] = ContextVar("opsadv_policy", default=None)


def current_policy() -> Policy:
    """The policy in force here (a `with use_backend(...)` scope, else the process default)."""
    return _scoped.get() or _global


class PolicyScope:
    """`with PolicyScope(p):` runs opsadv ops of this thread / context under p (a ContextVar set / reset)."""
    __slots__ = ("policy", "token")

    def __init__(self, policy: Policy):
        self.policy = policy

    def __enter__(self):
        self.token = _scoped.set(self.policy)

    def __exit__(self, *exc):
        _scoped.reset(self.token)


class _NoScope:
    """The no-op scope: one shared object (a fresh contextlib.nullcontext() per op call costs ~0.1 us more)."""
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


NO_SCOPE = _NoScope()

# ---- scopes the ops' torch.library calls carry (compiled graphs) ----------------------------------------------
# id -> a source: an object whose .effective() is the policy its ops run under (a converted model's RuntimeState)
_sources: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
# the scope id a torch.ops call made here carries when no traced scope says otherwise (an op backward: its forward's)
_scope_arg: ContextVar[int] = ContextVar("opsadv_scope_arg", default=0)


def register_scope(source) -> int:
    """A process-wide id for `source` (held weakly) that op calls can carry: op_scope() / in_scope()."""
    sid = next(_serial)
    _sources[sid] = source
    return sid


class _Trace:
    """What dynamo reads while it traces: the id of the innermost TracedScope (0: none, the ambient policy)."""

    def __init__(self):
        # an instance attribute from the start: a class default shadowed by the first TracedScope's write fails
        # dynamo's guard on the instance's __dict__ and recompiles every converted model's graph once
        self.sid = 0


TRACE = _Trace()


class TracedScope:
    """The scope a converted module enters while dynamo traces it: plain attribute writes dynamo folds into
    constants (a ContextVar would break the graph).  The ops traced inside carry `sid` as their scope argument;
    no policy is set, in the trace or at run time (the op calls set it, in_scope)."""
    __slots__ = ("sid", "prev")

    def __init__(self, sid: int):
        self.sid = sid

    def __enter__(self):
        self.prev = TRACE.sid
        TRACE.sid = self.sid

    def __exit__(self, *exc):
        TRACE.sid = self.prev


_dynamo_compiling = torch.compiler.is_dynamo_compiling
_exporting = torch.compiler.is_exporting


def op_scope() -> int:
    """The scope argument of a torch.ops.opsadv call made here: under dynamo the traced scope's id (a constant
    of the graph); in an op's backward its forward's; otherwise 0 (the op runs under the policy in force).
    Exported programs carry none (0): ids are this process's, a program outlives it."""
    if _dynamo_compiling():
        return 0 if _exporting() else TRACE.sid
    return 0 if _exporting() else _scope_arg.get()


def scope_source(sid: int):
    """The live source registered as `sid`, or None."""
    return _sources.get(sid)


def scope_policy(sid: int) -> Policy:
    src = _sources.get(sid)
    if src is None:
        raise InvalidArgumentError("opsadv op", "scope", "0 or the scope id of a live converted model in this process",
                                   f"{sid!r} (its model was freed, or the graph was traced in another process)")
    return src.effective()


def in_scope(sid: int):
    """Inside a torch.ops.opsadv op: run under scope `sid`'s policy (0: the policy in force, nothing to do)."""
    if not sid:
        return NO_SCOPE
    p = scope_policy(sid)
    return NO_SCOPE if _scoped.get() is p else PolicyScope(p)


def _set_global(p: Policy) -> Policy:
    global _global
    with _global_lock:
        prev, _global = _global, p
    return prev


def _restore_global(p: Policy, prev: Policy) -> None:
    """Undo _set_global(p) unless another call replaced p since (that one's default stays)."""
    global _global
    with _global_lock:
        if _global is p:
            _global = prev


# (code object, offset of the call) -> whether the call's result goes straight into a with-statement
_with_sites: dict[tuple[Any, int], bool] = {}


def _called_by_with(frame) -> bool:
    """Is the call executing in `frame` the context expression of a `with` statement?  Read from the
    caller's bytecode (once per call site): the instruction after the CALL enters the with-block."""
    key = (frame.f_code, frame.f_lasti)
    hit = _with_sites.get(key)
    if hit is None:
        after = [i.opname for i in dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti][:2]
        hit = bool(after) and (after[0] in ("BEFORE_WITH", "SETUP_WITH")           # 3.11 - 3.13 / older
                               or after == ["COPY", "LOAD_SPECIAL"])               # 3.14
        if len(_with_sites) < 4096:
            _with_sites[key] = hit
    return hit


class Backend:
    """What `use_backend` returns: printable, and a context manager for scoped use."""

    def __init__(self, policy: Policy, name: str, profile: str | None, prev: Policy | None):
        # prev: the process default this call replaced (None: called as `with use_backend(...)`, nothing replaced)
        self.policy, self.name, self.profile, self._prev = policy, name, profile, prev
        self._tokens: list = []

    def __repr__(self) -> str:
        prof = f", profile={self.profile!r}" if self.profile else ""
        req = "" if self.policy.backend == self.name else f", requested={self.policy.backend!r}"
        return f"Backend({self.name!r}{prof}{req})"

    def __enter__(self) -> "Backend":
        if self._prev is not None:     # `b = use_backend(...); with b:` set the default first: undo it
            _restore_global(self.policy, self._prev)
            self._prev = None
        self._tokens.append(_scoped.set(self.policy))     # a list: one Backend may be entered nested
        return self

    def __exit__(self, *exc) -> None:
        _scoped.reset(self._tokens.pop())


def select_profile(backend, policy: Policy, env=None) -> Profile | None:
    """The backend's profile under this policy: the forced one, else the best match for `env` (the
    registry's, or one GPU's view of it on a node of mixed GPUs)."""
    profiles = backend.profiles
    if policy.profile is not None and (policy.backend == backend.name or policy.backend == "auto"):
        for p in profiles:
            if p.name == policy.profile:
                return p
        raise InvalidArgumentError("use_backend", "profile",
                                   f"a profile of backend {backend.name!r}: {[p.name for p in profiles]}",
                                   repr(policy.profile))
    env = env or hooks.get_registry().env
    matching = [p for p in profiles if p.matches is None or p.matches(env)]
    matching.sort(key=lambda p: (-p.priority, p.name))
    return matching[0] if matching else None


_POLICY_KEYS = {"strict", "profile", "experimental", "deterministic", "autotune", "precision", "impls", "timing"}
_BOOL_KEYS = ("strict", "experimental", "deterministic", "autotune")
TIMINGS = ("wall", "graph")


def _check_impls(impls, reg) -> tuple[tuple[str, str], ...]:
    """impls={op: impl id}: each op runs only that impl (conformance of one kernel, A/B tests);
    a call the pinned impl cannot serve raises NoKernelError with its reasons."""
    if impls is None:
        return ()
    if not isinstance(impls, dict):
        raise InvalidArgumentError("use_backend", "impls", "a dict {op name: impl id}", repr(impls))
    out = []
    for op, impl in impls.items():
        if op not in OPS:
            raise InvalidArgumentError("use_backend", "impls", f"op names in {list(OPS)}", repr(op))
        known = [i.id for i in reg.impls_by_op.get(op, [])]
        if impl not in known:
            raise InvalidArgumentError("use_backend", "impls", f"an impl id registered for {op}: {known}", repr(impl))
        out.append((op, impl))
    return tuple(sorted(out))


def use_backend(name: str = "auto", **kwargs: Any) -> Backend:
    """Select the backend for opsadv ops: "auto" or a backend name ("reference", "cuda",
    "ascend", "jetson", or a plugin's).  Keyword options: strict, profile, experimental,
    deterministic, autotune, precision, impls ({op: impl id} pins), timing ("wall" | "graph": how autotune
    times candidates, see Policy.timing), plus backend-specific options validated by the
    backend itself (e.g. aoe_mode for ascend, memory_budget for jetson)."""
    if not isinstance(name, str):
        raise InvalidArgumentError("use_backend", "name", "a backend name string or 'auto'", repr(name))
    reg = hooks.get_registry()
    known = sorted(reg.backends)
    if name != "auto" and name not in reg.backends:
        failed = [f for f in reg.failures if f.name == name]
        reasons = [f"no backend named {name!r}; known backends: {known}"] + [str(f) for f in failed]
        raise BackendUnavailableError(name, reasons)
    policy_kw = {k: v for k, v in kwargs.items() if k in _POLICY_KEYS}
    for k in _BOOL_KEYS:
        # bool only: autotune="no" or strict="false" would otherwise read as true
        if k in policy_kw and not isinstance(policy_kw[k], bool):
            raise InvalidArgumentError("use_backend", k, "a bool (True or False)", repr(policy_kw[k]))
    backend_opts = {k: v for k, v in kwargs.items() if k not in _POLICY_KEYS}
    policy_kw["precision"] = PrecisionPolicy.from_string(policy_kw.get("precision"))
    policy_kw["impls"] = _check_impls(policy_kw.get("impls"), reg)
    if policy_kw.get("timing", "wall") not in TIMINGS:
        raise InvalidArgumentError("use_backend", "timing", f"one of {list(TIMINGS)}", repr(policy_kw["timing"]))
    primary = reg.auto_backend() if name == "auto" else reg.backends[name]
    if not primary.available:
        raise BackendUnavailableError(primary.name, list(primary.probe.reasons))
    if backend_opts or hasattr(primary.plugin, "opsadv_activate"):
        normalized = primary.call("opsadv_activate", options=dict(backend_opts), env=reg.env)
        if normalized is None and backend_opts:
            raise InvalidArgumentError("use_backend", next(iter(backend_opts)),
                                       f"an option of backend {primary.name!r} (it takes none; policy options are "
                                       f"{sorted(_POLICY_KEYS)})", repr(backend_opts))
        backend_opts = dict(normalized or {})
    policy = Policy(backend=name, options=tuple(sorted(backend_opts.items())), **policy_kw)
    profile = select_profile(primary, policy)   # validates a forced profile name
    # `with use_backend(...)` must not touch the process default, not even until __enter__ (other threads read it)
    prev = None if _called_by_with(sys._getframe(1)) else _set_global(policy)
    return Backend(policy, primary.name, profile.name if profile else None, prev)


def _reset_lock_after_fork() -> None:
    global _global_lock, _serials_lock
    _global_lock = threading.Lock()
    _serials_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)
