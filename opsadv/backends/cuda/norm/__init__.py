"""layer_norm and rms_norm on NVIDIA through ATen (aten.py)."""

IMPL_MODULES = ("aten",)     # the modules here that declare impls
