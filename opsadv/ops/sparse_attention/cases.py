"""Conformance cases of sparse_attention (odd shapes, every feature) and the inputs `opsadv demo` runs."""
from __future__ import annotations

import torch

from opsadv.core.opdef import Case, rand

from .layout import SparseLayout


# ---- sparse attention ----------------------------------------------------------------------------
def _sparse(b, hq, hkv, s, d, bs, make_layout, s_k=None):
    s_k = s if s_k is None else s_k
    def build(dtype, device, g):
        q = rand((b, hq, s, d), dtype, device, g)
        k, v = rand((b, hkv, s_k, d), dtype, device, g), rand((b, hkv, s_k, d), dtype, device, g)
        return (q, k, v, make_layout(device, g)), {}
    return build


def _blocks(s, bs, device, value=False):
    n = -(-s // bs)
    return torch.full((1, 1, n, n), value, dtype=torch.bool, device=device)


def _window(s, bs, causal, w):
    return lambda device, g: SparseLayout(s, s, bs, _blocks(s, bs, device), causal=causal,
                                          window=(w, 0 if causal else w))


def _global_window(s, bs):
    return lambda device, g: SparseLayout(s, s, bs, _blocks(s, bs, device), window=(9, 9), num_global=3)


def _random_blocks(b, h, s, bs):
    def make(device, g):
        n = -(-s // bs)
        bm = torch.rand((b, h, n, n), generator=g) > 0.6
        bm[..., 0, :] = False                      # a q block with no blocks: rows give zeros
        return SparseLayout(s, s, bs, bm.to(device))
    return make


def _padding(b, s, bs):
    def make(device, g):
        lens = torch.randint(1, s + 1, (b,), generator=g)
        kpm = torch.arange(s)[None, :] < lens[:, None]
        return SparseLayout(s, s, bs, _blocks(s, bs, device, True), causal=True, key_padding_mask=kpm.to(device))
    return make


def _key_padding(b, s_q, s_k, bs, window=None):
    """Key padding without causal (an encoder's, or cross-attention's over a padded encoder batch: s_q != s_k),
    optionally with a bidirectional window (an encoder's local layers); one row keeps a single key."""
    def make(device, g):
        lens = torch.randint(1, s_k + 1, (b,), generator=g)
        lens[0] = 1
        kpm = torch.arange(s_k)[None, :] < lens[:, None]
        return SparseLayout(s_q, s_k, bs, _blocks2(s_q, s_k, bs, device, window is None), window=window,
                            key_padding_mask=kpm.to(device))
    return make


def _blocks2(s_q, s_k, bs, device, value):
    return torch.full((1, 1, -(-s_q // bs), -(-s_k // bs)), value, dtype=torch.bool, device=device)


def _varlen(lens, bs):
    def make(device, g):
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        s = int(cu[-1])
        return SparseLayout(s, s, bs, _blocks(s, bs, device, True), causal=True, cu_seqlens=cu)
    return make


def _plain_varlen(lens, bs, causal):
    """A packed batch as SparseLayout.varlen builds it (dense_blocks / max_seqlen set: what vendor
    varlen kernels such as FA2's serve); empty and one-token segments included."""
    return lambda device, g: SparseLayout.varlen(lens, causal=causal, block_size=bs, device=device)


CASES = [
    Case("sparse_attention", "window_causal", _sparse(1, 2, 2, 130, 64, 32, _window(130, 32, True, 40)), (0, 1, 2)),
    Case("sparse_attention", "window_bidir", _sparse(1, 2, 1, 97, 32, 32, _window(97, 32, False, 20)), (0, 1, 2)),
    Case("sparse_attention", "global_window", _sparse(1, 2, 2, 77, 64, 16, _global_window(77, 16)), (0, 1, 2)),
    Case("sparse_attention", "block_mask", _sparse(2, 2, 2, 96, 64, 32, _random_blocks(2, 2, 96, 32)), (0, 1, 2)),
    Case("sparse_attention", "padding", _sparse(3, 2, 2, 50, 64, 16, _padding(3, 50, 16)), (0, 1, 2)),
    Case("sparse_attention", "padding_cross", _sparse(3, 2, 1, 23, 64, 16, _key_padding(3, 23, 50, 16), s_k=50),
         (0, 1, 2)),
    Case("sparse_attention", "window_bidir_padding",
         _sparse(3, 2, 2, 61, 64, 16, _key_padding(3, 61, 61, 16, (12, 12))), (0, 1, 2)),
    Case("sparse_attention", "varlen", _sparse(1, 2, 2, 1 + 37 + 64, 64, 16, _varlen([1, 37, 64], 16)), (0, 1, 2)),
    Case("sparse_attention", "varlen_plain", _sparse(1, 3, 3, 45 + 1 + 127, 64, 16, _plain_varlen([45, 0, 1, 127], 16,
                                                                                                   False)), (0, 1, 2)),
    Case("sparse_attention", "varlen_plain_gqa_causal", _sparse(1, 4, 2, 3 + 70 + 33, 32, 32,
                                                                _plain_varlen([3, 70, 0, 33], 32, True)), (0, 1, 2)),
]


def demo(device: str, dtype: torch.dtype, g: torch.Generator, big: bool) -> tuple[tuple, dict]:
    """`opsadv demo`'s call: a causal sliding window of four blocks."""
    b, h, hkv, s, d = (2, 16, 4, 1024, 128) if big else (1, 4, 2, 100, 64)
    bs = 64 if big else 16
    nb = -(-s // bs)
    layout = SparseLayout(s, s, bs, torch.zeros(1, 1, nb, nb, dtype=torch.bool, device=device), causal=True,
                          window=(4 * bs, 0))
    return (rand((b, h, s, d), dtype, device, g), rand((b, hkv, s, d), dtype, device, g),
            rand((b, hkv, s, d), dtype, device, g), layout), {}
