"""The jetson profile: memory-frugal data for the cuda kernels on a Jetson (tiles <= 64x64, <= 2 stages,
fixed configs, no autotune sweep, bounded workspace).  The jetson backend picks it on any Jetson and offers
a copy to the cuda backend, so use_backend("cuda", profile="jetson") forces it on any NVIDIA GPU."""
from __future__ import annotations

import dataclasses

from opsadv.backends.triton_common.profiles import tile as _t
from opsadv.core.kernel import Profile

ATTN_TILES = {   # tiles <= 64x64, <= 2 stages, fixed
    "fwd": {64: [_t(64, 64, 4, 2)], 128: [_t(64, 32, 4, 2)], 256: [_t(32, 32, 4, 1)]},
    "bwd_kv": {64: [_t(32, 64, 4, 2)], 128: [_t(32, 32, 4, 1)], 256: [_t(16, 32, 4, 1)]},
    "bwd_q": {64: [_t(64, 32, 4, 2)], 128: [_t(32, 32, 4, 1)], 256: [_t(32, 16, 4, 1)]},
}

SPARSE_TILES = {"small": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)),
                "large": ((32, 32, 4, 1), (32, 32, 4, 1), (32, 32, 4, 1))}
# (gemm picks its jetson tiles from the shape, <= 64 and <= 2 stages: triton_common gemm.gemm._fixed_config)

JETSON = Profile(
    name="jetson", backend="jetson", tiles={"flash_attention": ATTN_TILES, "sparse_attention": SPARSE_TILES},
    description="memory-frugal: tiles <= 64x64, <= 2 stages, fixed configs, bounded workspace; chosen by the jetson "
                "backend on any Jetson",
    num_stages=2, num_warps=4, autotune=False, workspace_cap_bytes=64 << 20, memory_policy="conservative",
    priority=10, matches=lambda env: env.is_jetson,
)

# offered to the cuda backend: only when forced (use_backend("cuda", profile="jetson")), never matched
FOR_CUDA = dataclasses.replace(JETSON, backend="cuda", priority=0, matches=lambda env: False,
                               description="memory-frugal: tiles <= 64x64, <= 2 stages, fixed configs, bounded "
                                           "workspace")

PROFILES = (JETSON, FOR_CUDA)
