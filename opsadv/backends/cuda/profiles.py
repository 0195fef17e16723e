"""CUDA profiles: data keyed on device properties read at run time (shared memory per block,
SM count, L2), not on names alone.  Kernels read their tiles from ctx.profile."""
from __future__ import annotations

from opsadv.core.kernel import Profile


def _cc(env):
    return env.compute_capability or (0, 0)


def _smem(env) -> int:
    return env.shared_memory_per_block_optin or 0


H100 = Profile(
    name="h100", backend="cuda", description="Hopper (cc 9.x, ~227 KB smem/block): TMA, wgmma, deep pipelines",
    num_stages=3, num_warps=8, priority=30,
    matches=lambda env: env.device_type == "cuda" and _cc(env)[0] == 9 and _smem(env) >= 200 * 1024,
)
A100 = Profile(
    name="a100", backend="cuda", description="Ampere datacenter (cc 8.0, ~163 KB smem/block)",
    num_stages=3, num_warps=4, priority=20,
    matches=lambda env: env.device_type == "cuda" and _cc(env) == (8, 0) and _smem(env) >= 160 * 1024,
)
RTX = Profile(
    name="rtx", backend="cuda", description="consumer / workstation parts (cc 8.6/8.9, ~99 KB smem/block)",
    num_stages=2, num_warps=4, priority=10,
    matches=lambda env: env.device_type == "cuda" and _cc(env) >= (7, 5),
)
INTERPRETER = Profile(
    name="interpreter", backend="cuda", description="TRITON_INTERPRET=1 on CPU: small fixed tiles, no autotune",
    num_stages=1, num_warps=4, autotune=False, priority=5,
    matches=lambda env: env.device_type != "cuda" and env.triton_interpret,
)
JETSON = Profile(
    name="jetson", backend="cuda", description="memory-frugal: tiles <= 64x64, <= 2 stages, fixed configs, bounded workspace",
    num_stages=2, num_warps=4, autotune=False, workspace_cap_bytes=64 << 20, memory_policy="conservative",
    priority=0, matches=lambda env: False,   # only when forced (use_backend("cuda", profile="jetson")) or by the jetson backend
)

PROFILES = (H100, A100, RTX, INTERPRETER, JETSON)
