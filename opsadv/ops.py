"""The ops: `opsadv.ops.flash_attention(q, k, v, causal=True)` etc.  Each is a torch.library op
(`torch.ops.opsadv.*`) with fake kernels and autograd, dispatched to the resolved impl."""
from opsadv.core.ops import (  # noqa: F401
    ACTIVATIONS,
    flash_attention,
    gemm,
    layer_norm,
    rms_norm,
    rotary_embedding,
    sparse_attention,
    swiglu,
    swiglu_gemm,
)

__all__ = ["flash_attention", "sparse_attention", "gemm", "swiglu_gemm", "swiglu", "layer_norm", "rms_norm", "rotary_embedding"]
