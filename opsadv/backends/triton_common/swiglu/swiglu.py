"""The swiglu op (opsadv.ops.swiglu) for the cuda backend: impl "cuda.triton.swiglu", SwiGLU (silu) and GeGLU
(gelu_tanh, feature act_gelu_tanh).

Forward reads gate_up once and writes y once; backward reads gate_up and grad once and writes d gate_up once
(kernels.py), float32 math for every storage dtype.  These are memory-bound passes: a (rows, 2N) bf16
gate_up at the H200's ~4 TB/s takes rows * N * 6 bytes / 4e12 s forward, 10 bytes per (row, col) backward.
Rows are the flattened leading dims; a gate_up whose last dim is strided is copied first."""
from __future__ import annotations

import functools

import torch

from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl

from .. import poisoned as _poisoned, triton_device_types

MAX_BLOCK_N = 1024   # columns per program in the default tile; 4 warps x 32 lanes x 8 elements
# (ROWS, BLOCK_N cap, num_warps) tiles measured per shape bucket where the profile autotunes; the first is the
# default (one row, up to 1024 columns: on the H200 at a10ecac the forward read 0.2666 ms at 16384 x 11008
# against 0.2529 for torch.compile's pointwise kernel, 0.948x).  Wider and
# taller tiles issue fewer, longer programs and waste less of a ragged last column block.  At 45a6b0b the tuner
# chose (1, 4096, 8): 0.955x compile.  ROWS 0: BLOCK_N elements of the flattened output per program, as
# compile's pointwise kernel walks it (no ragged block per row): at d49d54c the tuner chose (0, 1024, 4) both
# ways, forward 0.999x compile (4.3 TB/s), fwd+bwd 1.40x.
CONFIGS = ((1, 1024, 4), (1, 2048, 8), (2, 1024, 4), (4, 1024, 8), (1, 4096, 8), (8, 512, 8), (0, 1024, 4),
           (0, 2048, 8), (0, 4096, 8))
FLAT_INT32_LIMIT = 2 ** 31     # flattened tiles (ROWS 0) index in int32 below this many elements
_K: dict = {}


def _kernels():
    """The Triton kernels behind the launch fast path, imported on first use (triton stays out of `import opsadv`)."""
    if not _K:
        from .kernels import swiglu_bwd_kernel, swiglu_fwd_kernel
        from ..utils import ConfigTuner, FastLaunch
        _K.update(fwd=FastLaunch(swiglu_fwd_kernel), bwd=FastLaunch(swiglu_bwd_kernel),
                  tuner=ConfigTuner("swiglu.tile"))
    return _K


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _tile(rows: int, cols: int, cfg) -> dict:
    """Launch grid and meta-parameters of one (ROWS, BLOCK_N cap, warps) config at this shape."""
    r, cap, warps = cfg
    idx64 = rows * cols >= FLAT_INT32_LIMIT - cap     # the flat index (+ a block past the end) needs int64
    if r == 0:
        return dict(grid=(-(-(rows * cols) // cap), 1), ROWS=0, BLOCK_N=cap, IDX64=idx64, num_warps=warps)
    block = min(cap, max(16, 1 << (cols - 1).bit_length()))
    return dict(grid=(-(-rows // r), -(-cols // block)), ROWS=r, BLOCK_N=block, IDX64=False, num_warps=warps)


@functools.lru_cache(maxsize=4)
def _candidates(configs: tuple) -> list:
    """The tuner's candidate list for CONFIGS (built once, not per call)."""
    return [{"cfg": c} for c in configs]


ACT_IDS = {"silu": 4, "gelu_tanh": 3}     # the kernels' ACT constexpr (gemm/kernels.py ACT_IDS)


def _launch(ctx, which: str, m: int, n: int, args: tuple, out: torch.Tensor, activation: str) -> None:
    """Run kernel `which` ("fwd" / "bwd") over (m rows, n columns) with the tile measured for this bucket."""
    from ..utils import bucket
    k = _kernels()
    profile = getattr(ctx, "profile", None)
    autotune = out.is_cuda and profile is not None and profile.autotune
    act = ACT_IDS[activation]

    def go(cfg):
        t = _tile(m, n, cfg["cfg"])
        k[which][t.pop("grid")](*args, ACT=act, **t)
    # (SwiGLU keeps its tuner key; GeGLU's tile is measured on its own: more math per element)
    key = (which, str(out.dtype), bucket(m), n) + (() if activation == "silu" else (activation,))
    cfg = k["tuner"].pick(key, _candidates(CONFIGS), go, autotune)
    go(cfg)


def swiglu_fwd(ctx, gate_up, activation="silu"):
    gu = _rows(gate_up)
    m, n = gu.shape[0], gu.shape[1] // 2
    y = _poisoned((m, n), gu)
    _launch(ctx, "fwd", m, n, (gu, y, m, n, gu.stride(0), y.stride(0)), y, activation)
    return y.reshape(*gate_up.shape[:-1], n)


def swiglu_bwd(ctx, grad, gate_up, activation="silu"):
    gu, dy = _rows(gate_up), _rows(grad)
    m, n = gu.shape[0], gu.shape[1] // 2
    dgu = _poisoned((m, 2 * n), gu)
    _launch(ctx, "bwd", m, n, (gu, dy, dgu, m, n, gu.stride(0), dy.stride(0), dgu.stride(0)), dgu, activation)
    return dgu.reshape(gate_up.shape)


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.swiglu", op="swiglu", backend=backend, fn=swiglu_fwd, backward=swiglu_bwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), features=frozenset({"batched", "act_gelu_tanh"}),
        deterministic=True, requires_interpret_or_cuda=True, memory=MEMORY_FUSED,
        description="Triton: silu(g) * u or gelu_tanh(g) * u in one pass over gate_up, backward in one pass "
                    "(float32 math)")]
