"""flash_attention in Triton: forward (attention.py), backward kernels (bwd_kernels.py), the dQ GEMM over a materialized dS (dq_gemm.py)."""
