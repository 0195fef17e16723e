"""layer_norm and rms_norm in Triton: host and impls (norm.py), kernels (kernels.py)."""

IMPL_MODULES = ("norm",)     # the modules here that declare impls
