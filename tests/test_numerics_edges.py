"""Numerics at the edges (issue 37 item 7): the interpreter refuses bf16 dots with a reason, one NaN / Inf
policy for every backend (docs/conformance.md, "Numerics at the edges"), and empty tensors give the empty /
zero result and gradients on every backend without launching a kernel."""
import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv.core.errors import NoKernelError
from opsadv import SparseLayout

BACKENDS = ("reference", "cuda")     # cuda: its Triton kernels under the interpreter (conftest)


# ---- bf16 under the Triton interpreter ------------------------------------------------------------------
def _bf16_call(op):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(64, 32, generator=g).bfloat16()
    return (a, w)


@pytest.mark.parametrize("op", ["gemm", "swiglu_gemm"])
def test_interpreter_refuses_bf16_dots_with_the_reason(op):
    """The interpreter's bf16 tl.dot is wrong (error ~8e10): the Triton GEMMs refuse it, so cuda raises with
    the reasons and "auto" takes another impl -- no garbage result."""
    args = _bf16_call(op)
    fn = getattr(opsadv.ops, op)
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain(op, *args)
        with pytest.raises(NoKernelError) as e:
            fn(*args)
    triton = [c for c in exp.candidates if c.impl.id.startswith("cuda.triton.")]
    assert triton and all(any("Triton interpreter" in r and "bf16" in r for r in c.reasons) for c in triton)
    assert "bf16 tl.dot is wrong" in str(e.value)
    with opsadv.use_backend("auto"):
        got = fn(*args)
    want = args[0].double() @ args[1].double()
    if op == "swiglu_gemm":
        gate, up = want.chunk(2, -1)
        want = F.silu(gate) * up
    assert (got.double() - want).norm() / want.norm() < 2e-2


def test_interpreter_bf16_reason_is_shared_by_the_attention_impls():
    q = torch.randn(1, 2, 33, 32).bfloat16()
    lay = SparseLayout(33, 33, 16, torch.ones(1, 1, 3, 3, dtype=torch.bool), causal=True)
    with opsadv.use_backend("cuda"):
        for op, args in (("flash_attention", (q, q, q)), ("sparse_attention", (q, q, q, lay))):
            exp = opsadv.explain(op, *args)
            c = next(c for c in exp.candidates if c.impl.id == f"cuda.triton.{op}")
            assert any("bf16 tl.dot is wrong" in r for r in c.reasons), (op, c.reasons)


# ---- empty operands ------------------------------------------------------------------------------------
def _act(name, z):
    return {"none": lambda t: t, "gelu": F.gelu, "silu": F.silu}[name](z)


def _ln64(x, w, b, res):
    s = x + res if res is not None else x
    y = F.layer_norm(s, s.shape[-1:], w, b, 1e-5)
    return (y, s) if res is not None else y


def _rms64(x, w, res):
    s = x + res if res is not None else x
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (w if w is not None else 1.0)
    return (y, s) if res is not None else y


def _gemm64(a, b, bias=None, residual=None, activation="none"):
    z = a @ b + (bias if bias is not None else 0)
    return _act(activation, z) + (residual if residual is not None else 0)


def _swiglu64(x, w):  # noqa: D103
    gu = x @ w
    n = w.shape[1] // 2
    return F.silu(gu[..., :n]) * gu[..., n:]


def _attn64(q, k, v, causal=False):
    """No keys (s_k = 0): out 0 (the policy); otherwise an empty out."""
    return torch.zeros(q.shape, dtype=q.dtype) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()


def _r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


# (name, op, tensors (float64), kwargs-builder from the tensors, float64 reference on the tensors)
EMPTY = [
    ("attn_batch0", "flash_attention", lambda: (_r(0, 2, 5, 16), _r(0, 1, 7, 16), _r(0, 1, 7, 16)), {"causal": True}, _attn64),
    ("attn_sq0", "flash_attention", lambda: (_r(1, 2, 0, 16), _r(1, 2, 7, 16), _r(1, 2, 7, 16)), {}, _attn64),
    ("attn_sk0", "flash_attention", lambda: (_r(2, 2, 5, 16), _r(2, 2, 0, 16), _r(2, 2, 0, 16)), {"causal": True}, _attn64),
    ("attn_heads0", "flash_attention", lambda: (_r(1, 0, 5, 16), _r(1, 0, 5, 16), _r(1, 0, 5, 16)), {}, _attn64),
    ("gemm_rows0", "gemm", lambda: (_r(0, 8), _r(8, 5), _r(5)), {"activation": "gelu"}, _gemm64),
    ("gemm_k0_bias_res", "gemm", lambda: (_r(3, 0), _r(0, 5), _r(5), _r(3, 5)), {"activation": "silu"}, _gemm64),
    ("gemm_n0", "gemm", lambda: (_r(2, 3, 8), _r(8, 0)), {}, _gemm64),
    ("swiglu_gemm_rows0", "swiglu_gemm", lambda: (_r(0, 8), _r(8, 6)), {}, _swiglu64),
    ("swiglu_gemm_k0", "swiglu_gemm", lambda: (_r(4, 0), _r(0, 6)), {}, _swiglu64),
    ("swiglu_rows0", "swiglu", lambda: (_r(0, 3, 10),), {}, lambda x: F.silu(x[..., :5]) * x[..., 5:]),
    ("layer_norm_rows0", "layer_norm", lambda: (_r(0, 16), _r(16), _r(16)), {}, lambda x, w, b: _ln64(x, w, b, None)),
    ("layer_norm_rows0_residual", "layer_norm", lambda: (_r(2, 0, 16), _r(16), _r(16), _r(2, 0, 16)), {},
     lambda x, w, b, r: _ln64(x, w, b, r)),
    ("rms_norm_rows0", "rms_norm", lambda: (_r(0, 16), _r(16)), {}, lambda x, w: _rms64(x, w, None)),
    ("rms_norm_rows0_residual", "rms_norm", lambda: (_r(0, 16), _r(16), _r(0, 16)), {}, lambda x, w, r: _rms64(x, w, r)),
    ("rotary_seq0", "rotary_embedding", lambda: (_r(1, 2, 0, 8), _r(1, 1, 0, 8), _r(0, 8), _r(0, 8)), {},
     lambda q, k, c, s: (q * 1, k * 1)),
    ("rotary_batch0", "rotary_embedding", lambda: (_r(0, 2, 3, 8), _r(0, 1, 3, 8), _r(3, 8), _r(3, 8)), {},
     lambda q, k, c, s: (q * 1, k * 1)),
]


def _call(op, ts, kw, dtype):
    """Call the public op on the tensors cast to dtype; returns (outputs tuple, inputs that take grads)."""
    xs = [t.to(dtype).requires_grad_(True) for t in ts]
    fn = getattr(opsadv.ops, op)
    if op == "gemm":
        names = ("bias", "residual")
        extra = dict(zip(names, xs[2:]))
        out = fn(xs[0], xs[1], **extra, **kw)
    elif op == "layer_norm":
        out = fn(xs[0], xs[1], xs[2], residual=xs[3] if len(xs) > 3 else None, **kw)
    elif op == "rms_norm":
        out = fn(xs[0], xs[1], residual=xs[2] if len(xs) > 2 else None, **kw)
    else:
        out = fn(*xs, **kw)
    return (out if isinstance(out, tuple) else (out,)), xs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,op,make,kw,ref", EMPTY, ids=[e[0] for e in EMPTY])
def test_empty_operands_give_the_empty_or_zero_result(backend, dtype, name, op, make, kw, ref):
    """Batch / sequence / rows / K / N / heads of 0: the maths' result (empty, zero, or the epilogue of a zero
    product) and its gradients against float64, on every backend, without any kernel running."""
    ts = make()
    with opsadv.use_backend(backend), opsadv.trace() as t:
        outs, xs = _call(op, ts, kw, dtype)
        grads_out = [torch.randn(o.shape, dtype=torch.float64) for o in outs]
        got = torch.autograd.grad(outs, xs, [g.to(dtype) for g in grads_out], allow_unused=True)
    assert dict(t.counts) == {}, t.counts                     # no kernel ran
    r64 = [x.detach().clone().requires_grad_(True) for x in ts]
    want = ref(*r64, **kw)
    want = want if isinstance(want, tuple) else (want,)
    assert len(want) == len(outs)
    for o, w in zip(outs, want):
        assert o.shape == w.shape and o.dtype == dtype
        torch.testing.assert_close(o.double(), w.detach(), atol=2e-3, rtol=2e-3)
    wgrads = torch.autograd.grad(want, r64, grads_out, allow_unused=True)
    for x, g, w in zip(xs, got, wgrads):
        assert g is not None and g.shape == x.shape, (g, x.shape)           # zero / empty gradients, not None
        torch.testing.assert_close(g.double(), torch.zeros_like(x.double()) if w is None else w, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sparse_attention_and_lse(backend):
    lay = SparseLayout(0, 0, 16, torch.ones(1, 1, 0, 0, dtype=torch.bool), causal=True)
    q = torch.randn(1, 2, 0, 16, requires_grad=True)
    kv = torch.randn(1, 1, 0, 16, requires_grad=True)
    with opsadv.use_backend(backend), opsadv.trace() as t:
        out, lse = opsadv.ops.sparse_attention(q, kv, kv, lay, return_lse=True)
        out.sum().backward()
    assert dict(t.counts) == {} and out.shape == q.shape and lse.shape == (1, 2, 0)
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    # s_k = 0 under flash_attention: rows with no key give lse = -inf (the NaN / Inf policy)
    q = torch.randn(1, 2, 3, 16)
    with opsadv.use_backend(backend):
        out, lse = opsadv.ops.flash_attention(q, kv.detach(), kv.detach(), return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_empty_refusals_still_name_the_argument():
    with pytest.raises(opsadv.errors.InvalidArgumentError, match="head_dim >= 1"):
        opsadv.ops.flash_attention(torch.randn(1, 1, 2, 0), torch.randn(1, 1, 2, 0), torch.randn(1, 1, 2, 0))
    with pytest.raises(opsadv.errors.InvalidArgumentError, match="'k'.*heads dividing"):
        opsadv.ops.flash_attention(torch.randn(1, 2, 2, 8), torch.randn(1, 0, 2, 8), torch.randn(1, 0, 2, 8))


# ---- the NaN / Inf policy -----------------------------------------------------------------------------
def attention64(q, k, v, mask=None):
    """Plain softmax attention in float64 with the policy's edge rules (tests/test_bad_inputs.py has the same):
    a row with no key gives 0 and lse -inf, a row with a +inf or NaN score NaN and lse NaN."""
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(torch.isposinf(lse), float("nan"))
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return p @ v, lse


def _nan_cases():
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(1, 2, 9, 32, generator=g).half() for _ in range(3)]
    out = {}

    def case(name, edit, mask=None):
        q, k, v = (t.clone() for t in base)
        edit(q, k, v)
        out[name] = (q, k, v, mask)
    case("q_inf", lambda q, k, v: q[0, 0, 2].__setitem__(3, float("inf")))
    case("q_nan", lambda q, k, v: q[0, 1, 4].__setitem__(0, float("nan")))
    case("k_inf", lambda q, k, v: k[0, 0, 5].__setitem__(1, float("inf")))
    case("k_neg_inf", lambda q, k, v: k[0, 1, 5].__setitem__(1, float("-inf")))
    case("v_nan", lambda q, k, v: v[0, 0, 5].__setitem__(1, float("nan")))
    case("v_inf", lambda q, k, v: v[0, 1, 7].__setitem__(2, float("inf")))
    m = torch.zeros(1, 2, 9, 9, dtype=torch.float16)
    m[0, 0, 3, :] = float("-inf")            # a fully masked row (additive)
    m[0, 1, 2, 4] = float("inf")             # a +inf score
    case("mask_inf", lambda q, k, v: None, m)
    mb = torch.ones(1, 1, 9, 9, dtype=torch.bool)
    mb[0, 0, 6, :] = False                   # a fully masked row (bool)
    case("mask_all_false", lambda q, k, v: None, mb)
    return out


NAN_CASES = _nan_cases()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(NAN_CASES))
def test_attention_nan_inf_policy(backend, name):
    """out is NaN / Inf exactly where plain softmax attention's (float64) is, and equal elsewhere; a fully masked row gives out 0 and
    lse -inf; a row with a +inf or NaN score gives lse NaN (the reference gave out 0 and lse +inf before)."""
    q, k, v, m = NAN_CASES[name]
    with opsadv.use_backend(backend):
        if backend != "reference" and m is not None:
            if not any(c.chosen for c in opsadv.explain("flash_attention", q, k, v, attn_mask=m).candidates):
                pytest.skip("no cuda impl takes this mask on CPU")
        out, lse = opsadv.ops.flash_attention(q, k, v, attn_mask=m, return_lse=True)
    want, want_lse = attention64(q.double(), k.double(), v.double(),
                                 None if m is None else m if m.dtype == torch.bool else m.double())
    out = out.double()
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse)) and torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.equal(torch.isnan(out), torch.isnan(want)), name
    assert torch.equal(torch.isfinite(out), torch.isfinite(want)), name
    fin = torch.isfinite(want)
    torch.testing.assert_close(out[fin], want[fin], atol=3e-3, rtol=3e-3)
    rows_nan = torch.isnan(want).any(-1) & ~torch.isinf(want).any(-1)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 32 ** 0.5
    if m is not None:
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.double()
    bad_score = (torch.isnan(scores) | torch.isposinf(scores)).any(-1)
    empty = torch.isneginf(scores).all(-1)
    assert torch.isnan(lse[bad_score]).all() and torch.isneginf(lse[empty]).all()
    assert (out[empty] == 0).all() and torch.isfinite(lse[~bad_score & ~empty]).all()
    assert rows_nan[bad_score].all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stays_in_its_row_for_norms_and_gemm(backend):
    """Row-local ops: a NaN in one input row gives NaN in that output row only (as plain torch does)."""
    x = torch.randn(6, 64).half()
    x[2, 5] = float("nan")
    w = torch.randn(64).half()
    b = (torch.randn(64, 48) / 8).half()
    with opsadv.use_backend(backend):
        outs = {"rms_norm": opsadv.ops.rms_norm(x, w), "layer_norm": opsadv.ops.layer_norm(x, w, w),
                "gemm": opsadv.ops.gemm(x, b, activation="gelu")}
    for op, y in outs.items():
        bad = torch.isnan(y).any(-1)
        assert bad.tolist() == [False, False, True, False, False, False], op
        assert torch.isnan(y[2]).all(), op


def test_explain_says_an_empty_call_runs_no_kernel():
    exp = opsadv.explain("gemm", torch.randn(0, 8), torch.randn(8, 4))
    assert exp.chosen is None and "no kernel runs" in exp.why and not any(c.chosen for c in exp.candidates)
    assert opsadv.explain("gemm", torch.randn(2, 8), torch.randn(8, 4)).chosen is not None
