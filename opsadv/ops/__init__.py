"""The ops: `opsadv.ops.flash_attention(q, k, v, causal=True)` etc.  Each is a torch.library op
(`torch.ops.opsadv.*`) with fake kernels and autograd, dispatched to the resolved impl.

One folder per op (or per family of ops sharing a definition: gemm holds swiglu_gemm, norm holds layer_norm and
rms_norm): its public function, custom ops, reference impl (reference.py), conformance cases and demo inputs
(cases.py), and its OpDefs, which BUILTIN below registers in this order.  Each public function is bound here over
its folder's name: reach a folder's module with `from opsadv.ops.<op> import name` or importlib, not
`from opsadv.ops import <op>` (that is the function).  The in-place attention_merge_ (folder attention_merge) is
named with torch's trailing underscore."""
from opsadv.core.opdef import register_op

from .flash_attention import OPDEFS as _flash_attention, flash_attention
from .sparse_attention import OPDEFS as _sparse_attention, sparse_attention
from .gemm import ACTIVATIONS, OPDEFS as _gemm, gemm, swiglu_gemm
from .swiglu import OPDEFS as _swiglu, swiglu
from .norm import OPDEFS as _norm, layer_norm, rms_norm
from .rotary_embedding import OPDEFS as _rotary_embedding, rotary_embedding
from .qk_norm_rotary import OPDEFS as _qk_norm_rotary, qk_norm_rotary
from .linear_cross_entropy import OPDEFS as _linear_cross_entropy, linear_cross_entropy, linear_cross_entropy_stats
from .paged_attention import OPDEFS as _paged_attention, paged_attention
from .varlen_attention import OPDEFS as _varlen_attention, varlen_attention
from .scaled_gemm import OPDEFS as _scaled_gemm, cast_to_fp8, cast_to_fp8_delayed, scaled_gemm, scaled_swiglu_gemm
from .fp8_attention import OPDEFS as _fp8_attention, fp8_attention
from .attention_merge import OPDEFS as _attention_merge, attention_merge_

BUILTIN = (*_flash_attention, *_sparse_attention, *_gemm, *_swiglu, *_norm, *_rotary_embedding,
           *_qk_norm_rotary, *_linear_cross_entropy, *_paged_attention, *_varlen_attention, *_scaled_gemm,
           *_fp8_attention, *_attention_merge)
for _d in BUILTIN:
    register_op(_d)

__all__ = ["flash_attention", "sparse_attention", "gemm", "swiglu_gemm", "swiglu", "layer_norm", "rms_norm",
           "rotary_embedding",
           "qk_norm_rotary", "linear_cross_entropy", "linear_cross_entropy_stats", "paged_attention", "varlen_attention", "scaled_gemm",
           "scaled_swiglu_gemm", "cast_to_fp8", "cast_to_fp8_delayed", "fp8_attention", "attention_merge_"]
