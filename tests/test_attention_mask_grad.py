"""flash_attention passes a gradient to an additive float mask that requires one (T5's relative position bias
reaches the scores through the mask: without it the bias trained on nothing in a converted model).  Against
plain torch autograd in float64: broadcast mask shapes, GQA, causal with s_q != s_k, -inf entries and a fully
masked row; eager and compiled (the op's registered autograd), and the mask's gradient only where it needs one."""
import importlib
import pytest
import torch
import torch._dynamo

import opsadv

from conftest import rel_err


def _plain(q, k, v, mask, causal, scale):
    rep = q.shape[1] // k.shape[1]
    kf, vf = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ kf.transpose(-1, -2) * scale + mask
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vf


def _case(seed, mask_shape, b=2, hq=4, hk=2, sq=7, sk=11):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hk, sk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.randn(*mask_shape, generator=g, dtype=torch.float64)
    mask[..., -1, 2] = float("-inf")                  # a masked-out entry
    dout = torch.randn(b, hq, sq, 16, generator=g, dtype=torch.float64)
    return q, k, v, mask, dout


SHAPES = [(1, 4, 7, 11), (2, 1, 7, 11), (7, 11), (2, 4, 1, 11)]


def _grads(fn, q, k, v, mask, dout, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    out = fn(*leaves, causal)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("mask_shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_float_mask_gets_its_gradient(mask_shape, causal, reference_backend):
    q, k, v, mask, dout = _case(1, mask_shape)
    want_out, want = _grads(lambda q, k, v, m, c: _plain(q, k, v, m, c, 0.3), q, k, v, mask, dout, causal)
    got_out, got = _grads(lambda q, k, v, m, c: opsadv.ops.flash_attention(q, k, v, causal=c, scale=0.3, attn_mask=m),
                          q, k, v, mask, dout, causal)
    assert rel_err(got_out, want_out) < 1e-10
    for name, g, w in zip(("q", "k", "v", "mask"), got, want):
        assert g.shape == w.shape and torch.isfinite(g).all(), name
        assert rel_err(g, w) < 1e-10, (name, rel_err(g, w))


def test_fully_masked_row_gives_no_mask_gradient(reference_backend):
    q, k, v, mask, dout = _case(2, (2, 4, 7, 11))
    mask[0, 1, 3] = float("-inf")
    _, (_, _, _, dm) = _grads(lambda q, k, v, m, c: opsadv.ops.flash_attention(q, k, v, attn_mask=m), q, k, v, mask,
                              dout, False)
    assert (dm[0, 1, 3] == 0).all() and torch.isfinite(dm).all()


def test_mask_without_grad_gets_none_and_costs_nothing(reference_backend, monkeypatch):
    A = importlib.import_module("opsadv.ops.flash_attention")
    calls = []
    real = A.mask_grad
    monkeypatch.setattr(A, "mask_grad", lambda *a: calls.append(1) or real(*a))
    q, k, v, mask, dout = _case(3, (1, 4, 7, 11))
    q.requires_grad_()
    opsadv.ops.flash_attention(q, k, v, attn_mask=mask).backward(dout)
    assert q.grad is not None and not calls
    m = mask.clone().requires_grad_()
    opsadv.ops.flash_attention(q, k, v, attn_mask=m).backward(dout)
    assert calls and m.grad is not None


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_float_mask_gradient(causal, reference_backend):
    """The registered autograd (torch.compile's path) computes it too, in the compiled backward graph."""
    q, k, v, mask, dout = _case(4, (2, 1, 7, 11))
    want_out, want = _grads(lambda q, k, v, m, c: _plain(q, k, v, m, c, 0.25), q, k, v, mask, dout, causal)
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda q, k, v, m, c: opsadv.ops.flash_attention(q, k, v, causal=c, scale=0.25,
                                                                           attn_mask=m),
                          fullgraph=True, backend="aot_eager")
        got_out, got = _grads(f, q, k, v, mask, dout, causal)
    finally:
        torch._dynamo.reset()
    assert rel_err(got_out, want_out) < 1e-10
    for name, g, w in zip(("q", "k", "v", "mask"), got, want):
        assert rel_err(g, w) < 1e-10, (name, rel_err(g, w))


def _min_masked_case():
    """Rows masked with float32's finfo.min (transformers' additive padding mask; Doge adds its dynamic mask on
    top): a fully masked row's scores all round to the same value, so softmax is uniform there, and a math impl
    that normalizes by exp(s - lse) sums that row to n, not 1 (lse = min + log(n) rounds back to min)."""
    q, k, v, mask, dout = _case(5, (2, 4, 7, 11))
    lo = torch.finfo(torch.float32).min
    mask[0, 1, 3] = lo                                # fully masked
    mask[1, 2, 5] = lo + torch.rand(11, dtype=torch.float64)   # fully masked plus Doge's (absorbed) dynamic values
    mask[0, 0, 2, :5] = lo                            # partly masked
    return q, k, v, mask, dout


def test_min_masked_rows_match_softmax(reference_backend):
    q, k, v, mask, dout = _min_masked_case()
    want_out, want = _grads(lambda q, k, v, m, c: _plain(q, k, v, m, c, 0.3), q, k, v, mask, dout, False)
    got_out, got = _grads(lambda q, k, v, m, c: opsadv.ops.flash_attention(q, k, v, scale=0.3, attn_mask=m),
                          q, k, v, mask, dout, False)
    rep = q.shape[1] // k.shape[1]
    assert rel_err(got_out[0, 1, 3], v.repeat_interleave(rep, 1)[0, 1].mean(0)) < 1e-12     # uniform, not 11x
    assert rel_err(got_out, want_out) < 1e-10
    for name, g, w in zip(("q", "k", "v", "mask"), got, want):
        assert rel_err(g, w) < 1e-10, (name, rel_err(g, w))


def test_min_masked_rows_jetson_math_attention():
    from opsadv.backends.jetson.attention import _bwd, _fwd
    q, k, v, mask, dout = _min_masked_case()
    want_out, want = _grads(lambda q, k, v, m, c: _plain(q, k, v, m, c, 0.3), q, k, v, mask, dout, False)
    out, lse = _fwd(None, q, k, v, mask, False, 0.3)
    assert rel_err(out, want_out) < 1e-10
    dq, dk, dv = _bwd(None, dout, q, k, v, out, lse, mask, False, 0.3)
    for name, g, w in zip(("q", "k", "v"), (dq, dk, dv), want):
        assert rel_err(g, w) < 1e-10, (name, rel_err(g, w))
