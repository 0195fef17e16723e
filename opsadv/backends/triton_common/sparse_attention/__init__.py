"""sparse_attention in Triton: host and kernels (sparse.py), shared Triton helpers (helpers.py), the persistent band forward (band_persist.py)."""
