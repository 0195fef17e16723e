"""The cast_to_fp8 op (opsadv.ops.cast_to_fp8) in Triton: impl "<backend>.triton.cast_to_fp8".

One launch over (BLOCK_M, BLOCK_N) tiles of x (kernels.py cast_kernel): each tile read once, its fp8 values written
to x_fp8 and (transpose) x_fp8_t, its max |x| to one float32 per tile, which a torch amax over the tiles reduces
(deterministic, NaN-propagating: no atomics).  Rounding by _round_fp8 (exact on the GPU and in the interpreter)."""
from __future__ import annotations

import torch

from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl

from .. import poisoned, triton_device_types
from .scaled_gemm import FP8_FORMAT, FP8_MIN_CC

BLOCK_M, BLOCK_N = 64, 64
_K: dict = {}


def _kernel():
    if not _K:
        from .kernels import cast_kernel
        from ..utils import FastLaunch
        _K["k"] = FastLaunch(cast_kernel)
    return _K["k"]


def cast_outputs(x, dtype, transpose):
    """(q (M, N), qt (N, M) or an empty (0,) tensor) in fp8 `dtype`, NaN-poisoned where `poisoned` says."""
    m, n = x.shape
    like = x.new_empty((0,), dtype=dtype)
    return poisoned((m, n), like), (poisoned((n, m), like) if transpose else like)


def cast_fwd(ctx, x, scale, dtype, transpose):
    m, n = x.shape
    dev = x.device
    q, qt = cast_outputs(x, dtype, transpose)
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=dev)
    fmax, mant, emin = FP8_FORMAT[dtype]
    _kernel()[grid](x, q, qt if transpose else q, part, scale, m, n, x.stride(0), x.stride(1),
                    FMAX=fmax, MANT=mant, EMIN=emin, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, TRANSPOSE=transpose,
                    num_warps=4)
    return q, qt, part.amax()


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.cast_to_fp8", op="cast_to_fp8", backend=backend, fn=cast_fwd, priority=PRIORITY_TRITON,
        device_types=triton_device_types(env), dtypes=(torch.float16, torch.bfloat16, torch.float32),
        features=frozenset({"e5m2", "transpose"}), min_cc=FP8_MIN_CC, deterministic=True,
        requires_interpret_or_cuda=True, memory=MEMORY_FUSED,
        description="Triton: one pass over x in 64x64 tiles, fp8 (and its transpose) written, a max |x| per tile "
                    "(fp8 stores: sm_89+)")]
