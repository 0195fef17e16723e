"""scaled_gemm (FP8) on NVIDIA through cuBLASLt: torch._scaled_mm (cublas.py).  The Triton kernels are in
opsadv/backends/triton_common/scaled_gemm/."""

IMPL_MODULES = ("cublas",)     # the modules here that declare impls
