"""Per-model runtime state shared by every rewritten module of one converted model: the
dispatch policy its opsadv ops run under.

- an explicit backend at conversion: that policy, always;
- backend "auto": the policy in force at call time (`use_backend` still steers the model), with
  the conversion's overrides (precision, experimental, seed options) applied on top; the derived
  policy is cached per ambient policy so dispatch memoization keeps hitting.

Eager calls enter the policy as a ContextVar scope.  While dynamo traces, a state with a policy of its own enters
a TracedScope instead: the ops' torch.library calls carry the state's id (core.policy.op_scope) and set its
policy at run time, so torch.compile(fullgraph=True) traces a converted model as one graph."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from opsadv.core import policy as _policy
from opsadv.core.policy import NO_SCOPE, PolicyScope, TracedScope

_compiling = torch.compiler.is_compiling
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_exporting = torch.compiler.is_exporting


class RuntimeState:
    """`with state.scope():` runs opsadv ops under the model's policy (a ContextVar set/reset)."""

    def __init__(self, policy=None, overrides: dict | None = None):
        self.policy = policy
        self.overrides = overrides or None
        self.fallbacks: dict[str, int] = {}
        self._derived: dict[int, _policy.Policy] = {}
        self.sid = _policy.register_scope(self)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "sid"}

    def __setstate__(self, state):
        # a copy (deepcopy of the model, pickling) is a scope of its own: its own id, registered here
        self.__dict__.update(state)
        self.sid = _policy.register_scope(self)

    def effective(self) -> "_policy.Policy":
        if self.policy is not None:
            return self.policy
        amb = _policy.current_policy()
        if not self.overrides:
            return amb
        p = self._derived.get(amb.serial)
        if p is None:
            ov = self.overrides
            p = _policy.Policy(backend=amb.backend, strict=amb.strict, profile=amb.profile,
                               experimental=amb.experimental or ov.get("experimental", False),
                               deterministic=amb.deterministic, autotune=amb.autotune,
                               precision=ov.get("precision", amb.precision), impls=amb.impls,
                               timing=ov.get("timing", amb.timing),
                               options=tuple(sorted({**dict(amb.options), **ov.get("options", {})}.items())))
            self._derived[amb.serial] = p
        return p

    def scope(self):
        if self.policy is None and not self.overrides:
            # torch.compile enters only context managers made inside the traced region
            return nullcontext() if _compiling() else NO_SCOPE
        if _dynamo_compiling():
            # the ops carry this state's id (exported programs none: ids do not outlive the process)
            return nullcontext() if _exporting() else TracedScope(self.sid)
        p = self.effective()
        # already in force (a converted module called inside another one's scope): no ContextVar set / reset
        return NO_SCOPE if _policy._scoped.get() is p else PolicyScope(p)

    def note_fallback(self, what: str) -> None:
        """Counts eager calls only: a count written from a compiled graph is an int dynamo guards on, which
        recompiled the graph at every call (then ran it eagerly past the recompile limit)."""
        if not _compiling():
            self.fallbacks[what] = self.fallbacks.get(what, 0) + 1


def scope_of(module):
    st = getattr(module, "_opsadv_state", None)
    if st is not None:
        return st.scope()
    return nullcontext() if _compiling() else NO_SCOPE
