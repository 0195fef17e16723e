"""The Triton kernels every GPU backend shares: portable `@triton.jit` kernels (pointer loads; Hopper TMA paths
that switch themselves off where TMA is missing), their host wrappers and their impl declarations, one folder per
op.  Not a backend: it registers nothing and has no hooks.  The cuda, rocm and jetson backends import it and
declare its impls under their own names and capability checks, so no backend imports another one for its kernels
(only jetson builds on cuda, by design).  Tiles come from ctx.profile, i.e. from the declaring backend's profiles.

Triton is imported by the kernel modules only, never by this package's __init__ (`import opsadv` stays light)."""
from __future__ import annotations

import importlib
import importlib.util
import warnings

# kernel modules (relative to this package), each exposing impls(env) -> list[KernelImpl]
KERNEL_MODULES = ("flash_attention.attention", "sparse_attention.sparse", "gemm.gemm", "norm.norm", "swiglu.swiglu",
                  "rotary_embedding.rotary")


def interpreter_mode(env) -> bool:
    return bool(env.triton_interpret) and importlib.util.find_spec("triton") is not None


def triton_device_types(env) -> tuple[str, ...]:
    """Device types the Triton impls take: cuda, plus cpu in interpreter mode."""
    return ("cuda", "cpu") if interpreter_mode(env) else ("cuda",)


def module_impls(env, modules, who: str) -> list[tuple[str, object]]:
    """(module, impl) for the kernel modules `modules` (full dotted names) that import; a module that fails to
    import is skipped with a warning naming `who`, so one broken kernel module does not take the others down."""
    out = []
    for modname in modules:
        if importlib.util.find_spec(modname) is None:
            continue
        try:
            mod = importlib.import_module(modname)
        except Exception as e:
            warnings.warn(f"opsadv {who}: kernel module {modname} not loaded: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)
            continue
        out += [(modname, impl) for impl in mod.impls(env)]
    return out
