"""The CUDA backend: Triton kernels (plus vendor kernels through torch) for NVIDIA GPUs, with
profiles `a100`, `h100`, `rtx` (and `jetson`, the memory-frugal one the jetson backend offers, which can
be forced).  ROCm builds of torch (AMD GPUs, also device type "cuda") are refused: the rocm backend
serves them with the shared Triton kernels (opsadv/backends/triton_common).

Implements exactly the hooks a third-party plugin implements.  Triton is imported only when
kernels are registered, never at `import opsadv`.  Under TRITON_INTERPRET=1 the Triton impls
also accept CPU tensors ("interpreter mode"), so CI runs the real kernel code without a GPU.

Kernel modules: each module in KERNEL_MODULES exposes `impls(env) -> list[KernelImpl]`: the shared Triton
kernels' modules (triton_common.KERNEL_MODULES, declared for "cuda") and this backend's own (OWN_MODULES), each
op folder listing its modules in IMPL_MODULES (docs/backends/cuda.md)."""
from __future__ import annotations

import importlib
import importlib.util

from opsadv.core.tuning import default_timer
from opsadv.registry import BackendInfo, ProbeResult, hookimpl
from opsadv.runtime.memory import apply_memory_policy

from opsadv.backends import triton_common
from opsadv.backends.triton_common import check_seed_options, interpreter_mode

from .profiles import PROFILES

NAME = "cuda"
VERSION = "0.1.0"
# kernel modules, full dotted names: the shared Triton kernels, then this backend's own (each op folder lists its
# own in IMPL_MODULES)
OWN_MODULES = triton_common.folder_modules(__name__, __path__)
KERNEL_MODULES = triton_common.KERNEL_MODULES + OWN_MODULES


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
    for modname in KERNEL_MODULES:
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


@hookimpl
def opsadv_activate(options, env):
    out = check_seed_options(dict(options), NAME)
    if out.get("mem_opt") is not None and env.device_type == "cuda":
        apply_memory_policy(out["mem_opt"])
    return out
