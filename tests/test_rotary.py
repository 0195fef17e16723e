"""The rotary_embedding op: the cuda backend's Triton kernel (interpreter on CPU, the GPU where present) and the
reference against independent float64 formulas (transformers' rotate_half, GPT-J's rotate-every-two), forward and
backward, odd / strided / partial / position-id shapes, poisoned outputs; gradients of cos / sin; compile; errors."""
import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError

from conftest import HAS_CUDA, rel_err, requires_gpu

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def _rotate_every_two(x):
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((-b, a), -1).flatten(-2)


def _oracle(q, k, cos, sin, position_ids=None, interleaved=False):
    """transformers' apply_rotary_pos_emb (half layout, partial rotary as GPT-NeoX) / GPT-J's (interleaved)."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    rot = _rotate_every_two if interleaved else _rotate_half
    out = []
    for x in (q, k):
        xr, xp = x[..., :r], x[..., r:]
        out.append(torch.cat((xr * cos + rot(xr) * sin, xp), -1))
    return out


def _inputs(b, hq, hk, s, d, r, dtype, *, bshd=False, cos_batch=False, positions=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).transpose(1, 2) if bshd else torch.randn(b, hq, s, d, generator=g)
    k = torch.randn(b, hk, s, d, generator=g)
    if positions:
        cos, sin = torch.randn(positions, r, generator=g), torch.randn(positions, r, generator=g)
        pos = torch.randint(0, positions, (b, s), generator=g)
    else:
        shape = (b, s, r) if cos_batch else (s, r)
        cos, sin, pos = torch.randn(shape, generator=g), torch.randn(shape, generator=g), None
    to = lambda t: t.to(device=DEV, dtype=dtype)           # noqa: E731
    return to(q), to(k), to(cos), to(sin), (pos.to(DEV) if pos is not None else None)


SHAPES = [  # b, hq, hk, s, d, r, kwargs
    (1, 1, 1, 1, 2, 2, {}),
    (2, 3, 1, 127, 24, 24, {"bshd": True, "cos_batch": True}),
    (1, 4, 2, 5, 40, 16, {}),                      # partial rotary (GPT-NeoX / Phi)
    (2, 2, 2, 3, 12, 12, {"interleaved": True}),
    (2, 4, 4, 9, 16, 10, {"positions": 50}),       # gapped position ids into a table, partial
    (3, 17, 5, 7, 64, 64, {"bshd": True}),          # head counts not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "x".join(map(str, c[:6])) + "".join(f"-{k}" for k in c[6]))
@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_matches_float64_oracle(case, dtype, backend):
    b, hq, hk, s, d, r, kw = case
    inter = kw.get("interleaved", False)
    q, k, cos, sin, pos = _inputs(b, hq, hk, s, d, r, dtype, bshd=kw.get("bshd", False),
                                  cos_batch=kw.get("cos_batch", False), positions=kw.get("positions", 0), seed=b * s + d)
    q2, k2 = q.detach().requires_grad_(), k.detach().requires_grad_()
    with opsadv.use_backend(backend), opsadv.trace() as t:
        oq, ok = opsadv.ops.rotary_embedding(q2, k2, cos, sin, position_ids=pos, interleaved=inter)
        gq, gk = torch.randn_like(oq), torch.randn_like(ok)
        dq, dk = torch.autograd.grad((oq, ok), (q2, k2), (gq, gk))
    assert t.counts[f"{backend}.{'triton.' if backend == 'cuda' else ''}rotary_embedding"] == 2   # fwd and bwd
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    rq, rk = _oracle(q64, k64, cos.double(), sin.double(), pos, inter)
    rdq, rdk = torch.autograd.grad((rq, rk), (q64, k64), (gq.double(), gk.double()))
    for got, want in ((oq, rq), (ok, rk), (dq, rdq), (dk, rdk)):
        assert got.shape == want.shape and got.dtype == dtype
        assert not got.isnan().any()              # the cuda impl poisons its outputs on CPU
        assert rel_err(got, want) < TOL[dtype], (rel_err(got, want), got.stride())


def test_outputs_are_stored_token_major():
    """q' and k' are (b, h, s, d) views of (b, s, h, d) memory: transformers' transpose back is free."""
    q, k, cos, sin, _ = _inputs(2, 4, 2, 5, 8, 8, torch.float32)
    with opsadv.use_backend("cuda"):
        oq, ok = opsadv.ops.rotary_embedding(q, k, cos, sin)
    assert oq.transpose(1, 2).is_contiguous() and ok.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("positions", [0, 11])
def test_table_gradients_float64(positions):
    """cos / sin that require grad get their gradients (summed over heads, batch, and scattered into a table)."""
    q, k, cos, sin, pos = _inputs(2, 3, 1, 4, 8, 6, torch.float64, positions=positions, seed=3)
    ins = [t.requires_grad_() for t in (q, k, cos, sin)]
    with opsadv.use_backend("reference"):
        assert torch.autograd.gradcheck(lambda *a: opsadv.ops.rotary_embedding(*a, position_ids=pos), ins)


def test_strided_last_dim_and_one_output_used():
    q, k, cos, sin, _ = _inputs(1, 2, 2, 3, 16, 16, torch.float32, seed=9)
    qs = torch.randn(1, 2, 3, 32, device=DEV)[..., ::2]        # last dim strided: copied first
    q2 = qs.detach().requires_grad_()
    with opsadv.use_backend("cuda"):
        oq, _ = opsadv.ops.rotary_embedding(q2, k, cos, sin)
        (dq,) = torch.autograd.grad(oq.sum(), q2)
    rq, _ = _oracle(qs.double(), k.double(), cos.double(), sin.double())
    assert rel_err(oq, rq) < 1e-6
    assert rel_err(dq, _oracle_bwd_ones(cos, sin, qs.shape)) < 1e-6


def _oracle_bwd_ones(cos, sin, shape):
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    y, _ = _oracle(x, torch.zeros(1, 1, shape[2], shape[3], dtype=torch.float64), cos.double(), sin.double())
    return torch.autograd.grad(y.sum(), x)[0]


def test_compile_fullgraph_forward_backward():
    q, k, cos, sin, _ = _inputs(2, 4, 2, 6, 16, 16, torch.float32, seed=4)

    def f(q, k):
        a, b = opsadv.ops.rotary_embedding(q, k, cos, sin)
        return (a * 2).sum() + b.square().sum()
    q2, k2 = q.detach().requires_grad_(), k.detach().requires_grad_()
    with opsadv.use_backend("cuda"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q2, k2).backward()
    q3, k3 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    a, b = _oracle(q3, k3, cos.double(), sin.double())
    ((a * 2).sum() + b.square().sum()).backward()
    assert rel_err(q2.grad, q3.grad) < 1e-6 and rel_err(k2.grad, k3.grad) < 1e-6


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_custom_ops_match_their_fakes(backend):
    """Every impl's outputs have the layout the fakes promise (compiled graphs are planned with it)."""
    q, k, cos, sin, _ = _inputs(2, 4, 2, 6, 16, 16, torch.float32, seed=5)
    with opsadv.use_backend(backend):
        torch.library.opcheck(torch.ops.opsadv.rotary_embedding.default, (q, k, cos, sin, None, False),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.opsadv.rotary_embedding_backward.default, (q, k, cos, sin, None, False),
                              test_utils=("test_schema", "test_faketensor"))
        oq, _ = torch.ops.opsadv.rotary_embedding(q, k, cos, sin, None, False)
    assert oq.transpose(1, 2).is_contiguous()


def test_explain_names_the_kernel():
    q, k, cos, sin, _ = _inputs(1, 2, 1, 3, 8, 8, torch.float32)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("rotary_embedding", q, k, cos, sin)
    assert e.chosen == "cuda.triton.rotary_embedding"
    with opsadv.use_backend("auto"):
        e = opsadv.explain("rotary_embedding", q, k, cos, sin, interleaved=True, backward=True)
    assert e.chosen is not None


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, c, s: (q[0], k, c, s, {}), "rank 4"),
    (lambda q, k, c, s: (q, k[:, :, :2], c, s, {}), "S=3"),
    (lambda q, k, c, s: (q, k.half(), c, s, {}), "same as q"),
    (lambda q, k, c, s: (q, k, c[:, :7], s[:, :7], {}), "even last dim"),
    (lambda q, k, c, s: (q, k, c, s[:, :4], {}), "same as cos"),
    (lambda q, k, c, s: (q, k, c[:2], s[:2], {}), "without position_ids"),
    (lambda q, k, c, s: (q, k, c, s, {"rotary_dim": 4}), "rotary_dim"),
    (lambda q, k, c, s: (q, k, c, s, {"interleaved": 1}), "interleaved"),
    (lambda q, k, c, s: (q, k, c, s, {"position_ids": torch.zeros(3)}), "int32 / int64"),
    (lambda q, k, c, s: (q, k, c, s, {"position_ids": torch.zeros(2, 3, dtype=torch.long)}), "shape"),
])
def test_bad_arguments_name_op_and_argument(bad, match):
    q, k, cos, sin, _ = _inputs(1, 2, 1, 3, 8, 8, torch.float32)
    q, k, cos, sin = q.cpu(), k.cpu(), cos.cpu(), sin.cpu()
    *args, kw = bad(q, k, cos, sin)
    with pytest.raises(InvalidArgumentError, match="rotary_embedding") as e:
        opsadv.ops.rotary_embedding(*args, **kw)
    assert match in str(e.value)


@requires_gpu
@pytest.mark.parametrize("inter", [False, True])
def test_bf16_on_gpu(inter):
    q, k, cos, sin, _ = _inputs(4, 32, 8, 257, 128, 128, torch.bfloat16, bshd=True, cos_batch=True)
    with opsadv.use_backend("cuda"):
        oq, ok = opsadv.ops.rotary_embedding(q, k, cos, sin, interleaved=inter)
    rq, rk = _oracle(q.double(), k.double(), cos.double(), sin.double(), None, inter)
    assert rel_err(oq, rq) < TOL[torch.bfloat16] and rel_err(ok, rk) < TOL[torch.bfloat16]
