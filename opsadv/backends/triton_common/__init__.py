"""The Triton kernels every GPU backend shares: portable `@triton.jit` kernels (pointer loads; Hopper TMA paths
that switch themselves off where TMA is missing), their host wrappers and their impl declarations, one folder per
op.  Not a backend: it registers nothing and has no hooks.  The cuda, rocm and jetson backends import it and
declare its impls under their own names and capability checks, so no backend imports another one for its kernels
(only jetson builds on cuda, by design).  Tiles come from ctx.profile, i.e. from the declaring backend's profiles.

Triton is imported by the kernel modules only, never by this package's __init__ (`import opsadv` stays light)."""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import warnings

import torch

from opsadv.core.envvars import env_bool
from opsadv.core.errors import InvalidArgumentError, UnknownOptionError
from opsadv.runtime.memory import parse_level



def folder_modules(package: str, path) -> tuple[str, ...]:
    """The kernel modules of a package's op folders, full dotted names: each subpackage (one per op) lists the
    modules of its own that declare impls in IMPL_MODULES; a folder without it (common/) has none.  Importing an
    op folder's __init__ imports no kernel (Triton stays unloaded until the modules are)."""
    out: list[str] = []
    for info in pkgutil.iter_modules(path):
        if info.ispkg:
            folder = importlib.import_module(f"{package}.{info.name}")
            out += [f"{folder.__name__}.{m}" for m in getattr(folder, "IMPL_MODULES", ())]
    return tuple(out)


def interpreter_mode(env) -> bool:
    return bool(env.triton_interpret) and importlib.util.find_spec("triton") is not None


def triton_device_types(env) -> tuple[str, ...]:
    """Device types the Triton impls take: cuda, plus cpu in interpreter mode."""
    return ("cuda", "cpu") if interpreter_mode(env) else ("cuda",)


INTERPRETER_BF16_REASON = ("bfloat16 is not exact in the Triton interpreter (its bf16 tl.dot is wrong); "
                           "use fp16 on CPU, or run on a GPU")


def interpreter_bf16_reasons(spec, compute_dtype=None) -> list[str]:
    """The refusal every tl.dot-based Triton impl gives a CPU (interpreter) call computing in bfloat16:
    triton 3.6's interpreter returns garbage for bf16 dots.  compute_dtype: the dtype the kernel's dots run
    in when a precision policy changes it (float32 inputs under precision='bf16'); else the inputs' dtype."""
    cdt = compute_dtype or spec.dtype
    return [INTERPRETER_BF16_REASON] if spec.device_type == "cpu" and cdt == torch.bfloat16 else []


def poisoned(shape, like: torch.Tensor) -> torch.Tensor:
    """Output buffer; on CPU (interpreter mode, tests) and under OPSADV_POISON_OUTPUTS=1 (GPU probes)
    pre-filled with NaN so an unwritten element shows."""
    if like.device.type == "cpu" or env_bool("OPSADV_POISON_OUTPUTS"):
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def module_impls(env, modules, who: str, backend: str | None = None) -> list[tuple[str, object]]:
    """(module, impl) for the kernel modules `modules` (full dotted names) that import, their impls declared for
    `backend` when given (this package's modules take it); a module that fails to import is skipped with a warning
    naming `who`, so one broken kernel module does not take the others down."""
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
        out += [(modname, impl) for impl in (mod.impls(env) if backend is None else mod.impls(env, backend))]
    return out


# the seed options a backend running these kernels takes (use_backend(backend, **options))
OPTIONS = ("tile_size", "max_streams", "mem_opt", "workspace_cap")


def check_seed_options(options: dict, backend: str) -> dict:
    """The seed's options as use_backend takes them: tile_size (power of two 32-256: caps the
    Triton tiles of the profile), max_streams (1-8: the default of opsadv.runtime.run_batched),
    mem_opt (0-3 or a level name: the memory policy, applied to the allocator now); workspace_cap (bytes, an int
    >= 0: the most a kernel may allocate as scratch, e.g. the flash backward's dS workspace; 0 turns such
    variants off)."""
    out: dict = {}
    for name, value in options.items():
        if value is None:
            continue
        if name == "tile_size":
            if (isinstance(value, bool) or not isinstance(value, int) or not 32 <= value <= 256
                    or value & (value - 1)):
                raise InvalidArgumentError("use_backend", "tile_size", "a power of two in [32, 256]", repr(value))
        elif name == "max_streams":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
                raise InvalidArgumentError("use_backend", "max_streams", "an int in [1, 8]", repr(value))
        elif name == "workspace_cap":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError("use_backend", "workspace_cap", "an int >= 0 (bytes)", repr(value))
        elif name == "mem_opt":
            value = parse_level(value, op="use_backend", arg="mem_opt")
        else:
            raise UnknownOptionError("use_backend", name, f"an option of backend {backend!r}: {list(OPTIONS)} "
                                     "(or a policy option)", repr(value))
        out[name] = value
    return out


# this package's kernel modules, each exposing impls(env, backend="cuda") -> list[KernelImpl]: its impls declared
# for `backend` (ids "<backend>.triton.<...>", NVIDIA compute-capability checks; another backend replaces those)
KERNEL_MODULES = folder_modules(__name__, __path__)
