"""The ops: `opsadv.ops.flash_attention(q, k, v, causal=True)` etc.  Each is a torch.library op
(`torch.ops.opsadv.*`) with fake kernels and autograd, dispatched to the resolved impl."""
from .flash_attention import flash_attention
from .sparse_attention import sparse_attention
from .gemm import ACTIVATIONS, gemm, swiglu_gemm
from .swiglu import swiglu
from .norm import layer_norm, rms_norm
from .rotary_embedding import rotary_embedding

__all__ = ["flash_attention", "sparse_attention", "gemm", "swiglu_gemm", "swiglu", "layer_norm", "rms_norm", "rotary_embedding"]
