"""The qk_norm_rotary op: the cuda backend's Triton kernels (interpreter on CPU, the GPU where present) and the
reference against an independent float64 oracle (RMSNorm over head_dim, then transformers' rotate_half / GPT-J's
rotate-every-two rotary), forward and gradients of q, k and both weights; odd / strided / expanded / partial /
position-id shapes, poisoned outputs, transformers' own Qwen3 / Gemma-3 modules, opcheck, compile, errors."""
import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError

from conftest import HAS_CUDA, rel_err, requires_gpu

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
IMPL = {"cuda": "cuda.triton.qk_norm_rotary", "reference": "reference.qk_norm_rotary"}


def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def _rotate_every_two(x):
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((-b, a), -1).flatten(-2)


def _oracle(q, k, cos, sin, qw, kw, eps=1e-6, offset=0.0, position_ids=None, interleaved=False):
    """Float64: x * rsqrt(mean(x^2) + eps) * (offset + w) per (token, head) row, then x * cos + rot(x) * sin on the
    first R features (the rest pass through), as transformers' RMSNorm modules and apply_rotary_pos_emb."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    rot = _rotate_every_two if interleaved else _rotate_half
    out = []
    for x, w in ((q, qw), (k, kw)):
        n = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)
        nr, npass = n[..., :r], n[..., r:]
        out.append(torch.cat((nr * cos + rot(nr) * sin, npass), -1))
    return out


def _inputs(b, hq, hk, s, d, r, dtype, *, bshd=False, table="plain", positions=0, seed=0):
    """Fresh random q, k (optionally (b, s, h, d) memory viewed as (b, h, s, d)), cos / sin and weights.  table:
    plain (S, R); batch (B, S, R); expanded (1, S, R) expanded to (B, S, R) (stride 0); transposed (an (R, S)
    tensor's transpose: the last dim strided)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).transpose(1, 2) if bshd else torch.randn(b, hq, s, d, generator=g)
    k = torch.randn(b, s, hk, d, generator=g).transpose(1, 2) if bshd else torch.randn(b, hk, s, d, generator=g)
    qw, kw = 1 + 0.5 * torch.randn(d, generator=g), 1 + 0.5 * torch.randn(d, generator=g)
    pos = None
    if positions:
        cos, sin = torch.randn(positions, r, generator=g), torch.randn(positions, r, generator=g)
        pos = torch.randint(0, positions, (b, s), generator=g)
    elif table == "batch":
        cos, sin = torch.randn(b, s, r, generator=g), torch.randn(b, s, r, generator=g)
    elif table == "expanded":
        cos, sin = torch.randn(1, s, r, generator=g).expand(b, s, r), torch.randn(1, s, r, generator=g).expand(b, s, r)
    elif table == "transposed":
        cos, sin = torch.randn(r, s, generator=g).t(), torch.randn(r, s, generator=g).t()
    else:
        cos, sin = torch.randn(s, r, generator=g), torch.randn(s, r, generator=g)
    to = lambda t: t.to(device=DEV, dtype=dtype)           # noqa: E731  (views stay views: same dtype and device)
    return (to(q), to(k), to(cos), to(sin), to(qw), to(kw), (pos.to(DEV) if pos is not None else None))


SHAPES = [  # b, hq, hk, s, d, r, kwargs
    (1, 1, 1, 1, 64, 64, {}),                                         # one token
    (2, 3, 1, 3, 64, 64, {"bshd": True, "table": "batch"}),           # GQA, transformers' layout
    (1, 1, 3, 127, 64, 32, {"bshd": True, "table": "expanded"}),      # partial rotary, expanded tables
    (2, 3, 3, 5, 64, 64, {"table": "transposed", "offset": 1.0}),     # Gemma-3's (1 + w), strided tables
    (2, 2, 2, 3, 12, 12, {"interleaved": True, "eps": 1e-5}),
    (2, 3, 1, 9, 16, 10, {"positions": 50}),                          # gapped position ids into a table, partial
]


def _ids(c):
    return "x".join(map(str, c[:6])) + "".join(f"-{k}" for k in c[6])


def _run(backend, q, k, cos, sin, qw, kw, pos, kwargs, seed=1):
    """The op forward and backward (random output gradients) under backend: outputs, grads and the gradients."""
    ins = [t.detach().requires_grad_() for t in (q, k, qw, kw)]
    with opsadv.use_backend(backend), opsadv.trace() as t:
        oq, ok = opsadv.ops.qk_norm_rotary(ins[0], ins[1], cos, sin, ins[2], ins[3], position_ids=pos, **kwargs)
        g = torch.Generator().manual_seed(seed)
        gq = torch.randn(oq.shape, generator=g).to(oq.device, oq.dtype)
        gk = torch.randn(ok.shape, generator=g).to(ok.device, ok.dtype)
        grads = torch.autograd.grad((oq, ok), ins, (gq, gk))
    return (oq, ok), (gq, gk), grads, t.counts


def _oracle_grads(q, k, cos, sin, qw, kw, pos, kwargs, gq, gk):
    ins = [t.detach().double().requires_grad_() for t in (q, k, qw, kw)]
    kw64 = {"eps": kwargs.get("eps", 1e-6), "offset": kwargs.get("weight_offset", 0.0),
            "interleaved": kwargs.get("interleaved", False)}
    rq, rk = _oracle(ins[0], ins[1], cos.double(), sin.double(), ins[2], ins[3], position_ids=pos, **kw64)
    return (rq, rk), torch.autograd.grad((rq, rk), ins, (gq.double(), gk.double()))


def _op_kwargs(kw):
    out = {"interleaved": kw.get("interleaved", False)}
    if "offset" in kw:
        out["weight_offset"] = kw["offset"]
    if "eps" in kw:
        out["eps"] = kw["eps"]
    return out


# (the 127-token case runs in float32 only: ~16 s a dtype under the interpreter, a program per token)
CELLS = [(c, dt) for c in SHAPES for dt in ((torch.float32,) if c[3] == 127 else (torch.float32, torch.float16))]


@pytest.mark.parametrize("case,dtype", CELLS, ids=[f"{_ids(c)}-{str(dt)[6:]}" for c, dt in CELLS])
@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_matches_float64_oracle(case, dtype, backend):
    b, hq, hk, s, d, r, kw = case
    q, k, cos, sin, qw, kw_, pos = _inputs(b, hq, hk, s, d, r, dtype, bshd=kw.get("bshd", False),
                                           table=kw.get("table", "plain"), positions=kw.get("positions", 0),
                                           seed=b * s + d + hq)
    opkw = _op_kwargs(kw)
    outs, (gq, gk), grads, counts = _run(backend, q, k, cos, sin, qw, kw_, pos, opkw)
    assert counts[IMPL[backend]] == 2, counts                       # fwd and bwd
    want, wgrads = _oracle_grads(q, k, cos, sin, qw, kw_, pos, opkw, gq, gk)
    for name, got, w in zip(("q'", "k'", "dq", "dk", "dq_weight", "dk_weight"), (*outs, *grads), (*want, *wgrads)):
        assert got.shape == w.shape and got.dtype == dtype, name
        assert not got.isnan().any(), name              # the cuda impl poisons its outputs on CPU
        assert rel_err(got, w) < TOL[dtype], (name, rel_err(got, w))


def test_outputs_are_stored_token_major_and_gradients_match_inputs():
    q, k, cos, sin, qw, kw, _ = _inputs(2, 4, 2, 5, 8, 8, torch.float32, bshd=True)
    with opsadv.use_backend("cuda"):
        oq, ok = opsadv.ops.qk_norm_rotary(q, k, cos, sin, qw, kw)
    assert oq.transpose(1, 2).is_contiguous() and ok.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("positions", [0, 11])
def test_gradcheck_float64_with_table_gradients(positions):
    """q, k, both weights and cos / sin (summed over heads and batch, or scattered into a table) by finite
    differences, float64, reference backend."""
    q, k, cos, sin, qw, kw, pos = _inputs(2, 3, 1, 4, 8, 6, torch.float64, positions=positions, seed=3)
    ins = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin, qw, kw)]
    with opsadv.use_backend("reference"):
        assert torch.autograd.gradcheck(
            lambda *a: opsadv.ops.qk_norm_rotary(*a, position_ids=pos, weight_offset=0.5), ins)


def test_one_output_used_and_strided_last_dim():
    """Only q' reaches the loss (dk' is None for the backward); q's last dim is strided (copied first)."""
    q, k, cos, sin, qw, kw, _ = _inputs(1, 2, 2, 3, 16, 16, torch.float32, seed=9)
    qs = torch.randn(1, 2, 3, 32, device=DEV)[..., ::2]
    ins = [t.detach().requires_grad_() for t in (qs, k, qw, kw)]
    with opsadv.use_backend("cuda"):
        oq, _ = opsadv.ops.qk_norm_rotary(ins[0], ins[1], cos, sin, ins[2], ins[3])
        dq, dk, dqw, dkw = torch.autograd.grad(oq.sum(), ins)
    r64 = [t.detach().double().requires_grad_() for t in (qs, k, qw, kw)]
    rq, _ = _oracle(r64[0], r64[1], cos.double(), sin.double(), r64[2], r64[3])
    wq, wk, wqw, wkw = torch.autograd.grad(rq.sum(), r64, allow_unused=True)
    assert rel_err(oq, rq) < 1e-6 and rel_err(dq, wq) < 1e-5 and rel_err(dqw, wqw) < 1e-5
    assert wk is None and not dk.any() and not dkw.any()


def test_repeated_training_calls_take_the_fast_path_with_the_same_results():
    q, k, cos, sin, qw, kw, _ = _inputs(2, 2, 1, 3, 16, 16, torch.float32, bshd=True, seed=5)
    runs = [_run("cuda", q, k, cos, sin, qw, kw, None, {}, seed=2) for _ in range(3)]
    for outs, _, grads, counts in runs[1:]:
        assert counts["cuda.triton.qk_norm_rotary"] == 2
        for a, b in zip((*outs, *grads), (*runs[0][0], *runs[0][2])):
            assert torch.equal(a, b)


def test_empty_operands_give_empty_results_and_gradients():
    for shape_q, shape_k, s in (((1, 2, 0, 8), (1, 1, 0, 8), 0), ((0, 2, 3, 8), (0, 1, 3, 8), 3)):
        q, k = torch.randn(shape_q, requires_grad=True), torch.randn(shape_k, requires_grad=True)
        w = torch.ones(8, requires_grad=True)
        cos, sin = torch.randn(s, 8), torch.randn(s, 8)
        with opsadv.use_backend("cuda"), opsadv.trace() as t:
            oq, ok = opsadv.ops.qk_norm_rotary(q, k, cos, sin, w, w)
            (oq.sum() + ok.sum()).backward()
        assert oq.shape == shape_q and ok.shape == shape_k and not t.counts
        assert q.grad.shape == shape_q and not w.grad.any()


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_transformers_qwen3_and_gemma3_modules(offset):
    """transformers' own per-head norms (Qwen3RMSNorm: w * x_hat; Gemma3RMSNorm: (1 + w) * x_hat) and its
    apply_rotary_pos_emb give what the op gives (both norms compute in float32 whatever the input dtype)."""
    tf = pytest.importorskip("transformers")  # noqa: F841
    if offset:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as Norm, apply_rotary_pos_emb
    else:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm as Norm, apply_rotary_pos_emb
    q, k, cos, sin, qw, kw, _ = _inputs(2, 4, 2, 7, 16, 16, torch.float32, bshd=True, table="batch", seed=7)
    q, k, cos, sin, qw, kw = (t.cpu() for t in (q, k, cos, sin, qw, kw))
    qn, kn = Norm(16, eps=1e-6), Norm(16, eps=1e-6)
    with torch.no_grad():
        qn.weight.copy_(qw)
        kn.weight.copy_(kw)
        want = apply_rotary_pos_emb(qn(q), kn(k), cos, sin)
        with opsadv.use_backend("reference"):
            got = opsadv.ops.qk_norm_rotary(q, k, cos, sin, qw, kw, eps=1e-6, weight_offset=offset)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compile_fullgraph_forward_backward():
    q, k, cos, sin, qw, kw, _ = _inputs(2, 4, 2, 6, 16, 16, torch.float32, bshd=True, seed=4)

    def f(q, k, qw, kw):
        a, b = opsadv.ops.qk_norm_rotary(q, k, cos, sin, qw, kw, weight_offset=1.0)
        return (a * 2).sum() + b.square().sum()
    ins = [t.detach().requires_grad_() for t in (q, k, qw, kw)]
    with opsadv.use_backend("cuda"), opsadv.trace(all_threads=True) as t:
        torch.compile(f, fullgraph=True, backend="aot_eager")(*ins).backward()
    assert t.counts["cuda.triton.qk_norm_rotary"] == 2, t.counts
    r64 = [t.detach().double().requires_grad_() for t in (q, k, qw, kw)]
    a, b = _oracle(r64[0], r64[1], cos.double(), sin.double(), r64[2], r64[3], offset=1.0)
    ((a * 2).sum() + b.square().sum()).backward()
    for x, y in zip(ins, r64):
        assert rel_err(x.grad, y.grad) < 1e-5


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_custom_ops_match_their_fakes(backend):
    """Every impl's outputs have the layout the fakes promise (compiled graphs are planned with it)."""
    q, k, cos, sin, qw, kw, _ = _inputs(2, 4, 2, 6, 16, 16, torch.float32, seed=5)
    pos = torch.tensor([[0, 2, 5, 9, 10, 3]], device=DEV)
    table = torch.randn(12, 16, device=DEV)
    with opsadv.use_backend(backend):
        for c, s, p in ((cos, sin, None), (table, table * 0.5, pos)):
            torch.library.opcheck(torch.ops.opsadv.qk_norm_rotary.default, (q, k, c, s, qw, kw, 1e-6, 0.0, p, False),
                                  test_utils=("test_schema", "test_faketensor"))
            torch.library.opcheck(torch.ops.opsadv.qk_norm_rotary_backward.default,
                                  (q, k, q, k, c, s, qw, kw, 1e-6, 1.0, p, False),
                                  test_utils=("test_schema", "test_faketensor"))
        oq, _ = torch.ops.opsadv.qk_norm_rotary(q, k, cos, sin, qw, kw, 1e-6, 0.0, None, False)
    assert oq.transpose(1, 2).is_contiguous()


def test_explain_names_the_kernel():
    q, k, cos, sin, qw, kw, _ = _inputs(1, 2, 1, 3, 8, 8, torch.float32)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("qk_norm_rotary", q, k, cos, sin, qw, kw)
        assert e.chosen == "cuda.triton.qk_norm_rotary"
        assert opsadv.explain("qk_norm_rotary", q, k, cos, sin, qw, kw, interleaved=True, backward=True).chosen
    with opsadv.use_backend("reference"):
        assert opsadv.explain("qk_norm_rotary", q, k, cos, sin, qw, kw).chosen == "reference.qk_norm_rotary"


@pytest.mark.parametrize("bad,arg,match", [
    (lambda a: {**a, "q": a["q"][0]}, "q", "rank 4"),
    (lambda a: {**a, "k": a["k"][:, :, :2]}, "k", "S=3"),
    (lambda a: {**a, "cos": a["cos"][:, :7], "sin": a["sin"][:, :7]}, "cos", "even last dim"),
    (lambda a: {**a, "rotary_dim": 4}, "rotary_dim", "cos.shape[-1]"),
    (lambda a: {**a, "position_ids": torch.zeros(3)}, "position_ids", "int32 / int64"),
    (lambda a: {**a, "q_weight": torch.ones(16)}, "q_weight", "OLMo-2"),       # heads x head_dim: whole projection
    (lambda a: {**a, "k_weight": torch.ones(6)}, "k_weight", "shape (D=8,)"),
    (lambda a: {**a, "k_weight": torch.ones(8, dtype=torch.float64)}, "k_weight", "same as q"),
    (lambda a: {**a, "q_weight": torch.ones(8, device="meta")}, "q_weight", "device"),
    (lambda a: {**a, "q_weight": None}, "q_weight", "torch.Tensor"),
    (lambda a: {**a, "eps": -1.0}, "eps", ">= 0"),
    (lambda a: {**a, "weight_offset": float("nan")}, "weight_offset", "finite"),
    (lambda a: {**a, "interleaved": 1}, "interleaved", "bool"),
])
def test_bad_arguments_name_op_argument_expected_and_given(bad, arg, match):
    q, k, cos, sin, qw, kw, _ = _inputs(1, 2, 1, 3, 8, 8, torch.float32)
    a = bad({"q": q.cpu(), "k": k.cpu(), "cos": cos.cpu(), "sin": sin.cpu(), "q_weight": qw.cpu(),
             "k_weight": kw.cpu()})
    with pytest.raises(InvalidArgumentError) as e:
        opsadv.ops.qk_norm_rotary(a.pop("q"), a.pop("k"), a.pop("cos"), a.pop("sin"), a.pop("q_weight"),
                                  a.pop("k_weight"), **a)
    msg = str(e.value)
    assert msg.startswith(f"opsadv.qk_norm_rotary: argument '{arg}' must be ") and "; got " in msg, msg
    assert match in msg, msg


@requires_gpu
@pytest.mark.parametrize("inter", [False, True])
def test_bf16_on_gpu(inter):
    q, k, cos, sin, qw, kw, _ = _inputs(4, 32, 8, 257, 128, 128, torch.bfloat16, bshd=True, table="batch")
    outs, (gq, gk), grads, _ = _run("cuda", q, k, cos, sin, qw, kw, None, {"interleaved": inter})
    want, wgrads = _oracle_grads(q, k, cos, sin, qw, kw, None, {"interleaved": inter}, gq, gk)
    for got, w in zip((*outs, *grads), (*want, *wgrads)):
        assert rel_err(got, w) < TOL[torch.bfloat16]
