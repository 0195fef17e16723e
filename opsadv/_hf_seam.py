"""`attn_implementation="opsadv"` in transformers without calling anything first: opsadv's attention and mask
functions are registered with transformers' AttentionInterface / AttentionMaskInterface as soon as transformers'
modeling code is loaded (or at once, where it already is).  `import opsadv` never imports transformers: a
one-shot import hook waits for `transformers.modeling_utils` and registers right after it has run."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

TARGET = "transformers.modeling_utils"


def _register() -> None:
    try:
        from opsadv.convert import hf_attention
        hf_attention.register()
    except Exception as e:      # noqa: BLE001 - a transformers we cannot serve must not break its import
        warnings.warn(f"opsadv: could not register attn_implementation='opsadv' with transformers: "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)


class _Loader(importlib.abc.Loader):
    """The real loader of transformers.modeling_utils, then the registration."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name):             # get_source, get_code, is_package ... of the real loader
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)           # one shot; the other finders locate the real module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path) and importlib.util.find_spec("transformers"):
        sys.meta_path.insert(0, _Finder())
