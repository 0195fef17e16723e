"""attention_merge_ in Triton: host and impl (attention_merge.py), kernel (kernels.py)."""

IMPL_MODULES = ("attention_merge",)     # the modules here that declare impls
