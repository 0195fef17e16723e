"""Per-model runtime state shared by every rewritten module of one converted model: the
dispatch policy its opsadv ops run under (None = whatever policy is in force at call time)."""
from __future__ import annotations

from contextlib import nullcontext

from opsadv.core import policy as _policy


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

    def __init__(self, policy=None):
        self.policy = policy
        self.fallbacks: dict[str, int] = {}

    def scope(self):
        return nullcontext() if self.policy is None else _Scope(self.policy)

    def note_fallback(self, what: str) -> None:
        self.fallbacks[what] = self.fallbacks.get(what, 0) + 1


def scope_of(module):
    st = getattr(module, "_opsadv_state", None)
    return st.scope() if st is not None else nullcontext()
