"""The rocm backend's kernels: the cuda backend's portable Triton impls re-declared under backend "rocm"
(ids "rocm.triton.<...>"), with AMD capability checks instead of NVIDIA compute capabilities.  The kernels
read ctx.profile, which is a rocm profile here."""
from __future__ import annotations

import dataclasses

from opsadv.backends.triton_common import module_impls
from opsadv.core.kernel import KernelImpl

ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1102", "gfx1200", "gfx1201")   # CDNA2/3/4, RDNA3/4
# cuda impl id -> its kernel module: plain Triton kernels (pointer loads; the backward's TMA paths switch
# themselves off on ROCm).  Left out: cuDNN / cuBLAS / aten paths, Gluon kernels (NVIDIA-only dialect),
# the TMA / persistent GEMMs (Hopper TMA), the experimental atomic-dQ variant.
PORTABLE = {
    "cuda.triton.flash_attention": "flash_attention.attention",
    "cuda.triton.sparse_attention": "sparse_attention.sparse",
    "cuda.triton.gemm": "gemm.gemm",
    "cuda.triton.swiglu_gemm": "gemm.gemm",
    "cuda.triton.layer_norm": "norm.norm",
    "cuda.triton.rms_norm": "norm.norm",
    "cuda.triton.swiglu": "swiglu.swiglu",
    "cuda.triton.rotary_embedding": "rotary_embedding.rotary",
}


def rocm_id(impl_id: str) -> str:
    return "rocm." + (impl_id.split(".", 1)[1] if impl_id.startswith("cuda.") else impl_id)


def _rocm(impl: KernelImpl) -> KernelImpl:
    return dataclasses.replace(impl, id=rocm_id(impl.id), backend="rocm", min_cc=None, max_cc=None,
                               cc_runtime="hip", archs=ARCHS,
                               description=f"{impl.description} [rocm: the cuda backend's Triton kernel on AMD]")


def impls(env) -> list[KernelImpl]:
    modules = [f"opsadv.backends.triton_common.{m}" for m in sorted(set(PORTABLE.values()))]
    return [_rocm(impl) for name, impl in module_impls(env, modules, "rocm")
            if f"opsadv.backends.triton_common.{PORTABLE.get(impl.id)}" == name]
