"""The jetson backend: NVIDIA Jetson (Xavier, Orin, Thor) — an integrated GPU whose memory is the
CPU's.  It runs the cuda backend's kernels under the memory-frugal "jetson" profile (tiles <= 64x64,
<= 2 stages, fixed configs, no autotune sweep, bounded workspace: ops above the cap run chunked),
plus a query-chunked math attention for what the Triton kernels cannot serve (e.g. Xavier).

    opsadv.use_backend("jetson", memory_budget="3GiB", mem_opt="balanced")

Detection needs a Tegra marker (/etc/nv_tegra_release or a tegra device-tree compatible) besides
the integrated GPU / compute capability (7.2, 8.7, 11.0): an integrated GPU alone (DGX Spark) is
not a Jetson.  Implements exactly the hooks a third-party plugin implements."""
from __future__ import annotations

import warnings

from opsadv.backends.triton_common import check_seed_options, interpreter_mode
from opsadv.core.errors import UnknownOptionError
from opsadv.registry import BackendInfo, ProbeResult, hookimpl
from opsadv.runtime.memory import apply_memory_policy, parse_bytes, parse_level

from .detect import compute_dtype, generation, has_bf16, l4t_version, not_jetson_reasons
from .kernels import impls
from .profiles import PROFILES

NAME = "jetson"
VERSION = "0.1.0"
OPTIONS = ("memory_budget", "mem_opt", "tile_size", "max_streams")


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="NVIDIA", device_types=("cuda",), version=VERSION, auto_priority=120,
                       description="cuda kernels under a memory-frugal profile for Jetson (unified memory)")


@hookimpl
def opsadv_probe(env):
    if not env.is_jetson:
        return ProbeResult(False, tuple(not_jetson_reasons(env)) or ("not a Jetson",))
    gen = generation(env)
    caps = dict(generation=gen, l4t=l4t_version(env), compute_capability=env.compute_capability,
                bf16=has_bf16(env), compute_dtype=compute_dtype(env), mem_available=env.mem_available,
                unified_memory=True, model=env.device_tree_model)
    what = f"Jetson {gen} ({env.device_tree_model or env.device_name or 'unknown model'})"
    if env.device_type != "cuda":
        if interpreter_mode(env):
            return ProbeResult(True, (f"{what}; interpreter mode: TRITON_INTERPRET=1, kernels run on CPU tensors",),
                               caps)
        return ProbeResult(False, (f"{what} detected, but torch sees no CUDA device (a CPU build of torch? "
                                   "install NVIDIA's JetPack torch wheel)",), caps)
    notes = [f"{what}, cc {env.compute_capability[0]}.{env.compute_capability[1]}"
             + (f", L4T {caps['l4t']}" if caps["l4t"] else "")]
    if not has_bf16(env):
        notes.append("no bfloat16 on this part: models run in float16")
    if env.mem_available is not None:
        notes.append(f"MemAvailable {env.mem_available / 2 ** 30:.1f} GiB (memory shared with the CPU)")
    return ProbeResult(True, tuple(notes), caps)


@hookimpl
def opsadv_register_kernels(registry, env):
    for impl in impls(env):
        registry.add(impl)


@hookimpl
def opsadv_profiles():
    return list(PROFILES)               # its own, and the copy it offers the cuda backend


@hookimpl
def opsadv_activate(options, env):
    """memory_budget: bytes, "3GiB", "60%" (of MemAvailable); default MemAvailable.
    mem_opt: 0-3 or "off"|"conservative"|"balanced"|"aggressive": applied to the allocator now."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise UnknownOptionError("use_backend", unknown[0], f"an option of backend 'jetson': {list(OPTIONS)} "
                                 "(or a policy option)", repr(options[unknown[0]]))
    out: dict = {}
    if options.get("memory_budget") is not None:
        budget = parse_bytes(options["memory_budget"], op="use_backend", available=env.mem_available)
        if env.mem_available is not None and budget > env.mem_available:
            warnings.warn(f"opsadv jetson: memory_budget {budget / 2 ** 20:.0f} MiB exceeds MemAvailable "
                          f"{env.mem_available / 2 ** 20:.0f} MiB", RuntimeWarning, stacklevel=4)
        out.update(memory_budget=budget, memory_budget_source="use_backend(memory_budget=...)")
    elif env.mem_available is not None:
        out.update(memory_budget=env.mem_available, memory_budget_source="/proc/meminfo MemAvailable")
    out.update(check_seed_options({k: options.get(k) for k in ("tile_size", "max_streams")}, NAME))
    if options.get("mem_opt") is not None:
        level = parse_level(options["mem_opt"], op="use_backend", arg="mem_opt")
        out["mem_opt"] = level
        if env.device_type == "cuda":
            apply_memory_policy(level, memory_budget=out.get("memory_budget"))
    return out


__all__ = ["opsadv_backend_info", "opsadv_probe", "opsadv_register_kernels", "opsadv_profiles", "opsadv_activate",
           "generation", "compute_dtype"]
