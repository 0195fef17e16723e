"""The precision dict and the PrecisionPolicy fields: accepted and validated wherever a precision is taken
(use_backend, convert_model, Optimizer), each field changing what the reference impls compute on fresh random
float32 inputs (a field nobody reads fails here), explain() saying per candidate which requests of the call it
applies and which it ignores (tile_size too), and cuBLAS GEMMs run in the policy's matmul precision."""
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

import opsadv
from opsadv.core.precision import DICT_KEYS, PrecisionPolicy
from opsadv.errors import InvalidArgumentError

DICT = {"matmul_precision": "medium", "attention_proj": "fp16", "layer_norm": "fp32", "softmax": "bf16"}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---- the dict ----------------------------------------------------------------------------------------------------
def test_the_description_dict_maps_onto_the_policy():
    p = PrecisionPolicy.from_string(DICT)
    assert p == PrecisionPolicy(matmul="tf32", attention="fp16", norm="fp32", softmax="bf16")
    assert PrecisionPolicy.from_dict({"matmul_precision": "highest"}) == PrecisionPolicy()
    assert PrecisionPolicy.from_dict({"layer_norm": "FP64"}).norm == "fp64"


@pytest.mark.parametrize("bad,needles", [
    ({"matmul_precison": "medium"}, ["matmul_precision", "did you mean", "softmax"]),
    ({"softmax": "fp16"}, ["precision['softmax']", "['fp32', 'bf16']", "'fp16'"]),
    ({"layer_norm": "bf16"}, ["precision['layer_norm']", "fp64"]),
    ({"matmul_precision": "low"}, ["'highest'", "'medium'"]),
    ({"matmul": "fp32", "matmul_precision": "medium"}, ["consistent"]),
])
def test_bad_dicts_are_refused_with_the_valid_choices(bad, needles):
    for call in (lambda: opsadv.use_backend("reference", precision=bad),
                 lambda: opsadv.convert_model(torch.nn.Linear(4, 4), precision=bad, validate=False)):
        with pytest.raises(InvalidArgumentError) as e:
            call()
        for n in needles:
            assert n in str(e.value), (n, str(e.value))
    with pytest.raises(InvalidArgumentError, match="opsadv.Optimizer"):
        opsadv.Optimizer(precision=bad)


def test_every_key_is_documented_and_accepted_everywhere():
    assert set(DICT_KEYS) >= set(DICT)
    with opsadv.use_backend("reference", precision=DICT):
        assert opsadv.current_policy().precision.softmax == "bf16"
        assert "precision softmax=bf16" in opsadv.current_policy().describe()
    opt = opsadv.Optimizer(device="cpu", precision=DICT)
    assert opt.precision == DICT
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    c = opsadv.convert_model(m, precision=DICT, example_inputs=torch.randn(3, 8), floor=False)
    assert next(c.parameters()).dtype == torch.float32          # a dict sets the policy; it casts nothing
    assert "softmax=bf16" in c.opsadv_report.precision
    assert c._opsadv_state.effective().precision.matmul == "tf32"


# ---- each field changes what runs (reference impls, float32 inputs) ----------------------------------------------
def _under(precision, fn):
    with opsadv.use_backend("reference", precision=precision), torch.no_grad():
        return fn()


def _tf32(x):           # independent of the impl's bit trick: the mantissa to 10 bits, ties away from zero
    m, e = torch.frexp(x.double())
    return torch.ldexp(torch.sign(m) * torch.floor(m.abs() * 2 ** 11 + 0.5) / 2 ** 11, e)


@pytest.mark.parametrize("value,round_", [("medium", _tf32), ("high", _tf32),
                                          ("bf16", lambda t: t.to(torch.bfloat16).double()),
                                          ("fp16", lambda t: t.to(torch.float16).double())])
def test_matmul_precision_changes_the_gemm(value, round_):
    g = torch.Generator().manual_seed(11)
    a, b, bias = torch.randn(37, 70, generator=g), torch.randn(70, 29, generator=g), torch.randn(29, generator=g)
    key = "matmul_precision" if value in ("medium", "high") else "matmul"
    got = _under({key: value}, lambda: opsadv.ops.gemm(a, b, bias=bias))
    base = _under(None, lambda: opsadv.ops.gemm(a, b, bias=bias))
    want = round_(a) @ round_(b) + bias.double()
    assert rel(got, want) < 1e-6 < rel(base, want)       # computed on the rounded operands, the default is not
    x, w = torch.randn(5, 3, 40, generator=g), torch.randn(40, 2 * 24, generator=g)
    sg = _under({key: value}, lambda: opsadv.ops.swiglu_gemm(x, w))
    gu = round_(x) @ round_(w)
    assert rel(sg, torch.nn.functional.silu(gu[..., :24]) * gu[..., 24:]) < 1e-6


def _attn_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 33, 40, generator=g) * 2 for _ in range(3)]


def _sdpa64(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)


def test_attention_proj_computes_attention_in_half_precision():
    q, k, v = _attn_inputs(3)
    base = _under(None, lambda: opsadv.ops.flash_attention(q, k, v, causal=True))
    half = _under({"attention_proj": "fp16"}, lambda: opsadv.ops.flash_attention(q, k, v, causal=True))
    exact = _sdpa64(q, k, v)
    assert rel(base, exact) < 1e-6
    assert 1e-5 < rel(half, exact) < 5e-3                 # fp16 operands: changed, and within fp16's error
    qh, kh, vh = (t.half().double() for t in (q, k, v))
    assert rel(half, _sdpa64(qh, kh, vh)) < rel(half, exact)   # it is the rounded operands it multiplied


def test_softmax_bf16_computes_the_statistics_in_bf16():
    q, k, v = _attn_inputs(4)
    base = _under(None, lambda: opsadv.ops.flash_attention(q, k, v, causal=True))
    bf = _under({"softmax": "bf16"}, lambda: opsadv.ops.flash_attention(q, k, v, causal=True))
    exact = _sdpa64(q, k, v)
    assert rel(base, exact) < 1e-6 and 1e-4 < rel(bf, exact) < 3e-2
    s = (q.double() @ k.double().transpose(-1, -2)) / 40 ** 0.5
    s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s.float().to(torch.bfloat16).double(), -1).to(torch.bfloat16).double()
    assert rel(bf, p @ v.double()) < rel(bf, exact)        # bf16 probabilities are what it used
    x = torch.randn(5, 4, 40, 64)
    lay = opsadv.SparseLayout.sliding_window(40, (16, 0), block_size=16)
    sp = _under({"softmax": "bf16"}, lambda: opsadv.ops.sparse_attention(x[:1], x[1:2], x[2:3], lay))
    assert rel(sp, _under(None, lambda: opsadv.ops.sparse_attention(x[:1], x[1:2], x[2:3], lay))) > 1e-4


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_layer_norm_fp64_computes_the_statistics_in_float64(op):
    g = torch.Generator().manual_seed(5)
    x = 3000 + torch.randn(64, 257, generator=g)           # large mean: float32 statistics lose digits
    w, b = torch.randn(257, generator=g), torch.randn(257, generator=g)

    def run():
        return (opsadv.ops.layer_norm(x, w, b, 1e-5) if op == "layer_norm" else opsadv.ops.rms_norm(x, w, 1e-5))
    base, f64 = _under(None, run), _under({"layer_norm": "fp64"}, run)
    xd = x.double()
    if op == "layer_norm":
        want = torch.nn.functional.layer_norm(xd, (257,), w.double(), b.double(), 1e-5)
    else:
        want = xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * w.double()
    err, err_base = (f64.double() - want).abs().max().item(), (base.double() - want).abs().max().item()
    assert not torch.equal(f64, base)
    assert err <= 0.5 * err_base and err < 1e-5, (err, err_base)


def test_gradients_follow_the_policy_too():
    g = torch.Generator().manual_seed(9)
    a = torch.randn(6, 20, generator=g, requires_grad=True)
    b = torch.randn(20, 7, generator=g, requires_grad=True)
    grads = {}
    for name, prec in (("fp32", None), ("bf16", {"matmul": "bf16"})):
        a.grad = b.grad = None
        with opsadv.use_backend("reference", precision=prec):
            opsadv.ops.gemm(a, b).square().sum().backward()
        grads[name] = (a.grad.clone(), b.grad.clone())
    assert not torch.equal(grads["fp32"][0], grads["bf16"][0])
    assert rel(grads["bf16"][0], grads["fp32"][0]) < 3e-2


# ---- explain: applies / ignores ------------------------------------------------------------------------------------
def test_explain_names_what_each_candidate_applies_and_ignores():
    q, k, v = (torch.randn(1, 2, 33, 64, dtype=torch.float16) for _ in range(3))
    with opsadv.use_backend("auto", precision={"softmax": "bf16"}, tile_size=64):
        exp = opsadv.explain("flash_attention", q, k, v, causal=True)
        gem = opsadv.explain("gemm", torch.randn(9, 32).half(), torch.randn(32, 16).half())
    by = {c.impl.id: c for c in exp.candidates}
    if "cuda.triton.flash_attention" not in by or not by["cuda.triton.flash_attention"].accepted:
        pytest.skip("the cuda backend's Triton kernels are not registered here (no TRITON_INTERPRET)")
    tri, ref = by["cuda.triton.flash_attention"], by["reference.flash_attention"]
    assert tri.applies == ("tile_size=64",) and tri.ignores == ("softmax=bf16",)
    assert ref.applies == ("softmax=bf16",) and ref.ignores == ("tile_size=64",)
    text = str(exp)
    assert "ignores softmax=bf16" in text and "applies tile_size=64" in text
    d = {c["impl"]: c for c in exp.to_dict()["candidates"]}
    assert d["cuda.triton.flash_attention"]["ignores"] == ["softmax=bf16"]
    g = {c.impl.id: c for c in gem.candidates if c.accepted}
    assert g["cuda.triton.gemm"].applies == ("tile_size=64",) and g["reference.gemm"].ignores == ("tile_size=64",)


def test_a_call_whose_kernel_ignores_a_precision_field_warns_once(monkeypatch):
    """The chosen impl ignores softmax=bf16 (its statistics stay float32): the resolution warns, naming the impl,
    the field and who would honour it, once per (op, impl, field); tile_size (a cap) is only explain's."""
    from opsadv.core import dispatch
    monkeypatch.setattr(dispatch, "_logged_ignored", set())
    q = torch.randn(1, 2, 33, 64, dtype=torch.float16)
    with opsadv.use_backend("auto", precision={"softmax": "bf16"}, tile_size=64):
        if opsadv.explain("flash_attention", q, q, q).chosen != "cuda.triton.flash_attention":
            pytest.skip("the cuda backend's Triton kernels are not registered here (no TRITON_INTERPRET)")
        with warnings.catch_warnings(record=True) as seen:     # (pytest.warns would re-emit the interpreter's own)
            warnings.simplefilter("always", RuntimeWarning)
            opsadv.ops.flash_attention(q, q, q)
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning) and "ignores" in str(w.message)]
    assert len(said) == 1 and re.search(r"flash_attention runs cuda.triton.flash_attention, which ignores the "
                                        r"policy's softmax=bf16.*reference.flash_attention would honour", said[0])
    with opsadv.use_backend("auto", precision={"softmax": "bf16"}), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opsadv.ops.flash_attention(q[:, :, :17], q[:, :, :17], q[:, :, :17])     # another bucket: said already
    with opsadv.use_backend("auto", tile_size=64), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opsadv.ops.rms_norm(torch.randn(3, 64), torch.randn(64))                  # tile_size alone: no warning


def test_explain_says_nothing_when_nothing_is_asked():
    with opsadv.use_backend("reference"):
        exp = opsadv.explain("rms_norm", torch.randn(3, 8), torch.randn(8))
    assert all(not c.applies and not c.ignores for c in exp.candidates)
    with opsadv.use_backend("reference", precision={"layer_norm": "fp64"}):
        fp64_in = opsadv.explain("rms_norm", torch.randn(3, 8, dtype=torch.float64), None)
        gemm = opsadv.explain("gemm", torch.randn(3, 8), torch.randn(8, 4))
    assert all(not c.ignores and not c.applies for c in fp64_in.candidates)   # float64 always computes in float64
    assert all(not c.ignores and not c.applies for c in gemm.candidates)      # the norm field: not a GEMM's


# ---- cuBLAS impls (called directly: torch.mm serves CPU tensors too) -------------------------------------------
def test_cublas_gemm_runs_in_the_policy_matmul_precision(monkeypatch):
    from opsadv.backends.cuda.gemm import cublas as G
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 24, generator=g), torch.randn(24, 5, generator=g)
    seen = []
    real_mm = torch.mm

    def spy(x, y, *args, **kw):
        seen.append((torch.get_float32_matmul_precision(), x.dtype))
        return real_mm(x, y, *args, **kw)
    monkeypatch.setattr(torch, "mm", spy)
    before = torch.get_float32_matmul_precision()

    def ctx(**prec):
        return SimpleNamespace(options={"precision": PrecisionPolicy(**prec)})
    G._cublas_gemm(ctx(matmul="tf32"), a, b, None, "none", None, 1.0)
    assert seen[-1] == ("high", torch.float32) and torch.get_float32_matmul_precision() == before
    out = G._cublas_gemm(ctx(matmul="bf16"), a, b, None, "none", None, 1.0)
    assert seen[-1][1] == torch.bfloat16 and out.dtype == torch.float32
    assert torch.equal(out, real_mm(a.bfloat16(), b.bfloat16()).float())
    G._cublas_gemm(ctx(), a, b, None, "none", None, 1.0)
    assert seen[-1] == (before, torch.float32)
    da, db, _ = G._cublas_gemm_bwd(ctx(matmul="fp16"), torch.randn(8, 5), a, b, None, "none", 1.0)
    assert da.dtype == db.dtype == torch.float32


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("hidden", [257, 5000])           # whole rows in registers; long rows in chunks (looped)
def test_triton_norms_compute_fp64_statistics(op, hidden):
    from opsadv.registry import get_registry
    impl = f"cuda.triton.{op}"
    if impl not in {i.id for i in get_registry().impls_by_op.get(op, [])} or "cuda" not in get_registry().backends \
            or not get_registry().backends["cuda"].available:
        pytest.skip("the cuda backend's Triton kernels are not registered here (no TRITON_INTERPRET)")
    g = torch.Generator().manual_seed(hidden)
    x = 3000 + torch.randn(6, hidden, generator=g)
    w, b = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
    r = torch.randn(6, hidden, generator=g)

    def run(prec):
        with opsadv.use_backend("cuda", precision=prec, impls={op: impl}), torch.no_grad():
            if op == "layer_norm":
                return opsadv.ops.layer_norm(x, w, b, 1e-5, residual=r)[0]
            return opsadv.ops.rms_norm(x, w, 1e-5, residual=r)[0]
    base, f64 = run(None), run({"layer_norm": "fp64"})
    s = (x + r).double()     # (the residual sum is formed in float32, as the kernel forms it)
    if op == "layer_norm":
        want = torch.nn.functional.layer_norm(s, (hidden,), w.double(), b.double(), 1e-5)
    else:
        want = s * torch.rsqrt((s * s).mean(-1, keepdim=True) + 1e-5) * w.double()
    err, err_base = (f64.double() - want).abs().max().item(), (base.double() - want).abs().max().item()
    assert not torch.equal(f64, base)
    assert err <= 0.5 * err_base and err < 1e-5, (err, err_base)
    if hidden > 4096:           # the looped kernel (a tile the tuner may pick for long rows), run directly
        from opsadv.backends.triton_common.norm import norm as N
        ctx = SimpleNamespace(options={"precision": PrecisionPolicy(norm="fp64")}, profile=None)
        y = N._forward(ctx, op == "rms_norm", x, w, b if op == "layer_norm" else None, 1e-5, r, 0.0,
                       cfg=(1, 4, True, 1024))[0]
        assert (y.double() - want).abs().max().item() <= 0.5 * err_base
    with opsadv.use_backend("cuda", precision={"layer_norm": "fp64"}):
        c = next(c for c in opsadv.explain(op, x, w, *([b] if op == "layer_norm" else [])).candidates
                 if c.impl.id == impl)
    assert c.applies == ("norm=fp64",)
