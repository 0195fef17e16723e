"""The bad-input matrix (issue 37, "Done when"): every op x backend (reference; cuda, its Triton kernels under the
interpreter) x {dtype, rank, shape, device, layout / stride, empty, NaN / Inf, unknown option}.  Each call either
raises a clear error (the op and the argument named) or returns what an independent float64 reference (plain torch,
not opsadv) gives: no silently wrong result."""
import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv.core.errors import InvalidArgumentError, NoKernelError
from opsadv import SparseLayout

BACKENDS = ("reference", "cuda")
DT = torch.float16          # every cuda impl serves it under the interpreter


def _r(*shape):
    return torch.randn(*shape, dtype=torch.float64).to(DT)


def _rep(t, n):
    return t.repeat_interleave(n, 1)


# ---- independent float64 references -------------------------------------------------------------------
def attention64(q, k, v, mask=None, causal=False):
    """softmax(q k^T / sqrt(d) + mask) v in float64 with the documented edge rules: a row with no key gives 0
    (lse -inf), a row with a +inf or NaN score NaN (lse NaN).  (SDPA's CPU kernels disagree with each other on
    NaN rows, so the policy is written out here.)  Returns (out, lse)."""
    rep = q.shape[1] // k.shape[1] if k.shape[1] else 1
    k, v = _rep(k, rep), _rep(v, rep)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(torch.isposinf(lse), float("nan"))
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return p @ v, lse


def _attn64(q, k, v, causal=False):
    return attention64(q, k, v, causal=causal)[0]


def _rot64(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * cos + rot * sin


# op: (make() -> dict of named arguments, call(d) -> output(s), ref(d64) -> float64 output(s),
#      primary, secondary, empty(d) -> d with an empty batch / rows)
def _flash():
    def make():
        return {"q": _r(1, 2, 5, 32), "k": _r(1, 1, 7, 32), "v": _r(1, 1, 7, 32)}

    def empty(d):
        return {n: t[:0] for n, t in d.items()}
    return (make, lambda d, **kw: opsadv.ops.flash_attention(d["q"], d["k"], d["v"], **kw),
            lambda d: _attn64(d["q"], d["k"], d["v"]), "q", "k", empty)


def _sparse():
    def make():
        return {"q": _r(1, 2, 20, 32), "k": _r(1, 2, 20, 32), "v": _r(1, 2, 20, 32)}

    def call(d, **kw):
        s = d["q"].shape[2]
        n = -(-s // 16)
        lay = SparseLayout(s, s, 16, torch.ones(1, 1, n, n, dtype=torch.bool, device=d["q"].device), causal=True)
        return opsadv.ops.sparse_attention(d["q"], d["k"], d["v"], lay, **kw)

    def empty(d):
        return {n: t[:, :, :0] for n, t in d.items()}
    return make, call, lambda d: _attn64(d["q"], d["k"], d["v"], causal=True), "q", "k", empty


def _gemm():
    # silu: torch's own gelu(+inf) is inf in float16 and NaN in float32 / float64, so no oracle could hold gelu here
    def make():
        return {"a": _r(5, 24), "b": _r(24, 16) / 4, "bias": _r(16)}
    return (make, lambda d, **kw: opsadv.ops.gemm(d["a"], d["b"], bias=d["bias"], activation="silu", **kw),
            lambda d: F.silu(d["a"] @ d["b"] + d["bias"]), "a", "b", lambda d: {**d, "a": d["a"][:0]})


def _swiglu_gemm():
    def make():
        return {"x": _r(5, 24), "w_gate_up": _r(24, 16) / 4}

    def ref(d):
        gu = d["x"] @ d["w_gate_up"]
        return F.silu(gu[..., :8]) * gu[..., 8:]
    return (make, lambda d, **kw: opsadv.ops.swiglu_gemm(d["x"], d["w_gate_up"], **kw), ref, "x", "w_gate_up",
            lambda d: {**d, "x": d["x"][:0]})


def _swiglu():
    def ref(d):
        n = d["gate_up"].shape[-1] // 2
        return F.silu(d["gate_up"][..., :n]) * d["gate_up"][..., n:]
    return (lambda: {"gate_up": _r(5, 16)}, lambda d, **kw: opsadv.ops.swiglu(d["gate_up"], **kw), ref, "gate_up",
            None, lambda d: {"gate_up": d["gate_up"][:0]})


def _layer_norm():
    return (lambda: {"x": _r(5, 24), "weight": _r(24), "bias": _r(24)},
            lambda d, **kw: opsadv.ops.layer_norm(d["x"], d["weight"], d["bias"], **kw),
            lambda d: F.layer_norm(d["x"], d["x"].shape[-1:], d["weight"], d["bias"], 1e-5), "x", "weight",
            lambda d: {**d, "x": d["x"][:0]})


def _rms_norm():
    def ref(d):
        x = d["x"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * d["weight"]
    return (lambda: {"x": _r(5, 24), "weight": _r(24)}, lambda d, **kw: opsadv.ops.rms_norm(d["x"], d["weight"], **kw),
            ref, "x", "weight", lambda d: {**d, "x": d["x"][:0]})


def _rotary():
    def make():
        return {"q": _r(1, 2, 5, 16), "k": _r(1, 1, 5, 16), "cos": _r(5, 16), "sin": _r(5, 16)}

    def ref(d):
        return _rot64(d["q"], d["cos"], d["sin"]), _rot64(d["k"], d["cos"], d["sin"])
    return (make, lambda d, **kw: opsadv.ops.rotary_embedding(d["q"], d["k"], d["cos"], d["sin"], **kw), ref, "q", "k",
            lambda d: {**d, "q": d["q"][:0], "k": d["k"][:0]})


def _qk_norm_rotary():
    def make():
        return {"q": _r(1, 2, 5, 16), "k": _r(1, 1, 5, 16), "cos": _r(5, 16), "sin": _r(5, 16), "q_weight": _r(16),
                "k_weight": _r(16)}

    def ref(d):
        def norm(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return (_rot64(norm(d["q"], d["q_weight"]), d["cos"], d["sin"]),
                _rot64(norm(d["k"], d["k_weight"]), d["cos"], d["sin"]))
    return (make, lambda d, **kw: opsadv.ops.qk_norm_rotary(d["q"], d["k"], d["cos"], d["sin"], d["q_weight"],
                                                            d["k_weight"], **kw),
            ref, "q", "k", lambda d: {**d, "q": d["q"][:0], "k": d["k"][:0]})


def _paged():
    def make():
        # pages of 8 tokens, out of order; sequence 1 shares sequence 0's first page
        return {"q": _r(2, 3, 4, 16), "k_cache": _r(5, 8, 2, 16), "v_cache": _r(5, 8, 2, 16),
                "block_table": torch.tensor([[3, 0], [3, 4]], dtype=torch.int32),
                "seqlens_k": torch.tensor([10, 13], dtype=torch.int32)}

    def ref(d):
        outs = []
        for b in range(d["q"].shape[0]):
            n = int(d["seqlens_k"][b])
            pages = d["block_table"][b].long()
            k = d["k_cache"][pages].reshape(-1, 2, 16)[:n].transpose(0, 1)[None]
            v = d["v_cache"][pages].reshape(-1, 2, 16)[:n].transpose(0, 1)[None]
            outs.append(_attn64(d["q"][b:b + 1].transpose(1, 2), k, v, causal=True).transpose(1, 2))
        return torch.cat(outs)
    return (make, lambda d, **kw: opsadv.ops.paged_attention(d["q"], d["k_cache"], d["v_cache"], d["block_table"],
                                                             d["seqlens_k"], **kw),
            ref, "q", "k_cache", lambda d: {**d, "q": d["q"][:, :0]})


def _varlen():
    def make():
        # query segments of 2 and 3 rows against 5 and 9 keys (packed), GQA 4 / 2
        return {"q": _r(5, 4, 16), "k": _r(14, 2, 16), "v": _r(14, 2, 16),
                "cu_seqlens_q": torch.tensor([0, 2, 5], dtype=torch.int32),
                "cu_seqlens_k": torch.tensor([0, 5, 14], dtype=torch.int32)}

    def ref(d):
        cq, ck = d["cu_seqlens_q"].tolist(), d["cu_seqlens_k"].tolist()
        return torch.cat([_attn64(d["q"][None, cq[b]:cq[b + 1]].transpose(1, 2),
                                  d["k"][None, ck[b]:ck[b + 1]].transpose(1, 2),
                                  d["v"][None, ck[b]:ck[b + 1]].transpose(1, 2), causal=True)[0].transpose(0, 1)
                          for b in range(2)])
    return (make, lambda d, **kw: opsadv.ops.varlen_attention(d["q"], d["k"], d["v"], d["cu_seqlens_q"],
                                                              d["cu_seqlens_k"], causal=True, **kw),
            ref, "q", "k", lambda d: {**d, "q": d["q"][:0], "cu_seqlens_q": torch.zeros(3, dtype=torch.int32)})


OPS = {"flash_attention": _flash(), "sparse_attention": _sparse(), "gemm": _gemm(), "swiglu_gemm": _swiglu_gemm(),
       "swiglu": _swiglu(), "layer_norm": _layer_norm(), "rms_norm": _rms_norm(), "rotary_embedding": _rotary(),
       "qk_norm_rotary": _qk_norm_rotary(), "paged_attention": _paged(),
       "varlen_attention": _varlen()}


def _mutations(primary, secondary, empty):
    """name -> (mutate(d) -> d, the argument an error must name, extra call kwargs)."""
    def at(name, f):
        return lambda d: {**d, name: f(d[name])}

    def poisoned(t):
        t = t.clone()
        t.view(-1)[1] = float("nan")
        t.view(-1)[-1] = float("inf")
        return t
    m = {
        "dtype_int": (at(primary, lambda t: t.to(torch.int32)), primary, {}),
        "rank_plus_one": (at(primary, lambda t: t[None]), primary, {}),
        "rank_minus_one": (at(primary, lambda t: t[0]), primary, {}),
        "strided": (at(primary, lambda t: t.mT.contiguous().mT if t.dim() > 1 else t), primary, {}),
        "offset_view": (at(primary, lambda t: torch.cat((t, t), -1)[..., t.shape[-1]:]), primary, {}),
        "empty": (empty, primary, {}),
        "nan_inf": (at(primary, poisoned), primary, {}),
        "unknown_option": (lambda d: d, "bogus", {"bogus": 1}),
    }
    if secondary is not None:
        m.update({
            "dtype_mismatch": (at(secondary, lambda t: t.to(torch.float32)), secondary, {}),
            "shape_mismatch": (at(secondary, lambda t: torch.cat((t, t[..., :1]), -1)), secondary, {}),
            "device_mismatch": (at(secondary, lambda t: t.to("meta")), secondary, {}),
            "strided_secondary": (at(secondary, lambda t: t.mT.contiguous().mT if t.dim() > 1 else t[::1]), secondary,
                                  {}),
        })
    else:
        m["odd_last_dim"] = (at(primary, lambda t: t[..., :-1]), primary, {})
    return m


CELLS = [(op, mut) for op, (make, call, ref, p, s, e) in OPS.items() for mut in _mutations(p, s, e)]


def _outs(o):
    return list(o) if isinstance(o, tuple) else [o]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,mutation", CELLS, ids=[f"{o}-{m}" for o, m in CELLS])
def test_bad_input_gives_a_clear_error_or_the_right_result(backend, op, mutation):
    make, call, ref, primary, secondary, empty = OPS[op]
    torch.manual_seed(hash((op, mutation)) % 1000)
    mutate, arg, kw = _mutations(primary, secondary, empty)[mutation]
    d = mutate(make())
    try:
        with opsadv.use_backend(backend):
            got = call(d, **kw)
    except (InvalidArgumentError, NoKernelError, TypeError) as e:
        msg = str(e)
        assert op in msg, msg                                   # names the op
        if not isinstance(e, NoKernelError):                    # (a NoKernelError lists each impl's reasons)
            assert f"'{arg}'" in msg or f"{arg}" in msg.split(":")[0] or f"argument '{arg}" in msg, msg
        return
    # a result: it must be the float64 reference's, non-finite exactly where the reference is
    d64 = {n: t.double() if t.is_floating_point() else t for n, t in d.items()}
    want = _outs(ref(d64))
    got = _outs(got)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.device == w.device, (g.shape, w.shape)
        g = g.double()
        assert torch.equal(torch.isnan(g), torch.isnan(w)) and torch.equal(torch.isinf(g), torch.isinf(w)), mutation
        fin = torch.isfinite(w)
        torch.testing.assert_close(g[fin], w[fin], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
def test_gemm_epilogues_keep_a_nan_row_nan(backend, activation):
    """A NaN in row 2 of a gives NaN across row 2 of every epilogue and nothing elsewhere (relu too: torch.relu
    keeps NaN, where the Triton epilogue's tl.maximum(z, 0) would give 0 on a GPU)."""
    a, b = _r(6, 32), _r(32, 16) / 4
    a[2, 5] = float("nan")
    with opsadv.use_backend(backend):
        y = opsadv.ops.gemm(a, b, activation=activation)
    assert torch.isnan(y).any(-1).tolist() == [False, False, True, False, False, False] and torch.isnan(y[2]).all()
