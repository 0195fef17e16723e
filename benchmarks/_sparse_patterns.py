"""The small odd sparse patterns the sparse probes check against the reference backend (s = 150 in the
CPU dry run, 1500 on a GPU): window (causal / bidirectional), packed varlen with a 7-token segment,
BigBird per head, global tokens + window combined with key padding (batch 2)."""
from __future__ import annotations

import torch

from opsadv import SparseLayout


def odd_patterns(s: int, device, bidirectional: bool = False) -> dict:
    """name -> (layout, batch)."""
    pad = (torch.arange(s, device=device)[None] < torch.tensor([[s - 37], [s // 2]], device=device)).long()
    pats = {"window_causal": (SparseLayout.sliding_window(s, s // 6, causal=True, block_size=128, device=device), 1)}
    if bidirectional:
        pats["window_bidir"] = (SparseLayout.sliding_window(s, (s // 5, s // 7), causal=False, block_size=64,
                                                            device=device), 1)
    pats.update({
        "varlen_causal": (SparseLayout.varlen([s // 3, 7, s // 2, s - s // 3 - 7 - s // 2], causal=True,
                                              block_size=128, device=device), 1),
        "bigbird": (SparseLayout.bigbird(s, block_size=64, heads=4, random_blocks=2, device=device), 1),
        "window_padding_global": (SparseLayout.global_tokens(s, 9, window=s // 8, block_size=64, device=device)
                                  .combine(SparseLayout.from_padding_mask(pad, block_size=64)), 2),
    })
    return pats
