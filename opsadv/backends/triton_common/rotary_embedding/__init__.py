"""rotary_embedding in Triton: host and impl (rotary.py), kernel (kernels.py)."""

IMPL_MODULES = ("rotary",)     # the modules here that declare impls
