"""The attention ops' layout contract.  Through torch.ops (what torch.compile and export see) out,
dq, dk, dv are contiguous whatever impl serves and whatever the inputs' strides, as the fake kernels
promise; eager calls return the impl's own layout (the cuda Triton kernels write (b, s, h, d) memory,
so transformers' transpose back is free)."""
from __future__ import annotations

import pytest
import torch

import opsadv
from opsadv.ops.sparse_attention.layout import SparseLayout


def _backends():
    out = ["reference"]
    try:
        with opsadv.use_backend("cuda"):
            out.append("cuda")
    except Exception:
        pass
    return out


def _inputs(kind, dt, g):
    b, s, d = 2, 37, 32
    if kind == "bshd":
        return [torch.randn(b, s, h, d, generator=g, dtype=dt).transpose(1, 2) for h in (4, 2, 2)]
    if kind == "fused_qkv":
        qkv = torch.randn(b, s, 3 * 4 * d, generator=g, dtype=dt)
        return list(qkv.view(b, s, 3, 4, d).permute(2, 0, 3, 1, 4))          # MHA: kv heads = q heads
    return [torch.randn(b, h, s, d, generator=g, dtype=dt) for h in (4, 2, 2)]


def _call(op, q, k, v, via_ops):
    lay = SparseLayout.sliding_window(q.shape[2], 9, causal=True, block_size=16)
    if not via_ops:
        return (opsadv.ops.flash_attention(q, k, v, causal=True) if op == "flash"
                else opsadv.ops.sparse_attention(q, k, v, lay))
    if op == "flash":
        return torch.ops.opsadv.flash_attention(q, k, v, None, True, None)[0]
    a = lay.op_args() if hasattr(lay, "op_args") else None
    if a is None:
        pytest.skip("no direct torch.ops arguments for a layout")
    return torch.ops.opsadv.sparse_attention(q, k, v, *a, None)[0]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", ["bshd", "fused_qkv", "contiguous"])
def test_torch_ops_boundary_layout_and_values(backend, kind):
    g = torch.Generator().manual_seed(1)
    dt = torch.float16 if backend == "cuda" else torch.float32
    q, k, v = (t.requires_grad_() for t in _inputs(kind, dt, g))
    with opsadv.use_backend(backend):
        out = torch.ops.opsadv.flash_attention(q, k, v, None, True, None)[0]
        out.backward(torch.randn(out.shape, generator=g, dtype=dt))
    assert out.is_contiguous()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.flash_attention(*(t.detach().double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=3e-3)


@pytest.mark.skipif("cuda" not in _backends(), reason="cuda backend unavailable (no GPU, no interpreter)")
@pytest.mark.parametrize("op", ["flash", "sparse"])
def test_eager_triton_output_transposes_back_for_free(op):
    g = torch.Generator().manual_seed(2)
    q, k, v = (t.requires_grad_() for t in _inputs("bshd", torch.float16, g))
    with opsadv.use_backend("cuda", impls={"flash_attention": "cuda.triton.flash_attention"}):
        out = _call(op, q, k, v, via_ops=False)
        out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
    assert out.transpose(1, 2).is_contiguous()
    lay = SparseLayout.sliding_window(37, 9, causal=True, block_size=16)
    with opsadv.use_backend("reference"):
        q64, k64, v64 = (t.detach().double() for t in (q, k, v))
        ref = (opsadv.ops.flash_attention(q64, k64, v64, causal=True) if op == "flash"
               else opsadv.ops.sparse_attention(q64, k64, v64, lay))
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("kind", ["bshd", "fused_qkv", "contiguous"])
def test_fake_kernels_promise_the_boundary_layout(kind):
    from torch._subclasses.fake_tensor import FakeTensorMode
    g = torch.Generator().manual_seed(0)
    real = _inputs(kind, torch.float32, g)
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in real)
        out, lse = torch.ops.opsadv.flash_attention(q, k, v, None, False, None)
        dq, dk, dv = torch.ops.opsadv.flash_attention_backward(out, q, k, v, out, lse, None, False, None)
    assert out.is_contiguous() and lse.is_contiguous()
    assert all(t.is_contiguous() for t in (dq, dk, dv))
