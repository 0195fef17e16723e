"""The plugin registry as core sees it.  opsadv.registry depends on core; core never imports it:
the registry installs its getter here and reports each rebuild, and core code (dispatch, policy,
info) reads registry facts through `get_registry()`.  `import opsadv` installs it."""
from __future__ import annotations

from typing import Any, Callable

_get_registry: Callable[[], Any] | None = None
_on_reset: list[Callable[[], None]] = []


def install_registry(get: Callable[[], Any]) -> None:
    """Called by opsadv.registry at import: `get()` returns the (lazily loaded) plugin registry."""
    global _get_registry
    _get_registry = get


def get_registry() -> Any:
    """The loaded plugin registry (opsadv.registry.Registry)."""
    if _get_registry is None:
        raise RuntimeError("no opsadv plugin registry is installed (`import opsadv` installs opsadv.registry)")
    return _get_registry()


def on_registry_reset(fn: Callable[[], None]) -> None:
    """Run fn() after every rebuild of the registry (dispatch empties its memo)."""
    _on_reset.append(fn)


def registry_reset() -> None:
    """Called by opsadv.registry after it rebuilt the registry."""
    for fn in tuple(_on_reset):
        fn()
