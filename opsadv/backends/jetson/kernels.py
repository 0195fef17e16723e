"""The jetson backend's kernels: the cuda backend's kernel modules re-registered under backend
"jetson" (ids "jetson.<...>"), wrapped to bound their workspace (chunking.py), plus the chunked
math attention (attention.py).  The kernels read ctx.profile, which is the "jetson" profile here."""
from __future__ import annotations

import dataclasses
import functools

import torch

from opsadv.backends.cuda import KERNEL_MODULES
from opsadv.backends.triton_common import module_impls, triton_device_types
from opsadv.core.kernel import PRIORITY_GENERIC, KernelImpl, materializes_scores

from . import attention as math_attention
from . import chunking as C
from .detect import BF16_MIN_CC, has_bf16

ATTN_FEATURES = frozenset({"causal", "gqa", "cross_length", "attn_mask_bool", "attn_mask_float"})


def jetson_id(impl_id: str) -> str:
    return "jetson." + (impl_id.split(".", 1)[1] if impl_id.startswith("cuda.") else impl_id)


def _with_bf16_check(check, *more):
    """Reject bf16 on parts without it (Xavier, cc 7.2) with a reason that says what to use; then
    the jetson-specific checks in `more`, then the underlying impl's own check."""
    def jetson_check(spec, env):
        why = []
        if spec.dtype == torch.bfloat16 and spec.device_type == "cuda" and not has_bf16(env):
            cc = env.compute_capability
            why.append(f"bfloat16 needs compute capability >= {BF16_MIN_CC[0]}.{BF16_MIN_CC[1]} "
                       f"(this Jetson is {cc[0]}.{cc[1]}): run the model in float16")
        for extra in more:
            why += [] if why else extra(spec, env)
        return why + (list(check(spec, env)) if check is not None and not why else [])
    return jetson_check


def _wrap(impl: KernelImpl) -> KernelImpl:
    fn, bwd, note, checks = impl.fn, impl.backward, "no chunking needed (fused)", ()
    if C.expands_kv(impl):
        checks, note = (C.kv_expand_check,), "refused when its GQA K/V expansion exceeds the workspace cap"
    if impl.op == "flash_attention":
        per = C.attn_bytes_per_score(impl)
        if per and "cross_length" in impl.features:
            fn = functools.partial(C.chunked_attention_fwd, impl.fn, per, impl=impl)
            bwd = functools.partial(C.chunked_attention_bwd, impl.backward, per, impl=impl) if impl.backward else None
            note = "query-chunked above the workspace cap"
        elif per:
            note = "not chunkable (the kernel does not take s_q != s_k)"
    elif impl.op in ("paged_attention", "varlen_attention"):     # the same kernel and split heuristic
        fn = functools.partial(C.bounded_paged_fwd, impl.fn)
        note = "split-KV partials bounded by the workspace cap (fewer splits)"
    elif impl.op in ("scaled_gemm", "scaled_swiglu_gemm", "cast_to_fp8", "cast_to_fp8_delayed",
                     "fp8_attention"):   # min_cc (8, 9): no Jetson
        note = "refused: Orin (sm_87) and Xavier (sm_72) have no FP8 tensor cores (sm_89+)"
    elif impl.op in ("gemm", "swiglu_gemm"):
        factor = C.gemm_factor(impl)
        if factor:
            f_fwd, f_bwd = ((C.chunked_gemm_fwd, C.chunked_gemm_bwd) if impl.op == "gemm"
                            else (C.chunked_swiglu_fwd, C.chunked_swiglu_bwd))
            fn = functools.partial(f_fwd, impl.fn, factor)
            bwd = functools.partial(f_bwd, impl.backward, factor) if impl.backward else None
            note = "row-chunked above the workspace cap"
    return dataclasses.replace(impl, id=jetson_id(impl.id), backend="jetson", fn=fn, backward=bwd,
                               inference=impl.inference if fn is impl.fn else None,   # (not around a wrapper)
                               check=_with_bf16_check(impl.check, *checks),
                               description=f"{impl.description} [jetson profile; {note}]")


def cuda_impls(env) -> list[KernelImpl]:
    return [_wrap(impl) for _, impl in module_impls(env, KERNEL_MODULES, "jetson")]


def own_impls(env) -> list[KernelImpl]:
    devices = triton_device_types(env)   # plain torch, but CPU only in interpreter mode (tests), like the rest
    return [KernelImpl(
        id="jetson.chunked_math_attention", op="flash_attention", backend="jetson", fn=math_attention.fwd,
        backward=math_attention.bwd, priority=PRIORITY_GENERIC, device_types=devices,
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), features=ATTN_FEATURES,
        deterministic=True, check=_with_bf16_check(None),
        memory=materializes_scores(math_attention.BYTES_PER_SCORE),     # per chunk: it bounds its own chunks
        description="torch math attention over query chunks (score matrix bounded by the workspace cap); "
                    "any head dim, masks, cc 7.2")]


def impls(env) -> list[KernelImpl]:
    return cuda_impls(env) + own_impls(env)
