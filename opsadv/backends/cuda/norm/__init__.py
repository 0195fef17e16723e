"""layer_norm and rms_norm on NVIDIA through ATen (aten.py)."""
