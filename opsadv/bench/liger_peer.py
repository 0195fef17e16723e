"""Liger-Kernel as a bench peer, isolated from the models it does not patch.

`apply_liger_kernel_to_<arch>(model=m)` patches the instance m, and also module-level names of the
transformers modeling module (the rotary function, the norm and MLP classes) that every model of the
architecture reads at call time: the unconverted peer in the same process would run Liger code.  So the
names are snapshotted before the apply function runs, what it replaced is put back at once, and the Liger
peer's calls run inside `with patch:` (SwappedGlobals), which swaps the Liger values in for the call and
the originals back afterwards (a few setattr per call).  Names the apply function added stay (imports)."""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterable

_MISSING = object()


def namespaces_of(model) -> list:
    """The module and class namespaces an apply function may patch for `model`: the modules defining the
    classes of its submodules (the modeling module), those classes, transformers' loss module and
    torch.nn.functional."""
    out: list = []
    seen: set = set()

    def add(ns):
        if ns is not None and id(ns) not in seen:
            seen.add(id(ns))
            out.append(ns)

    for m in model.modules():
        for cls in type(m).__mro__:
            if cls.__module__.startswith(("torch.", "builtins")):
                continue
            add(sys.modules.get(cls.__module__))
            add(cls)
    for name in ("transformers.loss.loss_utils", "torch.nn.functional"):
        add(sys.modules.get(name))
    return out


class SwappedGlobals:
    """`with patch:` sets each changed name to its patched value; leaving restores the original."""

    def __init__(self, changes: list[tuple[Any, str, Any, Any]]):
        self.changes = changes        # (namespace, name, original, patched)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def names(self) -> list[str]:
        return [f"{getattr(ns, '__name__', ns)}.{n}" for ns, n, _, _ in self.changes]

    @staticmethod
    def _set(ns, name, value) -> None:
        if value is _MISSING:
            if name in vars(ns):
                delattr(ns, name)
        else:
            setattr(ns, name, value)

    def __enter__(self):
        for ns, name, _, new in self.changes:
            self._set(ns, name, new)
        return self

    def __exit__(self, *exc) -> None:
        for ns, name, old, _ in reversed(self.changes):
            self._set(ns, name, old)


def apply_isolated(apply: Callable[..., Any], model, namespaces: Iterable | None = None, **kw) -> SwappedGlobals:
    """Run apply(model=model, **kw); put back every name of `namespaces` (default namespaces_of(model)) that it
    replaced or removed and return those changes as a SwappedGlobals for the patched model's calls.  Where
    apply raises, whatever it changed is put back before the exception propagates."""
    spaces = list(namespaces if namespaces is not None else namespaces_of(model))
    before = [(ns, dict(vars(ns))) for ns in spaces]
    try:
        apply(model=model, **kw)
    finally:
        changes = []
        for ns, old in before:
            now = vars(ns)
            for name, value in old.items():
                new = now.get(name, _MISSING)
                if new is not value:
                    changes.append((ns, name, value, new))
        patch = SwappedGlobals(changes)
        patch.__exit__(None, None, None)       # the originals back, outside the Liger peer's calls
    return patch


def liger_apply_fn(name: str):
    """liger_kernel.transformers' apply function `name` (ImportError / AttributeError where Liger or the
    function is missing)."""
    import liger_kernel.transformers as lt
    fn = getattr(lt, name, None)
    if fn is None:
        from liger_kernel.transformers import monkey_patch
        fn = getattr(monkey_patch, name)
    return fn

