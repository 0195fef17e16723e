"""sparse_attention on NVIDIA: the Gluon forward for Hopper (gluon.py; kernel in gluon_kernel.py)."""
