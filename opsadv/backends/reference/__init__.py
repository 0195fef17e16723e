"""The reference backend: plain torch on any device, every op forward and backward.  It is the
oracle the conformance kit compares every other impl with.  Implements exactly the hooks a
third-party plugin implements."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_REFERENCE, KernelImpl
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

from . import kernels as K

NAME = "reference"
DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu", "mps", "privateuseone")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ATTN_FEATURES = frozenset({"causal", "gqa", "cross_length", "attn_mask_bool", "attn_mask_float"})
SPARSE_FEATURES = frozenset({"causal", "gqa", "cross_length", "key_padding", "varlen", "window", "global"})
GEMM_FEATURES = frozenset({"bias", "residual", "alpha", "batched", "act_relu", "act_gelu", "act_gelu_tanh", "act_silu"})
NORM_FEATURES = frozenset({"weight", "bias", "residual", "offset"})
ROTARY_FEATURES = frozenset({"interleaved", "partial", "position_ids"})


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="opsadv", device_types=DEVICE_TYPES, version="1.0",
                       auto_priority=0, description="plain torch; the numerical oracle")


@hookimpl
def opsadv_probe(env):
    return ProbeResult(True, ("always available",))


def _impl(op, fn, bwd, features):
    return KernelImpl(id=f"reference.{op}", op=op, backend=NAME, fn=fn, backward=bwd, priority=PRIORITY_REFERENCE,
                      device_types=DEVICE_TYPES, dtypes=DTYPES, features=features, deterministic=True,
                      honours=frozenset({"matmul", "attention", "norm", "softmax"}),
                      description="plain torch (float32 accumulation; float64 stays float64)")


@hookimpl
def opsadv_register_kernels(registry, env):
    registry.add(_impl("flash_attention", K.attention_fwd, K.attention_bwd, ATTN_FEATURES))
    registry.add(_impl("sparse_attention", K.sparse_fwd, K.sparse_bwd, SPARSE_FEATURES))
    registry.add(_impl("gemm", K.gemm_fwd, K.gemm_bwd, GEMM_FEATURES))
    registry.add(_impl("swiglu_gemm", K.swiglu_fwd, K.swiglu_bwd, frozenset({"bias", "batched"})))
    registry.add(_impl("swiglu", K.swiglu_act_fwd, K.swiglu_act_bwd, frozenset({"batched"})))
    registry.add(_impl("layer_norm", K.layer_norm_fwd, K.layer_norm_bwd, NORM_FEATURES))
    registry.add(_impl("rms_norm", K.rms_norm_fwd, K.rms_norm_bwd, NORM_FEATURES))
    registry.add(_impl("rotary_embedding", K.rotary_fwd, K.rotary_bwd, ROTARY_FEATURES))


@hookimpl
def opsadv_profiles():
    return []
