"""opsadv: fused LLM operators behind one operator IR, dispatched at run time to the best kernel
of a backend plugin, with an answer to "which kernel ran, and why".

    import opsadv
    opsadv.use_backend("auto")
    o = opsadv.ops.flash_attention(q, k, v, causal=True)
    print(opsadv.explain("flash_attention", q, k, v, causal=True))
"""
from __future__ import annotations

from . import registry as _registry  # noqa: E402,F401  (installs the plugin registry into core.hooks)
from . import errors, ops  # noqa: E402  (registers the torch.library ops)
from .core.dispatch import Trace as _Trace  # noqa: E402
from .core.env import EnvInfo, detect  # noqa: E402
from .core.explain import explain  # noqa: E402
from .core.info import info  # noqa: E402
from .core.version import __version__  # noqa: E402
from . import _hf_seam  # noqa: E402
from . import distributed as _distributed  # noqa: E402
from .core.kernel import CallSpec, KernelImpl, Profile, ResolveContext  # noqa: E402
from .ops.sparse_attention import layout as _layout  # noqa: E402
from .ops.sparse_attention.layout import SparseLayout  # noqa: E402
from .core.policy import Backend, current_policy, use_backend  # noqa: E402
from .core.precision import PrecisionPolicy  # noqa: E402


def trace(all_threads: bool = False) -> _Trace:
    """`with opsadv.trace() as t:` counts this thread's (async context's) op calls per impl; print(t) or
    t.counts.  all_threads=True: every thread's calls, process-wide."""
    return _Trace(all_threads)


def __getattr__(name: str):
    # Heavier, optional parts load on first use so `import opsadv` stays light.
    if name in ("convert_model", "Optimizer", "load"):
        from . import convert
        return getattr(convert, name)
    if name == "PagedKVCache":                   # imports transformers: only when asked for
        from .convert.paged_cache import PagedKVCache
        return PagedKVCache
    if name == "runtime":
        import importlib
        return importlib.import_module("opsadv.runtime")
    if name == "layouts":
        return _layout
    raise AttributeError(f"module 'opsadv' has no attribute {name!r}")


__all__ = ["use_backend", "ops", "explain", "info", "detect", "trace", "EnvInfo", "KernelImpl", "Profile",
           "CallSpec", "ResolveContext", "SparseLayout", "Backend", "PrecisionPolicy", "current_policy",
           "errors", "convert_model", "Optimizer", "load", "PagedKVCache", "__version__"]

_hf_seam.install()      # attn_implementation="opsadv" in transformers, once its modeling code loads
_distributed.install()  # the ops' DTensor sharding rules, once torch.distributed.tensor loads
