"""gemm and swiglu_gemm in Triton (one kernel family, a SWIGLU flag): host and impls (gemm.py), kernels (kernels.py)."""

IMPL_MODULES = ("gemm",)     # the modules here that declare impls
