"""scaled_gemm (FP8) in Triton: host and impl (scaled_gemm.py), kernels (kernels.py)."""

IMPL_MODULES = ("scaled_gemm",)     # the modules here that declare impls
