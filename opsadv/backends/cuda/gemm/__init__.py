"""gemm and swiglu_gemm on NVIDIA: cuBLAS through torch (cublas.py); the Gluon persistent GEMM for Hopper
(gluon.py; kernel in gluon_kernel.py).  The Triton kernels are in opsadv/backends/triton_common/gemm/."""

IMPL_MODULES = ("cublas", "gluon")     # the modules here that declare impls
