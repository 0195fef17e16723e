"""swiglu (silu(gate) * up, elementwise) in Triton: host and impl (swiglu.py), kernels (kernels.py)."""

IMPL_MODULES = ("swiglu",)     # the modules here that declare impls
