"""The rocm backend (skeleton): AMD GPUs under a ROCm build of torch, which reports them as device type
"cuda" with torch.version.hip set.  It re-registers the cuda backend's portable Triton kernels under its
own ids ("rocm.triton.<op>": plain pointer-load kernels; no cuDNN / cuBLAS paths, no Gluon, no TMA) with
AMD capability checks (gfx arch names from gcnArchName), under its own profile.  Not tuned on AMD
hardware yet: the tiles are conservative first guesses.

Refused, with the reason, on builds without HIP (the cuda backend serves NVIDIA GPUs and refuses ROCm
builds in turn).  Under TRITON_INTERPRET=1 on a ROCm build without a GPU the kernels run on CPU tensors,
as the cuda backend's do.  Implements exactly the hooks a third-party plugin implements."""
from __future__ import annotations

import importlib.util

from opsadv.backends.triton_common import check_seed_options, interpreter_mode
from opsadv.core.tuning import default_timer
from opsadv.registry import BackendInfo, ProbeResult, hookimpl
from opsadv.runtime.memory import apply_memory_policy

from .kernels import ARCHS, impls
from .profiles import PROFILES

NAME = "rocm"
VERSION = "0.1.0"
# AMD targets of Triton's AMD backend: CDNA2 (MI200), CDNA3 (MI300), CDNA4 (MI350), RDNA3 / RDNA4


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="AMD", device_types=("cuda",), version=VERSION, auto_priority=100,
                       description="the cuda backend's portable Triton kernels on AMD GPUs (ROCm builds of torch)")


@hookimpl
def opsadv_probe(env):
    if not env.hip_version:
        return ProbeResult(False, ("torch is not a ROCm build (torch.version.hip is None"
                                   + (f"; CUDA {env.cuda_version}" if env.cuda_version else "")
                                   + "): the rocm backend needs PyTorch's ROCm wheels and an AMD GPU",))
    if importlib.util.find_spec("triton") is None:
        return ProbeResult(False, (f"ROCm build (HIP {env.hip_version}), but triton is not installed "
                                   "(pytorch-triton-rocm): the rocm backend has Triton kernels only",))
    if env.device_type != "cuda":
        if interpreter_mode(env):
            return ProbeResult(True, (f"ROCm build (HIP {env.hip_version}); interpreter mode: TRITON_INTERPRET=1, "
                                      "Triton kernels run on CPU tensors",), {"interpreter": True})
        return ProbeResult(False, (f"ROCm build (HIP {env.hip_version}), but torch sees no AMD GPU",))
    caps = dict(arch=env.arch, gcn_arch_name=env.gpu_arch, compute_units=env.sm_count, hip=env.hip_version,
                total_memory=env.total_memory)
    notes = [f"{env.device_name or 'AMD GPU'} ({env.arch or 'arch unknown'}), HIP {env.hip_version}"]
    if env.arch not in ARCHS:
        notes.append(f"arch {env.arch or 'unknown'} is not one the rocm impls declare ({', '.join(ARCHS)}): "
                     "they refuse it, calls fall back to the reference backend")
    return ProbeResult(True, tuple(notes), caps)


@hookimpl
def opsadv_register_kernels(registry, env):
    for impl in impls(env):
        registry.add(impl)


@hookimpl
def opsadv_profiles():
    return list(PROFILES)


@hookimpl
def opsadv_device_timer(device_type):
    # ROCm drives AMD GPUs through torch.cuda (HIP streams and events); Triton's do_bench works there
    return default_timer("cuda") if device_type == "cuda" else None


@hookimpl
def opsadv_activate(options, env):
    out = check_seed_options(dict(options), NAME)
    if out.get("mem_opt") is not None and env.device_type == "cuda":
        apply_memory_policy(out["mem_opt"])
    return out
