"""Host helpers every Gluon impl module of the cuda backend shares (flash / sparse attention, gemm, swiglu_gemm):
the reason an impl gives when Gluon does not import, TMA-ready tensors, cached NVMMA shared layouts and the
(b, h, s, d) TMA descriptors of the attention kernels.  Importing this never fails: without Gluon, the
layout and descriptor helpers raise when called (the impls refuse before that, with gluon_unavailable's reason)."""
from __future__ import annotations

import functools

import torch

try:
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonTensorDescriptor
except Exception:  # ImportError, or an older Triton whose Gluon lacks a name used here
    _gl = _GluonTensorDescriptor = None


def gluon_unavailable(e: Exception) -> str:
    """The reason every Gluon impl gives when its kernel module does not import."""
    return f"triton.experimental.gluon (Hopper) is not importable: {type(e).__name__}: {e}"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself when a TMA descriptor can address it (unit stride along d, 16-byte aligned base and
    strides), else a contiguous copy."""
    esize = t.element_size()
    if (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and (st * esize) % 16 == 0 for st in t.stride()[:-1])):
        return t
    return t.contiguous()


@functools.lru_cache(maxsize=None)
def nvmma_layout(block: tuple, gdt):
    """NVMMASharedLayout.get_default_for(block, gdt), cached: it costs ~6 us of host time per call and a
    Gluon launch needs up to six (descriptors and smem layouts), all from a handful of (block, dtype)."""
    return _gl.NVMMASharedLayout.get_default_for(list(block), gdt)


def desc(t: torch.Tensor, rows: int, gdt):
    """A TMA descriptor of (b, h, s, d) tensor t whose box is `rows` rows of one head."""
    d = t.shape[-1]
    layout = nvmma_layout((1, 1, rows, d), gdt)
    return _GluonTensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d], layout)
