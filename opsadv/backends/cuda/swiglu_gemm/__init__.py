"""swiglu_gemm on NVIDIA: the Gluon persistent SwiGLU GEMM for Hopper (gluon.py; kernel in gluon_kernel.py)."""

IMPL_MODULES = ("gluon",)     # the modules here that declare impls
