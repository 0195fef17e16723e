"""The cast_to_fp8_delayed op (opsadv.ops.cast_to_fp8_delayed) in Triton: impl "<backend>.triton.cast_to_fp8_delayed".

Two launches (kernels.py): history_amax_kernel, a grid-stride max |x| into the current amax slot that returns at
once unless the call needs its own amax (the history's first call, or a history of length 0), then
cast_delayed_kernel over cast.py's 64x64 tiles: the scale from the history, the tile cast (and transpose), the
tile's amax recorded by an atomic max, and the ring advanced by the last program to arrive.  The history's slots are
float32 bits compared as integers, so a NaN in x is recorded as NaN (and makes the scale 1, as scale_from_amax)."""
from __future__ import annotations

import torch

from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl

from .. import poisoned, triton_device_types
from .cast import BLOCK_M, BLOCK_N, cast_outputs
from .scaled_gemm import FP8_FORMAT, FP8_MIN_CC

EXTRA = 3                  # the history's slots after the amaxes (ops/scaled_gemm/cast_delayed.py)
AMAX_PROGRAMS = 264        # history_amax_kernel's grid cap (2 per SM of an H100): a started history's cost
_K: dict = {}


def _kernels():
    if not _K:
        from .kernels import cast_delayed_kernel, history_amax_kernel
        from ..utils import FastLaunch
        _K.update(cast=FastLaunch(cast_delayed_kernel), amax=FastLaunch(history_amax_kernel))
    return _K


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cast_delayed_fwd(ctx, x, history, dtype, transpose):
    k = _kernels()
    m, n = x.shape
    q, qt = cast_outputs(x, dtype, transpose)
    scale = poisoned((), history)
    slots = history.numel() - EXTRA
    bits = history.view(torch.int32)
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    k["amax"][(min(grid[0] * grid[1], AMAX_PROGRAMS),)](x, history, bits, m, n, x.stride(0), x.stride(1), slots,
                                                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4)
    fmax, mant, emin = FP8_FORMAT[dtype]
    k["cast"][grid](x, q, qt if transpose else q, history, bits, scale, m, n, x.stride(0), x.stride(1), slots,
                    FMAX=fmax, MANT=mant, EMIN=emin, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_H=_pow2(slots),
                    TRANSPOSE=transpose, num_warps=4)
    return q, qt, scale


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.cast_to_fp8_delayed", op="cast_to_fp8_delayed", backend=backend, fn=cast_delayed_fwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), features=frozenset({"e5m2", "transpose"}),
        min_cc=FP8_MIN_CC, deterministic=True, requires_interpret_or_cuda=True, memory=MEMORY_FUSED,
        description="Triton: the scale from the device-side amax history, one pass over x in 64x64 tiles writing "
                    "fp8 (and its transpose), the amax recorded by an atomic max and the ring advanced by the last "
                    "program (plus a max |x| pass on a history's first call); fp8 stores: sm_89+")]
