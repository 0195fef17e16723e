"""scaled_gemm (FP8) in Triton: host and impl (scaled_gemm.py), cast_to_fp8 (cast.py), kernels (kernels.py)."""

IMPL_MODULES = ("scaled_gemm", "cast")     # the modules here that declare impls
