"""gemm on NVIDIA: the Gluon persistent GEMM for Hopper (gluon.py; kernel in gluon_kernel.py)."""
