"""SparseLayout: the core-owned description of a block-sparse attention pattern and/or a
packed variable-length batch.  Backends read its explicit parts (window, globals, causal,
padding, cu_seqlens) to map onto their own kernels (e.g. Ascend's sparse_mode / TND layout);
the reference backend turns it into a dense boolean mask (`dense_mask`), which *defines* its
semantics:

    allowed(b, h, i, j) = causal_ok(i, j) and key_ok(b, j) and same_segment(i, j)
                          and (block_mask[b, h, i // bs, j // bs] or window_ok(i, j) or global_ok(i, j))

with i' = i + (s_k - s_q) (bottom-right alignment):
    causal_ok   j <= i'                                 (when causal)
    window_ok   i' - left <= j <= i' + right            (when a window is set)
    global_ok   i < G or j < G                          (G = num_global; per segment when packed)
    key_ok      key_padding_mask[b, j]                  (True = a real token)
    same_segment  i and j in the same cu_seqlens segment (packed batches; batch must be 1)
A row with no allowed key yields zeros (and lse = -inf)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InvalidArgumentError

OP = "sparse_attention"


@dataclass(frozen=True, eq=False)
class SparseLayout:
    seq_q: int
    seq_k: int
    block_size: int
    block_mask: Tensor                      # bool (B|1, H|1, ceil(s_q/bs), ceil(s_k/bs)): explicit blocks
    causal: bool = False
    window: tuple[int, int] | None = None   # (left, right) in tokens
    num_global: int = 0
    key_padding_mask: Tensor | None = None  # bool (B, s_k), True = real token
    cu_seqlens: Tensor | None = None        # int32 (n_seq + 1,), packed batch (s_q == s_k)

    def __post_init__(self):
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1:
            raise InvalidArgumentError(OP, "layout.block_size", "an int >= 1", repr(bs))
        if self.seq_q < 1 or self.seq_k < 1:
            raise InvalidArgumentError(OP, "layout.seq_q/seq_k", "positive lengths", (self.seq_q, self.seq_k))
        nq, nk = -(-self.seq_q // bs), -(-self.seq_k // bs)
        bm = self.block_mask
        if not isinstance(bm, Tensor) or bm.dtype != torch.bool or bm.dim() != 4 or tuple(bm.shape[2:]) != (nq, nk):
            raise InvalidArgumentError(OP, "layout.block_mask", f"a bool tensor (B|1, H|1, {nq}, {nk})",
                                       f"{getattr(bm, 'dtype', type(bm).__name__)} {tuple(getattr(bm, 'shape', ()))}")
        if self.window is not None:
            l, r = self.window
            if l < 0 or r < 0:
                raise InvalidArgumentError(OP, "layout.window", "(left, right) with both >= 0", self.window)
        if self.num_global < 0:
            raise InvalidArgumentError(OP, "layout.num_global", "an int >= 0", self.num_global)
        if self.key_padding_mask is not None:
            kp = self.key_padding_mask
            if kp.dtype != torch.bool or kp.dim() != 2 or kp.shape[1] != self.seq_k:
                raise InvalidArgumentError(OP, "layout.key_padding_mask", f"a bool tensor (B, {self.seq_k})",
                                           f"{kp.dtype} {tuple(kp.shape)}")
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if self.seq_q != self.seq_k:
                raise InvalidArgumentError(OP, "layout.cu_seqlens", "a packed batch with s_q == s_k", (self.seq_q, self.seq_k))
            if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.numel() < 2 \
                    or int(cu[0]) != 0 or int(cu[-1]) != self.seq_q or bool((cu[1:] < cu[:-1]).any()):
                raise InvalidArgumentError(OP, "layout.cu_seqlens",
                                           f"int cumulative lengths from 0 to {self.seq_q}, non-decreasing", cu.tolist())

    @property
    def window_left(self) -> int:
        return -1 if self.window is None else self.window[0]

    @property
    def window_right(self) -> int:
        return -1 if self.window is None else self.window[1]

    def dense_mask(self, batch: int = 1, heads: int = 1, device=None) -> Tensor:
        """The exact element mask (B|1, H|1, s_q, s_k), built naively: the semantics' oracle."""
        return dense_mask(self.seq_q, self.seq_k, self.block_size, self.block_mask, self.causal, self.window,
                          self.num_global, self.key_padding_mask, self.cu_seqlens, device=device)


def dense_mask(sq: int, sk: int, bs: int, block_mask: Tensor, causal: bool, window: tuple[int, int] | None,
               num_global: int, key_padding_mask: Tensor | None, cu_seqlens: Tensor | None, device=None) -> Tensor:
    """allowed(b, h, i, j) exactly as the module docstring defines it (naive and dense)."""
    device = device or block_mask.device
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    ip = i + (sk - sq)
    rule = block_mask.to(device)[:, :, (i // bs).expand(sq, sk), (j // bs).expand(sq, sk)]
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seg = torch.searchsorted(cu, torch.arange(sq, device=device), right=True) - 1
        start = cu[seg]
        rel_i, rel_j, same = i - start[:, None], j - start[None, :], seg[:, None] == seg[None, :]
    else:
        rel_i, rel_j, same = i, j, None
    extra = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if window is not None:
        left, right = window
        extra |= (j >= ip - left) & (j <= ip + right)
    if num_global:
        extra |= (rel_i < num_global) | (rel_j < num_global)
    allowed = rule | extra
    if causal:
        allowed = allowed & (j <= ip)
    if same is not None:
        allowed = allowed & same
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(device)[:, None, None, :]
    return allowed
