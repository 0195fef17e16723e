"""The attention_merge_ op (opsadv.ops.attention_merge_) for the cuda backend: impl "cuda.triton.attention_merge_".

One launch merges a partial attention result (out, lse) into float32 accumulators in place (kernels.py): acc_out and
out read once, acc_out written once, a memory-bound pass (the torch formula takes ~8 elementwise kernels over the
same tensors).  float64 accumulators are not declared: the reference impl serves them (explain says so)."""
from __future__ import annotations

import torch

from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl

from .. import triton_device_types

TILE_ELEMS = 4096          # elements of one (BLOCK_S rows x BLOCK_D) tile of acc_out
MAX_BLOCK_D = 128          # D in tiles of at most this: one tile up to d = 128, two up to 256
_K: dict = {}


def _kernel():
    if not _K:
        from .kernels import merge_kernel
        from ..utils import FastLaunch
        _K["k"] = FastLaunch(merge_kernel)
    return _K["k"]


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tiles(s: int, d: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D) for s rows of head dim d."""
    block_d = min(_pow2(d), MAX_BLOCK_D)
    return max(1, min(_pow2(s), TILE_ELEMS // block_d)), block_d


def merge_fwd(ctx, acc_out, acc_lse, out, lse) -> None:
    b, h, s, d = acc_out.shape
    block_s, block_d = tiles(s, d)
    nblk = -(-s // block_s)
    _kernel()[(nblk * b * h,)](acc_out, acc_lse, out, lse, s, h, nblk,
                               *acc_out.stride(), *acc_lse.stride(), *out.stride(), *lse.stride(),
                               D=d, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.attention_merge_", op="attention_merge_", backend=backend, fn=merge_fwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env), dtypes=(torch.float32,),
        deterministic=True, requires_interpret_or_cuda=True, memory=MEMORY_FUSED,
        description="Triton: one pass, acc_out and out read once and acc_out written once (float32 accumulators; "
                    "float64 ones take the reference)")]
