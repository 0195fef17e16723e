"""The swiglu op (opsadv.core.ops.swiglu) for the cuda backend: impl "cuda.triton.swiglu".

Forward reads gate_up once and writes y once; backward reads gate_up and grad once and writes d gate_up once
(_swiglu_triton.py), float32 math for every storage dtype.  These are memory-bound passes: a (rows, 2N) bf16
gate_up at the H200's ~4 TB/s takes rows * N * 6 bytes / 4e12 s forward, 10 bytes per (row, col) backward.
Rows are the flattened leading dims; a gate_up whose last dim is strided is copied first."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_TRITON, KernelImpl

from . import triton_device_types
from .gemm import _poisoned

MAX_BLOCK_N = 1024   # columns per program; 4 warps x 32 lanes x 8 elements
_K: dict = {}


def _kernels():
    """The Triton kernels behind the launch fast path, imported on first use (triton stays out of `import opsadv`)."""
    if not _K:
        from ._swiglu_triton import swiglu_bwd_kernel, swiglu_fwd_kernel
        from ._triton_utils import FastLaunch
        _K.update(fwd=FastLaunch(swiglu_fwd_kernel), bwd=FastLaunch(swiglu_bwd_kernel))
    return _K


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(m: int, n: int) -> tuple[tuple[int, int], int]:
    block = min(MAX_BLOCK_N, max(16, 1 << (n - 1).bit_length()))
    return (m, -(-n // block)), block


def swiglu_fwd(ctx, gate_up):
    gu = _rows(gate_up)
    m, n = gu.shape[0], gu.shape[1] // 2
    y = _poisoned((m, n), gu)
    grid, block = _grid(m, n)
    _kernels()["fwd"][grid](gu, y, n, gu.stride(0), y.stride(0), BLOCK_N=block, num_warps=4)
    return y.reshape(*gate_up.shape[:-1], n)


def swiglu_bwd(ctx, grad, gate_up):
    gu, dy = _rows(gate_up), _rows(grad)
    m, n = gu.shape[0], gu.shape[1] // 2
    dgu = _poisoned((m, 2 * n), gu)
    grid, block = _grid(m, n)
    _kernels()["bwd"][grid](gu, dy, dgu, n, gu.stride(0), dy.stride(0), dgu.stride(0), BLOCK_N=block, num_warps=4)
    return dgu.reshape(gate_up.shape)


def impls(env) -> list[KernelImpl]:
    return [KernelImpl(
        id="cuda.triton.swiglu", op="swiglu", backend="cuda", fn=swiglu_fwd, backward=swiglu_bwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), features=frozenset({"batched"}), deterministic=True,
        description="Triton: silu(g) * u in one pass over gate_up, backward in one pass (float32 math)")]
