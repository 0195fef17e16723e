"""rocm profiles: data for the cuda backend's Triton kernels on AMD GPUs.  Tiles are first guesses for
64 KB of LDS per compute unit and 64-wide wavefronts (no TMA configs: AMD has none); not measured yet."""
from __future__ import annotations

from opsadv.backends.triton_common.profiles import interpreter_profile, tile as _t
from opsadv.core.kernel import Profile

ATTN_TILES = {
    "fwd": {64: [_t(128, 64, 4, 1), _t(64, 64, 4, 1), _t(128, 64, 4, 2)],
            128: [_t(128, 64, 4, 1), _t(64, 64, 4, 1), _t(128, 32, 4, 1)],
            256: [_t(64, 32, 4, 1), _t(32, 32, 4, 1)]},
    "bwd_kv": {64: [_t(64, 64, 4, 1), _t(32, 64, 4, 1)], 128: [_t(32, 64, 4, 1), _t(32, 32, 4, 1)],
               256: [_t(16, 32, 4, 1)]},
    "bwd_q": {64: [_t(64, 64, 4, 1), _t(64, 32, 4, 1)], 128: [_t(64, 32, 4, 1), _t(32, 32, 4, 1)],
              256: [_t(32, 16, 4, 1)]},
}


def _amd(env) -> bool:
    return env.device_type == "cuda" and env.runtime == "hip"


ROCM = Profile(
    name="rocm", backend="rocm", tiles={"flash_attention": ATTN_TILES},
    description="AMD GPUs (CDNA / RDNA): no TMA, 1-2 stages, 64 KB LDS per CU; untuned first guesses",
    num_stages=1, num_warps=4, priority=10, matches=_amd,
)
ROCM_INTERPRETER = interpreter_profile("rocm")

PROFILES = (ROCM, ROCM_INTERPRETER)
