"""linear_cross_entropy against an independent float64 oracle (F.cross_entropy of the materialized logits, autograd
for the gradients): every backend on CPU (cuda's Triton kernel under the interpreter), odd shapes (one token, a
vocabulary that is no multiple of the kernel's block, ignored tokens, all tokens ignored), several chunks, every
feature, strided inputs, bad arguments, the custom ops' opcheck and a compiled graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv.errors import InvalidArgumentError

from conftest import rel_err, requires_gpu

LCE = opsadv.ops.linear_cross_entropy


def oracle(hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss=0.0,
           softcap=None):
    """The loss in float64 from F.cross_entropy of the whole logits (no code shared with the op)."""
    h = hidden.double().reshape(-1, hidden.shape[-1])
    z = h @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lab = labels.reshape(-1)
    loss = F.cross_entropy(z, lab, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    valid = lab != ignore_index
    if z_loss:
        loss = loss + torch.where(valid, z_loss * torch.logsumexp(z, -1) ** 2, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(labels.shape)
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()


def _inputs(n, h, v, seed, ignored=0.0, dtype=torch.float32, lead=None, bias=False):
    g = torch.Generator().manual_seed(seed)
    shape = lead or (n,)
    hidden = torch.randn(*shape, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype)
    labels = torch.randint(0, v, shape, generator=g)
    if ignored:
        labels[torch.rand(shape, generator=g) < ignored] = -100
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
    return hidden, weight, labels, b


def _check(backend, hidden, weight, labels, bias=None, tol=1e-5, **kw):
    leaves = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
    if bias is not None:
        leaves.append(bias.detach().requires_grad_())
    with opsadv.use_backend(backend):
        loss = LCE(leaves[0], leaves[1], labels, bias=leaves[2] if bias is not None else None, **kw)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = oracle(ref_leaves[0], ref_leaves[1], labels, ref_leaves[2] if bias is not None else None, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert rel_err(loss, ref) < tol
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = torch.autograd.grad(loss, leaves, g.float())
    want = torch.autograd.grad(ref, ref_leaves, g)
    for leaf, a, b in zip(leaves, got, want):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape
        assert rel_err(a, b) < tol
    return loss


BACKENDS = ["reference", "cuda"]

FEATURES = [
    dict(),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(softcap=4.0),
    dict(label_smoothing=0.05, z_loss=1e-2, softcap=3.0, reduction="none"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", FEATURES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "plain")
def test_matches_oracle(backend, kw):
    h, w, lab, _ = _inputs(37, 24, 1003, seed=hash(str(kw)) % 1000, ignored=0.2)
    _check(backend, h, w, lab, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,h,v", [(1, 8, 5), (3, 16, 127), (127, 8, 33), (5, 4, 4097)])
def test_odd_shapes_and_bias(backend, n, h, v):
    hid, w, lab, b = _inputs(n, h, v, seed=n + v, ignored=0.1 if n > 3 else 0.0, bias=True)
    _check(backend, hid, w, lab, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_leading_dims(backend):
    h, w, lab, _ = _inputs(0, 16, 77, seed=3, ignored=0.2, lead=(2, 3, 5))
    loss = _check(backend, h, w, lab, reduction="none")
    assert loss.shape == (2, 3, 5)


def test_several_chunks(monkeypatch):
    """A chunk of 64 rows over 130 tokens: three chunks (the last ragged), gradients accumulated across them."""
    from opsadv.backends.triton_common.linear_cross_entropy import linear_cross_entropy as impl
    monkeypatch.setattr(impl, "MAX_CHUNK", 64)
    assert impl.chunk_rows(130, 8, 10) == 64
    h, w, lab, b = _inputs(130, 8, 10, seed=11, ignored=0.3, bias=True)
    for kw in (dict(), dict(reduction="none", softcap=2.0)):
        with opsadv.trace() as t:
            _check("cuda", h, w, lab, b, **kw)
        assert "cuda.triton.linear_cross_entropy" in t.counts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_tokens_ignored(backend, reduction):
    """As F.cross_entropy: "mean" over no token is nan, "sum" / "none" 0; every gradient 0."""
    h, w, _, _ = _inputs(6, 8, 11, seed=5)
    lab = torch.full((6,), -100)
    hh, ww = h.requires_grad_(), w.requires_grad_()
    with opsadv.use_backend(backend):
        loss = LCE(hh, ww, lab, reduction=reduction)
    ref = F.cross_entropy(h.detach().double() @ w.detach().double().t(), lab, reduction=reduction)
    assert torch.equal(loss.isnan(), ref.isnan()) and rel_err(loss.nan_to_num(), ref.nan_to_num()) < 1e-6
    dh, dw = torch.autograd.grad(loss.sum() if reduction == "none" else loss, (hh, ww))
    assert not dh.any() and not dw.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_return_lse(backend):
    g = torch.Generator().manual_seed(2)
    big = torch.randn(40, 2, 12, generator=g)
    hidden = big[:, 1]                                 # rows strided
    weight = torch.randn(12, 90, generator=g).t()      # (V, H) transposed view
    lab = torch.randint(0, 90, (40,), generator=g)
    _check(backend, hidden, weight, lab)
    with opsadv.use_backend(backend):
        loss, lse = LCE(hidden, weight, lab, return_lse=True)
    want = torch.logsumexp(hidden.double() @ weight.double().t(), -1)
    assert lse.shape == (40,) and rel_err(lse, want) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_inputs_run_and_give_float32_loss(backend):
    h, w, lab, _ = _inputs(33, 16, 200, seed=9, ignored=0.1, dtype=torch.float16)
    with opsadv.use_backend(backend):
        loss = LCE(h, w, lab)
    assert loss.dtype == torch.float32
    assert rel_err(loss, oracle(h, w, lab)) < 5e-3


def test_grads_in_forward_and_recompute_agree():
    """With gradients wanted, "mean" / "sum" compute them in the forward and "none" recomputes in the backward:
    the same numbers (a "none" loss summed equals the "sum" loss)."""
    h, w, lab, b = _inputs(50, 8, 70, seed=4, ignored=0.2, bias=True)
    out = []
    for red in ("sum", "none"):
        leaves = [t.detach().requires_grad_() for t in (h, w, b)]
        with opsadv.use_backend("cuda"):
            loss = LCE(leaves[0], leaves[1], lab, bias=leaves[2], reduction=red)
        out.append(torch.autograd.grad(loss.sum(), leaves))
    for a, c in zip(*out):
        assert rel_err(a, c) < 1e-6


@pytest.mark.parametrize("bad,needle", [
    (dict(labels=torch.zeros(4)), "labels"),
    (dict(labels=torch.zeros(5, dtype=torch.long)), "labels"),
    (dict(weight=torch.randn(9, 7)), "weight"),
    (dict(bias=torch.randn(8)), "bias"),
    (dict(reduction="avg"), "reduction"),
    (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(z_loss=-1.0), "z_loss"),
    (dict(softcap=0.0), "softcap"),
    (dict(ignore_index=1.5), "ignore_index"),
    (dict(weight=torch.randn(9, 8, dtype=torch.float64)), "weight"),
])
def test_bad_arguments_name_the_argument(bad, needle):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(9, 8), labels=torch.zeros(4, dtype=torch.long))
    kw = {k: bad.pop(k) for k in list(bad) if k in args}
    args.update(kw)
    with pytest.raises(InvalidArgumentError) as e:
        LCE(args["hidden"], args["weight"], args["labels"], **bad)
    assert "linear_cross_entropy" in str(e.value) and needle in str(e.value)


def test_empty_calls_need_no_kernel():
    w = torch.randn(9, 8, requires_grad=True)
    loss = LCE(torch.randn(0, 8), w, torch.zeros(0, dtype=torch.long), reduction="sum")
    assert loss.item() == 0.0
    loss.backward()
    assert w.grad is not None and not w.grad.any()


def test_custom_ops_opcheck():
    h, w, lab, b = _inputs(9, 8, 21, seed=1, ignored=0.2, bias=True)
    with opsadv.use_backend("reference"):
        for in_fwd in (False, True):
            torch.library.opcheck(torch.ops.opsadv.linear_cross_entropy.default,
                                  (h.requires_grad_(), w.requires_grad_(), lab, b, -100, 0.1, "mean", 1e-3, 3.0,
                                   in_fwd))
        torch.library.opcheck(torch.ops.opsadv.linear_cross_entropy_backward.default,
                              (torch.ones(9), h.detach(), w.detach(), lab, b, torch.zeros(9), -100, 0.0, "none", 0.0,
                               None))


def test_compiled_graph_matches_eager():
    h, w, lab, _ = _inputs(20, 8, 50, seed=6, ignored=0.2)

    def step(hh, ww, ll):
        return LCE(hh, ww, ll, label_smoothing=0.1)
    leaves = [h.detach().requires_grad_(), w.detach().requires_grad_()]
    with opsadv.use_backend("reference"):
        loss = torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves, lab)
        got = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (h, w)]
    ref = oracle(*ref_leaves, lab, label_smoothing=0.1)
    assert rel_err(loss, ref) < 1e-5
    for a, b in zip(got, torch.autograd.grad(ref, ref_leaves)):
        assert rel_err(a, b) < 1e-5


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_oracle(dtype):
    h, w, lab, b = _inputs(3000, 256, 32003, seed=12, ignored=0.1, dtype=dtype, bias=True)
    h, w, lab, b = h.cuda(), w.cuda(), lab.cuda(), b.cuda()
    with opsadv.trace() as t:
        _check("cuda", h, w, lab, b, tol=2e-2, label_smoothing=0.1, z_loss=1e-4)
    assert "cuda.triton.linear_cross_entropy" in t.counts


def test_float16_mean_gradients_do_not_underflow():
    """"mean" over many tokens: d loss / d logits is softmax / n_valid, about 6e-8 here (1024 tokens x 16384
    columns), below float16's smallest subnormal; the kernel folds N / n_valid and dh / dW are scaled by 1 / N after."""
    h, w, lab, _ = _inputs(1024, 8, 16384, seed=13, ignored=0.1, dtype=torch.float16)
    leaves = [h.requires_grad_(), w.requires_grad_()]
    with opsadv.use_backend("cuda"):
        loss = LCE(*leaves, lab)
    got = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (h, w)]
    want = torch.autograd.grad(oracle(*ref_leaves, lab), ref_leaves)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 5e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_backward_through_one_call(backend):
    """Gradients computed in the forward are scaled in place by the backward (no second weight-sized buffer): a
    second backward through the same graph raises with the way out; reduction='none' recomputes and allows it."""
    h, w, lab, _ = _inputs(12, 8, 30, seed=14, ignored=0.2)
    leaves = [h.requires_grad_(), w.requires_grad_()]
    with opsadv.use_backend(backend):
        loss = LCE(*leaves, lab)
        none = LCE(*leaves, lab, reduction="none").sum()
    torch.autograd.grad(loss, leaves, retain_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy.*reduction='none'"):
        torch.autograd.grad(loss, leaves)
    a = torch.autograd.grad(none, leaves, retain_graph=True)
    b = torch.autograd.grad(none, leaves)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
