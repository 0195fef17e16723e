"""sparse_attention in Triton: host, kernels and impl (sparse.py), Triton helpers both forwards share (helpers.py),
the persistent band forward (band_persist.py)."""

IMPL_MODULES = ("sparse",)     # the modules here that declare impls
