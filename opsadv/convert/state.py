"""Per-model runtime state shared by every rewritten module of one converted model: the
dispatch policy its opsadv ops run under.

- an explicit backend at conversion: that policy, always;
- backend "auto": the policy in force at call time (`use_backend` still steers the model), with
  the conversion's overrides (precision, experimental, seed options) applied on top; the derived
  policy is cached per ambient policy so dispatch memoization keeps hitting."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from opsadv.core import policy as _policy

_compiling = torch.compiler.is_compiling


class _NoScope:
    """The scope of a model that runs under the ambient policy: one shared no-op context (every converted
    module enters one per op call; a fresh contextlib.nullcontext() per call cost ~0.1 us more)."""
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


NO_SCOPE = _NoScope()


class _Scope:
    __slots__ = ("policy", "token")

    def __init__(self, policy):
        self.policy = policy

    def __enter__(self):
        self.token = _policy._scoped.set(self.policy)

    def __exit__(self, *exc):
        _policy._scoped.reset(self.token)


class RuntimeState:
    """`with state.scope():` runs opsadv ops under the model's policy (a ContextVar set/reset)."""

    def __init__(self, policy=None, overrides: dict | None = None):
        self.policy = policy
        self.overrides = overrides or None
        self.fallbacks: dict[str, int] = {}
        self._derived: dict[int, _policy.Policy] = {}

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
        p = self.effective()
        # already in force (a converted module called inside another one's scope): no ContextVar set / reset
        return NO_SCOPE if _policy._scoped.get() is p else _Scope(p)

    def note_fallback(self, what: str) -> None:
        self.fallbacks[what] = self.fallbacks.get(what, 0) + 1


def scope_of(module):
    st = getattr(module, "_opsadv_state", None)
    if st is not None:
        return st.scope()
    return nullcontext() if _compiling() else NO_SCOPE
