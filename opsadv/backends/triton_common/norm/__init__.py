"""layer_norm and rms_norm in Triton: host and impls (norm.py), kernels (kernels.py)."""
