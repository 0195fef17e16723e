"""paged_attention in Triton: host and impl (paged_attention.py), kernels (kernels.py)."""

IMPL_MODULES = ("paged_attention",)     # the modules here that declare impls
