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

# first guesses: the cuda backend's rtx tables (about 100 KB of shared memory, which 64 KB of LDS does not hold for
# every entry: the autotuner drops what does not compile)
GEMM_CONFIGS = {"gemm": [(128, 128, 32, 4, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 64, 32, 4, 4)],
                "swiglu": [(64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (64, 64, 32, 4, 4)],
                "small": [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (32, 64, 64, 4, 3)]}
SPARSE_TILES = {"small": ((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2)),
                "large": ((64, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 1))}


def _amd(env) -> bool:
    return env.device_type == "cuda" and env.runtime == "hip"


ROCM = Profile(
    name="rocm", backend="rocm",
    tiles={"flash_attention": ATTN_TILES, "gemm": GEMM_CONFIGS, "sparse_attention": SPARSE_TILES},
    description="AMD GPUs (CDNA / RDNA): no TMA, 1-2 stages, 64 KB LDS per CU; untuned first guesses",
    num_stages=1, num_warps=4, priority=10, matches=_amd,
)
ROCM_INTERPRETER = interpreter_profile("rocm")

PROFILES = (ROCM, ROCM_INTERPRETER)
