"""The CUDA backend: Triton kernels (plus vendor kernels through torch) for NVIDIA GPUs, with
profiles `a100`, `h100`, `rtx` (and `jetson`, the memory-frugal one, which can be forced).

Implements exactly the hooks a third-party plugin implements.  Triton is imported only when
kernels are registered, never at `import opsadv`.  Under TRITON_INTERPRET=1 the Triton impls
also accept CPU tensors ("interpreter mode"), so CI runs the real kernel code without a GPU.

Kernel modules: each module in KERNEL_MODULES exposes `impls(env) -> list[KernelImpl]`."""
from __future__ import annotations

import importlib
import importlib.util

from opsadv.registry import BackendInfo, ProbeResult, hookimpl

NAME = "cuda"
VERSION = "0.1.0"
KERNEL_MODULES = ("attention", "sdpa", "gemm", "norm", "aten_norm", "sparse")


def interpreter_mode(env) -> bool:
    return bool(env.triton_interpret) and importlib.util.find_spec("triton") is not None


def triton_device_types(env) -> tuple[str, ...]:
    """Device types the Triton impls take: cuda, plus cpu in interpreter mode."""
    return ("cuda", "cpu") if interpreter_mode(env) else ("cuda",)


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="NVIDIA", device_types=("cuda",), version=VERSION, auto_priority=100,
                       description="Triton + cuDNN/cuBLAS kernels for NVIDIA GPUs")


@hookimpl
def opsadv_probe(env):
    reasons: list[str] = []
    caps: dict = {}
    has_triton = importlib.util.find_spec("triton") is not None
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
    from .profiles import PROFILES
    return list(PROFILES)
