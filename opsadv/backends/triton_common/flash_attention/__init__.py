"""flash_attention in Triton: forward kernel, host and impls (attention.py), backward kernels (bwd_kernels.py),
the dQ GEMM over a materialized dS (dq_gemm.py)."""

IMPL_MODULES = ("attention",)     # the modules here that declare impls
