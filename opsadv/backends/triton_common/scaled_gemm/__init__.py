"""scaled_gemm (FP8) in Triton: host and impl (scaled_gemm.py), cast_to_fp8 (cast.py),
cast_to_fp8_delayed (cast_delayed.py), kernels (kernels.py)."""

IMPL_MODULES = ("scaled_gemm", "cast", "cast_delayed")     # the modules here that declare impls
