"""fp8_attention (FP8 e4m3 q, k, v) in Triton: host and impl (fp8_attention.py), forward kernel (kernels.py)."""

IMPL_MODULES = ("fp8_attention",)     # the modules here that declare impls
