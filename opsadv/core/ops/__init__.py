"""The op IR: one module per op family (schema, validation, torch.library op, fake kernel,
autograd).  Importing this package registers every `opsadv::*` op."""
from .attention import flash_attention
from .gemm import ACTIVATIONS, gemm, swiglu_gemm
from .norm import layer_norm, rms_norm
from .sparse import sparse_attention
from .rotary import rotary_embedding
from .swiglu import swiglu

__all__ = ["flash_attention", "sparse_attention", "gemm", "swiglu_gemm", "swiglu", "layer_norm", "rms_norm", "rotary_embedding", "ACTIVATIONS"]
