"""Profile data the shared Triton kernels need whatever the backend: the tile-config constructor and the
interpreter profile (TRITON_INTERPRET=1 on CPU tensors: small fixed tiles, no autotune), which every backend
running these kernels offers under its own name.  Each backend's hardware tables live in its own profiles.py."""
from __future__ import annotations

from opsadv.core.kernel import Profile


def tile(bm, bn, w, s, tma=False, **flags) -> dict:
    """One tile config; flags switch on forward kernel variants (flash_attention.attention._FWD_FLAGS, e.g. WS=True)."""
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "TMA": tma, **flags}


# kernels key their smallest tiles on the profile name "interpreter": the interpreter's cost is per element
INTERPRETER_TILES = {
    "flash_attention": {p: {c: [tile(16, 16, 4, 1)] for c in (64, 128, 256)}
                        for p in ("fwd", "bwd_kv", "bwd_q", "bwd_dsq")},
    "sparse_attention": {"small": ((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1)),
                         "large": ((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1))},
    # an FP8 dot's K is at least 32: BLOCK_N (P V's K) 32 (the backward's only FP8 dot, QK^T, has K = head dim)
    "fp8_attention": {p: {c: [tile(16, 32, 4, 1)] for c in (64, 128, 256)} for p in ("fwd", "bwd_kv", "bwd_q")},
}   # (gemm picks its interpreter tiles from the shape: gemm.gemm._fixed_config)


def interpreter_profile(backend: str) -> Profile:
    return Profile(
        name="interpreter", backend=backend, tiles=dict(INTERPRETER_TILES),
        description="TRITON_INTERPRET=1 on CPU: small fixed tiles, no autotune",
        num_stages=1, num_warps=4, autotune=False, priority=5,
        matches=lambda env: env.device_type != "cuda" and env.triton_interpret,
    )
