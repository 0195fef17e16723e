"""The attention ops' layout contract: out (and dq, dk, dv) keep q's (k's, v's) strides when it is
dense, else are contiguous, whatever impl serves; real outputs agree with the fake kernels
(torch.compile) and an output for a transposed (b, s, h, d) q needs no copy to go back."""
from __future__ import annotations

import pytest
import torch

import opsadv
from opsadv.core.layout import SparseLayout
from opsadv.core.ops._common import layout_like_strides, match_layout


def _bshd(b, s, h, d, dtype, g):
    return torch.randn(b, s, h, d, generator=g, dtype=dtype).transpose(1, 2)     # (b, h, s, d) view


def _backends():
    out = ["reference"]
    try:
        with opsadv.use_backend("cuda"):
            out.append("cuda")
    except Exception:
        pass
    return out


@pytest.mark.parametrize("make,kept", [
    (lambda: torch.empty(2, 5, 3, 8).transpose(1, 2), True),                               # dense, transposed
    (lambda: torch.empty(2, 5, 48).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)[0], False),  # q of a fused qkv
    (lambda: torch.empty(4, 1, 7, 8)[:, :, ::2], False),                                    # strided
    (lambda: torch.empty(3, 6, 1, 2).expand(3, 6, 5, 2), False),                            # broadcast
])
def test_layout_is_the_input_s_when_dense_else_contiguous(make, kept):
    t = make()
    want = t.stride() if kept else torch.empty(t.shape).stride()
    assert layout_like_strides(t) == want


def test_match_layout_copies_only_when_needed():
    g = torch.Generator().manual_seed(0)
    q = _bshd(2, 5, 3, 8, torch.float32, g)
    same = torch.empty_like(q)
    assert match_layout(same, q) is same
    c = torch.randn(q.shape, generator=g)
    m = match_layout(c, q)
    assert m.stride() == q.stride() == layout_like_strides(q) and torch.equal(m, c)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("op", ["flash", "sparse"])
def test_outputs_and_grads_laid_out_like_inputs(backend, op):
    g = torch.Generator().manual_seed(1)
    dt = torch.float16 if backend == "cuda" else torch.float32
    q, k, v = (_bshd(2, 37, h, 32, dt, g) for h in (4, 2, 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with opsadv.use_backend(backend):
        if op == "flash":
            out = opsadv.ops.flash_attention(q, k, v, causal=True)
        else:
            out = opsadv.ops.sparse_attention(q, k, v, SparseLayout.sliding_window(37, 9, causal=True,
                                                                                   block_size=16))
        out.backward(torch.randn(out.shape, generator=g, dtype=dt))
    assert out.stride() == q.stride()
    assert out.transpose(1, 2).is_contiguous()          # transformers' transpose back is free
    for t in (q, k, v):
        assert t.grad.stride() == t.stride()
    with opsadv.use_backend("reference"):
        q64, k64, v64 = (t.detach().double() for t in (q, k, v))
        ref = (opsadv.ops.flash_attention(q64, k64, v64, causal=True) if op == "flash" else
               opsadv.ops.sparse_attention(q64, k64, v64, SparseLayout.sliding_window(37, 9, causal=True,
                                                                                      block_size=16)))
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=3e-3)


def test_fake_kernel_promises_the_same_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 7, 4, 16).transpose(1, 2)
        k = torch.empty(2, 7, 2, 16).transpose(1, 2)
        out, lse = torch.ops.opsadv.flash_attention(q, k, k, None, False, None)
        assert out.stride() == q.stride() and lse.is_contiguous()
