"""qk_norm_rotary in Triton: host and impl (qk_norm_rotary.py), kernels (kernels.py)."""

IMPL_MODULES = ("qk_norm_rotary",)     # the modules here that declare impls
