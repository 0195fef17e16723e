"""The CUDA backend: Triton kernels (plus vendor kernels through torch) for NVIDIA GPUs, with
profiles `a100`, `h100`, `rtx` (and `jetson`, the memory-frugal one the jetson backend offers, which can
be forced).  ROCm builds of torch (AMD GPUs, also device type "cuda") are refused: the rocm backend
serves them with the portable Triton kernels of this package.

Implements exactly the hooks a third-party plugin implements.  Triton is imported only when
kernels are registered, never at `import opsadv`.  Under TRITON_INTERPRET=1 the Triton impls
also accept CPU tensors ("interpreter mode"), so CI runs the real kernel code without a GPU.

Kernel modules: each module in KERNEL_MODULES exposes `impls(env) -> list[KernelImpl]`."""
from __future__ import annotations

import importlib
import importlib.util
import warnings

import torch

from opsadv.core.errors import InvalidArgumentError, UnknownOptionError
from opsadv.core.tuning import default_timer
from opsadv.registry import BackendInfo, ProbeResult, hookimpl
from opsadv.runtime.memory import apply_memory_policy, parse_level

from .profiles import PROFILES

NAME = "cuda"
VERSION = "0.1.0"
KERNEL_MODULES = ("attention", "gluon_attention", "sdpa", "gemm", "norm", "aten_norm", "sparse", "gluon_sparse",
                  "gluon_gemm", "gluon_swiglu_gemm", "swiglu", "rotary")


def interpreter_mode(env) -> bool:
    return bool(env.triton_interpret) and importlib.util.find_spec("triton") is not None


def kernel_module_impls(env, names, who: str) -> list[tuple[str, object]]:
    """(module, impl) for the cuda kernel modules `names` that import, for backends that re-declare cuda's impls
    (jetson, rocm); a module that fails to import is skipped with a warning naming `who`, so one broken kernel
    module does not take the others down."""
    out = []
    for name in names:
        modname = f"{__name__}.{name}"
        if importlib.util.find_spec(modname) is None:
            continue
        try:
            mod = importlib.import_module(modname)
        except Exception as e:
            warnings.warn(f"opsadv {who}: cuda kernel module {name} not loaded: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)
            continue
        out += [(name, impl) for impl in mod.impls(env)]
    return out


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


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="NVIDIA", device_types=("cuda",), version=VERSION, auto_priority=100,
                       description="Triton + cuDNN/cuBLAS kernels for NVIDIA GPUs")


@hookimpl
def opsadv_probe(env):
    reasons: list[str] = []
    caps: dict = {}
    has_triton = importlib.util.find_spec("triton") is not None
    if env.hip_version:     # ROCm reports AMD GPUs as device type "cuda": cuDNN/cuBLAS/Gluon/TMA impls do not apply
        where = f", {env.device_name or 'AMD GPU'} {env.arch or ''}".rstrip() if env.device_type == "cuda" else ""
        return ProbeResult(False, (f"torch is a ROCm build (HIP {env.hip_version}{where}): NVIDIA only; "
                                   "the 'rocm' backend serves AMD GPUs",))
    if env.device_type == "cuda":
        if env.is_jetson:
            return ProbeResult(False, ("this is a Jetson (Tegra integrated GPU): the 'jetson' backend serves it",))
        caps.update(compute_capability=env.compute_capability, sm_count=env.sm_count,
                    shared_memory_per_block_optin=env.shared_memory_per_block_optin, l2_cache_size=env.l2_cache_size)
        if not has_triton:
            reasons.append("triton is not installed: only the vendor (SDPA/cuBLAS) impls are registered")
        return ProbeResult(True, tuple(reasons) or (f"{env.device_name} (cc {env.compute_capability})",), caps)
    if interpreter_mode(env):
        return ProbeResult(True, ("interpreter mode: TRITON_INTERPRET=1, Triton kernels run on CPU tensors",),
                           {"interpreter": True})
    reasons.append("no CUDA device visible to torch" + ("" if env.cuda_version else " (torch is a CPU build)"))
    if not has_triton:
        reasons.append("triton is not installed")
    return ProbeResult(False, tuple(reasons), caps)


@hookimpl
def opsadv_register_kernels(registry, env):
    for name in KERNEL_MODULES:
        modname = f"{__name__}.{name}"
        if importlib.util.find_spec(modname) is None:
            continue
        for impl in importlib.import_module(modname).impls(env):
            registry.add(impl)


@hookimpl
def opsadv_profiles():
    return list(PROFILES)


@hookimpl
def opsadv_device_timer(device_type):
    return default_timer("cuda") if device_type == "cuda" else None


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


@hookimpl
def opsadv_activate(options, env):
    out = check_seed_options(dict(options), NAME)
    if out.get("mem_opt") is not None and env.device_type == "cuda":
        apply_memory_policy(out["mem_opt"])
    return out
