"""Shared by the attention backward probes: the dispatcher's context for a shape, and the ragged GQA causal case
their GPU checks start from (bf16 d128 on CUDA; a tiny fp16 d64 one for the CPU dry run)."""
from __future__ import annotations

import opsadv
import torch
from opsadv.backends.cuda import attention as A
from opsadv.core import dispatch
from opsadv.core.ops import attention as OA


def attn_ctx(q, k, causal):
    """The cuda backend's resolved context for a backward call of this shape."""
    with opsadv.use_backend("cuda"):
        _, r = dispatch.explain_spec(OA._spec(q, k, None, causal, True))
    return r.ctx


def ragged_gqa_case(dev: str):
    """(ctx, do, q, k, v, out, lse) of b2 h8 kv4, 1000 tokens (70 on CPU), causal, scale 0.1: the forward run."""
    torch.manual_seed(0)
    n, dt, d = (1000, torch.bfloat16, 128) if dev == "cuda" else (70, torch.float16, 64)
    q = torch.randn(2, 8, n, d, device=dev, dtype=dt)
    k, v = (torch.randn(2, 4, n, d, device=dev, dtype=dt) for _ in range(2))
    do = torch.randn_like(q)
    ctx = attn_ctx(q, k, True)
    o, lse = A.flash_fwd(ctx, q, k, v, None, True, 0.1)
    return ctx, do, q, k, v, o, lse


def timing_case(dev: str, b: int, h: int, hkv: int, s: int, d: int, causal: bool):
    """(args, cudnn_backward): args = flash_bwd's arguments after one forward of our kernel on fresh inputs
    (scale d**-0.5), cudnn_backward a thunk timing cuDNN's backward on its own forward (None off CUDA)."""
    from opsadv.registry import get_registry
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float16
    q, do = (torch.randn(b, h, s, d, device=dev, dtype=dt) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, d, device=dev, dtype=dt) for _ in range(2))
    ctx = attn_ctx(q, k, causal)
    scale = d ** -0.5
    o, lse = A.flash_fwd(ctx, q, k, v, None, causal, scale)
    cudnn_bwd = None
    if dev == "cuda":
        cudnn = next(i for i in get_registry().impls_by_op["flash_attention"] if i.id == "cuda.sdpa.cudnn")
        co, clse = cudnn.fn(None, q, k, v, None, causal, scale)
        cudnn_bwd = lambda: cudnn.backward(None, do, q, k, v, co, clse, None, causal, scale)  # noqa: E731
    return (ctx, do, q, k, v, o, lse, None, causal, scale), cudnn_bwd
