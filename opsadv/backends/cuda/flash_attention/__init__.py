"""flash_attention on NVIDIA: vendor kernels through torch SDPA (sdpa.py); the Gluon forward and backward for
Hopper (gluon.py, gluon_bwd.py; kernels in gluon_kernel.py, gluon_bwd_kernel.py).  The Triton kernels are in
opsadv/backends/triton_common/flash_attention/."""

IMPL_MODULES = ("sdpa", "gluon")     # the modules here that declare impls
