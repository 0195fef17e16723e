"""The sparse_attention reference impl (the oracle): the layout as a dense mask (.layout.dense_mask, which defines
its semantics) over the flash_attention reference."""
from __future__ import annotations

from ..flash_attention.reference import attention_bwd, attention_fwd
from .layout import dense_mask

FEATURES = frozenset({"causal", "gqa", "cross_length", "key_padding", "varlen", "window", "global"})


# ---- sparse attention (dense masking) ------------------------------------------------------------
def _sparse_mask(q, k, block_mask, kpm, cu, bs, causal, wl, wr, ng):
    window = (wl, wr) if wl >= 0 else None
    return dense_mask(q.shape[2], k.shape[2], bs, block_mask, causal, window, ng, kpm, cu, device=q.device)


def sparse_fwd(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks=False,
               max_seqlen=-1):
    mask = _sparse_mask(q, k, block_mask, kpm, cu, bs, causal, wl, wr, ng)
    return attention_fwd(ctx, q, k, v, mask, False, scale)


def sparse_bwd(ctx, dout, q, k, v, out, lse, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale,
               dense_blocks=False, max_seqlen=-1):
    mask = _sparse_mask(q, k, block_mask, kpm, cu, bs, causal, wl, wr, ng)
    return attention_bwd(ctx, dout, q, k, v, out, lse, mask, False, scale)
