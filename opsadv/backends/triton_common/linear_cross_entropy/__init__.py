"""linear_cross_entropy in Triton over chunks of tokens: host and impl (linear_cross_entropy.py), kernel (kernels.py)."""

IMPL_MODULES = ("linear_cross_entropy",)     # the modules here that declare impls
