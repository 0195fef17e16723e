"""when_imported(target, callback): run callback right after module `target` has been imported (at once where it
already is), without importing it: a one-shot meta-path finder wraps the real loader.  `import opsadv` uses it
to register with transformers and with DTensor only once those load."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


class _Loader(importlib.abc.Loader):
    """The real loader of the target, then the callback."""

    def __init__(self, loader, callback: Callable[[], None]):
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.callback()

    def __getattr__(self, name):             # get_source, get_code, is_package ... of the real loader
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, callback: Callable[[], None]):
        self.target, self.callback = target, callback

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)           # one shot; the other finders locate the real module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, self.callback)
        return spec


def when_imported(target: str, callback: Callable[[], None]) -> None:
    if target in sys.modules:
        callback()
    elif not any(isinstance(f, _Finder) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(target, callback))
