"""swiglu (act(gate) * up, elementwise; act silu or gelu_tanh) in Triton: host and impl (swiglu.py), kernels (kernels.py)."""

IMPL_MODULES = ("swiglu",)     # the modules here that declare impls
