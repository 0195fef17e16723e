"""linear_cross_entropy_stats (the vocab-parallel loss's per-shard work) against an independent float64 oracle (the
slice's whole logits, torch.logsumexp / gather / sum, autograd for the gradients): the reference impl and cuda's
Triton kernels under the interpreter (float32), odd shapes (1, 3, 127 tokens; slices that are no multiple of the
kernel's block; labels before, inside and after the slice; ignored tokens), bias, softcap, several chunks, empty
calls, explain, bad arguments and the custom ops' opcheck.  No spawn: the 2-rank tests are in
test_distributed_sharding.py."""
from __future__ import annotations

import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError
from opsadv.ops.linear_cross_entropy.stats import stats_backward

from conftest import rel_err

STATS = opsadv.ops.linear_cross_entropy_stats


def oracle(hidden, weight, labels, bias, softcap, start, ignore_index=-100):
    """(3, N) in float64 from the materialized logits (no code shared with the op)."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    local = labels - start
    mine = (labels != ignore_index) & (local >= 0) & (local < weight.shape[0])
    tgt = torch.zeros(z.shape[0], dtype=torch.float64)
    rows = mine.nonzero()[:, 0]
    tgt = tgt.index_put((rows,), z[rows, local[rows]])
    return torch.stack([torch.logsumexp(z, -1), tgt, z.sum(-1)])


def _inputs(n, h, v, start, seed, bias=False, ignored=0.25):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h ** 0.5
    labels = torch.randint(0, start + 2 * v + 3, (n,), generator=g)     # before, inside and after the slice
    labels[torch.rand(n, generator=g) < ignored] = -100
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    return hidden, weight, labels, b


CASES = [  # (tokens, hidden, slice rows, vocab_start, bias, softcap)
    (1, 8, 5, 0, False, None),
    (3, 16, 37, 11, True, None),
    (3, 8, 17, 4, False, 3.0),
    (127, 24, 203, 100, True, 5.0),        # two chunks of tokens; 203 rows: no multiple of the block
]


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("n, h, v, start, bias, softcap", CASES)
def test_matches_oracle(backend, n, h, v, start, bias, softcap):
    hidden, weight, labels, b = _inputs(n, h, v, start, seed=n + v, bias=bias)
    leaves = [t.requires_grad_() for t in (hidden, weight, b) if t is not None]
    with opsadv.use_backend(backend, strict=True), opsadv.trace() as t:
        got = STATS(leaves[0], leaves[1], labels, bias=b, softcap=softcap, vocab_start=start)
        g = torch.randn(3, n, generator=torch.Generator().manual_seed(3))
        grads = torch.autograd.grad(got, leaves, g)
    assert t.counts == {f"{backend}.{'triton.' if backend == 'cuda' else ''}linear_cross_entropy_stats": 2}, t.counts
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    want = oracle(ref_leaves[0], ref_leaves[1], labels, ref_leaves[2] if bias else None, softcap, start)
    assert got.dtype == torch.float32 and got.shape == (3, n)
    assert rel_err(got, want) < 1e-6
    for a, w in zip(grads, torch.autograd.grad(want, ref_leaves, g.double())):
        assert rel_err(a, w) < 1e-5


def test_leading_dims_and_half_inputs():
    hidden, weight, labels, _ = _inputs(12, 8, 29, 5, seed=4)
    with opsadv.use_backend("cuda", strict=True):
        got = STATS(hidden.half().reshape(3, 4, 8), weight.half(), labels.reshape(3, 4), vocab_start=5)
    assert got.shape == (3, 3, 4) and got.dtype == torch.float32
    assert rel_err(got.reshape(3, 12), oracle(hidden.half(), weight.half(), labels, None, None, 5)) < 2e-3


def test_stats_backward_is_the_autograd_backward():
    """stats_backward (what the vocab-parallel Function calls) gives the op's own autograd gradients."""
    hidden, weight, labels, b = _inputs(20, 8, 33, 3, seed=5, bias=True)
    g = torch.randn(3, 20)
    with opsadv.use_backend("cuda", strict=True):
        leaves = [t.requires_grad_() for t in (hidden, weight, b)]
        out = STATS(*leaves[:2], labels, bias=leaves[2], softcap=2.0, vocab_start=3)
        want = torch.autograd.grad(out, leaves, g)
        got = stats_backward(g, hidden.detach(), weight.detach(), labels, b.detach(), out.detach(), softcap=2.0,
                             vocab_start=3)
    for a, w in zip(got, want):
        assert torch.equal(a, w)


def test_empty_calls_need_no_kernel():
    w = torch.randn(0, 8, requires_grad=True)
    h = torch.randn(4, 8, requires_grad=True)
    with opsadv.use_backend("cuda", strict=True), opsadv.trace() as t:
        out = STATS(h, w, torch.zeros(4, dtype=torch.long))          # a slice of no row (more ranks than rows)
        out.sum().backward()
        none = STATS(torch.randn(0, 8), torch.randn(5, 8), torch.zeros(0, dtype=torch.long))
    assert not t.counts
    assert torch.equal(out[0], torch.full((4,), float("-inf"))) and not out[1:].any()
    assert h.grad is not None and not h.grad.any() and none.shape == (3, 0)


def test_explain_names_the_kernel():
    hidden, weight, labels, b = _inputs(9, 8, 21, 2, seed=6, bias=True)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("linear_cross_entropy_stats", hidden, weight, labels, bias=b, softcap=3.0, vocab_start=2)
        assert e.chosen == "cuda.triton.linear_cross_entropy_stats", str(e)
        # an explicit backend that cannot serve the call says why (the call raises), never a silent fallback
        e = opsadv.explain("linear_cross_entropy_stats", hidden.double(), weight.double(), labels, backward=True)
        assert e.chosen is None and "dtype float64 not in" in str(e), str(e)
    with opsadv.use_backend("reference"):
        e = opsadv.explain("linear_cross_entropy_stats", hidden.double(), weight.double(), labels, backward=True)
        assert e.chosen == "reference.linear_cross_entropy_stats", str(e)


@pytest.mark.parametrize("bad, needle", [
    (dict(vocab_start=-1), "vocab_start"),
    (dict(vocab_start=2.0), "vocab_start"),
    (dict(labels=torch.zeros(4)), "labels"),
    (dict(weight=torch.randn(9, 7)), "weight"),
    (dict(bias=torch.randn(8)), "bias"),
    (dict(softcap=-1.0), "softcap"),
])
def test_bad_arguments_name_the_argument(bad, needle):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(9, 8), labels=torch.zeros(4, dtype=torch.long))
    args.update({k: bad.pop(k) for k in list(bad) if k in args})
    with pytest.raises(InvalidArgumentError) as e:
        STATS(args["hidden"], args["weight"], args["labels"], **bad)
    assert "linear_cross_entropy_stats: argument" in str(e.value) and needle in str(e.value)


def test_stats_backward_refuses_a_wrong_gradient_shape():
    h, w, lab, _ = _inputs(4, 8, 9, 0, seed=7)
    with pytest.raises(InvalidArgumentError, match=r"argument 'grad'.*\(3, 4\).*\(4,\)"):
        stats_backward(torch.ones(4), h, w, lab, None, torch.zeros(3, 4))


def test_custom_ops_opcheck():
    h, w, lab, b = _inputs(9, 8, 21, 4, seed=8, bias=True)
    with opsadv.use_backend("reference"):
        torch.library.opcheck(torch.ops.opsadv.linear_cross_entropy_stats.default,
                              (h.requires_grad_(), w.requires_grad_(), lab, b, -100, 3.0, 4))
        stats = STATS(h.detach(), w.detach(), lab, bias=b, vocab_start=4)
        torch.library.opcheck(torch.ops.opsadv.linear_cross_entropy_stats_backward.default,
                              (torch.randn(3, 9), h.detach(), w.detach(), lab, b, stats, -100, None, 4))
