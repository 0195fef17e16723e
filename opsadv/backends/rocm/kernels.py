"""The rocm backend's kernels: the shared Triton impls (opsadv/backends/triton_common) declared under backend
"rocm" (ids "rocm.triton.<...>"), with AMD capability checks instead of NVIDIA compute capabilities.  The kernels
read ctx.profile, which is a rocm profile here."""
from __future__ import annotations

import dataclasses

from opsadv.backends import triton_common
from opsadv.backends.triton_common import module_impls
from opsadv.core.kernel import KernelImpl

ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1102", "gfx1200", "gfx1201")   # CDNA2/3/4, RDNA3/4
# the plain Triton kernels (pointer loads; the backward's TMA paths switch themselves off on ROCm).  Left out: the
# TMA / persistent GEMMs (Hopper TMA) and the experimental atomic-dQ variant; the cuda backend's cuDNN / cuBLAS /
# aten / Gluon impls are NVIDIA's and not in triton_common at all.
PORTABLE = frozenset({"rocm.triton.flash_attention", "rocm.triton.sparse_attention", "rocm.triton.gemm",
                      "rocm.triton.swiglu_gemm", "rocm.triton.layer_norm", "rocm.triton.rms_norm",
                      "rocm.triton.swiglu", "rocm.triton.rotary_embedding", "rocm.triton.qk_norm_rotary",
                      "rocm.triton.linear_cross_entropy", "rocm.triton.linear_cross_entropy_stats",
                      "rocm.triton.paged_attention",
                      "rocm.triton.varlen_attention", "rocm.triton.attention_merge_"})


def _amd(impl: KernelImpl) -> KernelImpl:
    return dataclasses.replace(impl, min_cc=None, max_cc=None, cc_runtime="hip", archs=ARCHS,
                               description=f"{impl.description} [rocm: the shared Triton kernel on AMD]")


def impls(env) -> list[KernelImpl]:
    return [_amd(impl) for _, impl in module_impls(env, triton_common.KERNEL_MODULES, "rocm", backend="rocm")
            if impl.id in PORTABLE]
