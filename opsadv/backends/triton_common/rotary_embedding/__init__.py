"""rotary_embedding in Triton: host and impl (rotary.py), kernel (kernels.py)."""
