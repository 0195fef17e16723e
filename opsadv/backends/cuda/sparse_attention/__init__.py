"""sparse_attention on NVIDIA: the Gluon forward for Hopper (gluon.py; kernel in gluon_kernel.py).  The Triton
kernels are in opsadv/backends/triton_common/sparse_attention/."""

IMPL_MODULES = ("gluon",)     # the modules here that declare impls
