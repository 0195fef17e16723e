"""GeGLU: the swiglu op with activation="gelu_tanh" (y = gelu_tanh(g) * u for gate_up = [g | u]) through every call
path (eager direct / autograd / fast path, torch.ops, torch.compile), torch.library.opcheck of its custom ops, the
bad-activation error, impls without feature act_gelu_tanh refused with the reason (never silently run silu), and
convert_model on tiny Gemma / Gemma2 / Phi-3-with-GeGLU models (transformers configs in code, random weights): the
gated MLPs rewritten, logits and gradients as the unconverted model's, the floor judging the rewrite.  The Triton
kernels' numerics (interpreter, fp32 / fp16, odd shapes, every tile): test_cuda_swiglu.py."""
import copy

import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv import KernelImpl
from opsadv.convert.modules import FusedSwiGLUMLP, SwiGLUMLP
from opsadv.errors import InvalidArgumentError
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

from conftest import rel_err

tf = pytest.importorskip("transformers")


def _ref(gate_up: torch.Tensor) -> torch.Tensor:
    """float64 oracle: torch's tanh GELU (transformers' gelu_pytorch_tanh)."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


def _fwd_bwd(gate_up, backend, **kw):
    x = gate_up.detach().requires_grad_()
    with opsadv.use_backend(backend), opsadv.trace() as t:
        y = opsadv.ops.swiglu(x, activation="gelu_tanh", **kw)
        go = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, go)
    x64 = gate_up.detach().double().requires_grad_()
    ref = _ref(x64)
    (rdx,) = torch.autograd.grad(ref, x64, go.double())
    return y, dx, ref, rdx, t.counts


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("rows", [1, 3, 127])
def test_geglu_odd_rows_strided_and_fast_path(backend, rows):
    """Fresh random inputs, odd rows, N = 65 (not a multiple of any block), contiguous / strided rows / a strided
    last dim; each twice (the second identical call takes the fast path); forward and gradient against float64."""
    impl = "reference.swiglu" if backend == "reference" else "cuda.triton.swiglu"
    base = torch.randn(2 * rows, 2 * 65) * 3
    for gu in (base[:rows], base[::2], torch.randn(2 * 65, rows).t()):
        for _ in range(2):
            y, dx, ref, rdx, counts = _fwd_bwd(gu, backend)
            assert y.shape == ref.shape and dx.shape == gu.shape and dx.dtype == gu.dtype
            assert rel_err(y, ref) < 1e-6 and rel_err(dx, rdx) < 1e-6
            assert counts[impl] == 2, counts
        with opsadv.use_backend(backend), torch.no_grad():      # no-grad calls (and their fast path)
            for _ in range(2):
                assert rel_err(opsadv.ops.swiglu(gu, activation="gelu_tanh"), _ref(gu.double())) < 1e-6


def test_geglu_and_swiglu_do_not_share_a_fast_path_entry():
    """The same tensor metadata with the two activations: each call computes its own activation."""
    gu = torch.randn(5, 2 * 12) * 3
    with opsadv.use_backend("reference"), torch.no_grad():
        for _ in range(3):
            s = opsadv.ops.swiglu(gu)
            g = opsadv.ops.swiglu(gu, activation="gelu_tanh")
            g2, u = gu.double().chunk(2, dim=-1)
            assert rel_err(s, F.silu(g2) * u) < 1e-6 and rel_err(g, _ref(gu.double())) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_geglu_reference_is_float64_exact_and_keeps_dtype(dtype):
    from opsadv.ops.swiglu import reference as R
    gu = (torch.randn(7, 2 * 33, dtype=torch.float64) * 3)
    go = torch.randn(7, 33, dtype=torch.float64)
    y = R.swiglu_act_fwd(None, gu, "gelu_tanh")
    assert y.dtype == torch.float64 and rel_err(y, _ref(gu)) < 1e-14
    x = gu.clone().requires_grad_()
    (rdx,) = torch.autograd.grad(_ref(x), x, go)
    assert rel_err(R.swiglu_act_bwd(None, go, gu, "gelu_tanh"), rdx) < 1e-14
    assert R.swiglu_act_fwd(None, gu.to(dtype), "gelu_tanh").dtype == dtype
    assert R.swiglu_act_bwd(None, go.to(dtype), gu.to(dtype), "gelu_tanh").dtype == dtype


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_opcheck_of_the_custom_ops(backend):
    gu = torch.randn(6, 2 * 10) * 3
    with opsadv.use_backend(backend):
        torch.library.opcheck(torch.ops.opsadv.swiglu.default, (gu, "gelu_tanh"))
        torch.library.opcheck(torch.ops.opsadv.swiglu.default, (gu.clone().requires_grad_(), "gelu_tanh"))
        torch.library.opcheck(torch.ops.opsadv.swiglu.default, (gu.clone().requires_grad_(),))       # (silu default)
        torch.library.opcheck(torch.ops.opsadv.swiglu_backward.default, (torch.randn(6, 10), gu, "gelu_tanh"),
                              test_utils=("test_schema", "test_faketensor"))                        # (no double backward)
        y = torch.ops.opsadv.swiglu(gu, "gelu_tanh")
    assert rel_err(y, _ref(gu.double())) < 1e-6


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_compiled_training_matches_float64(backend):
    import torch._dynamo
    gu = (torch.randn(6, 2 * 20) * 3).requires_grad_()
    go = torch.randn(6, 20)
    f = lambda t: opsadv.ops.swiglu(t, activation="gelu_tanh")  # noqa: E731
    try:
        with opsadv.use_backend(backend), opsadv.trace() as t:
            y = torch.compile(f, backend="aot_eager", fullgraph=True)(gu)
            (dc,) = torch.autograd.grad(y, gu, go)
    finally:
        torch._dynamo.reset()
    x64 = gu.detach().double().requires_grad_()
    ref = _ref(x64)
    (rdx,) = torch.autograd.grad(ref, x64, go.double())
    assert rel_err(y, ref) < 1e-6 and rel_err(dc, rdx) < 1e-6
    assert sum(t.counts.values()) == 2, t.counts


@pytest.mark.parametrize("bad", ["gelu", "relu", "GELU_TANH", None, 3])
def test_bad_activation_names_op_argument_expected_and_given(bad):
    with pytest.raises(InvalidArgumentError) as e:
        opsadv.ops.swiglu(torch.randn(3, 8), activation=bad)
    msg = str(e.value)
    assert "swiglu" in msg and "activation" in msg and "'silu'" in msg and "'gelu_tanh'" in msg and repr(bad) in msg
    with pytest.raises(InvalidArgumentError, match="activation"):
        opsadv.explain("swiglu", torch.randn(3, 8), activation=bad)
    with pytest.raises(InvalidArgumentError, match="activation"):         # also under grad and after a good call
        opsadv.ops.swiglu(torch.randn(3, 8, requires_grad=True), activation="silu")
        opsadv.ops.swiglu(torch.randn(3, 8, requires_grad=True), activation=bad)


def test_empty_input_geglu():
    gu = torch.randn(0, 2 * 5, requires_grad=True)
    y = opsadv.ops.swiglu(gu, activation="gelu_tanh")
    assert y.shape == (0, 5)
    y.sum().backward()
    assert gu.grad.shape == gu.shape


# ---- an impl without GeGLU: refused for it, with the reason; SwiGLU calls keep the one-tensor contract --------
class SiluOnly:
    calls: list = []

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="siluonly", device_types=("cpu",), auto_priority=500)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @staticmethod
    def fwd(ctx, gate_up):                      # the pre-GeGLU contract: no activation argument
        SiluOnly.calls.append("fwd")
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u

    @staticmethod
    def bwd(ctx, grad, gate_up):
        SiluOnly.calls.append("bwd")
        from opsadv.core.activations import swiglu_grad
        return swiglu_grad(grad, gate_up)

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        registry.add(KernelImpl(id="siluonly.swiglu", op="swiglu", backend="siluonly", fn=self.fwd,
                                backward=self.bwd, priority=500, device_types=("cpu",), dtypes=(torch.float32,),
                                features=frozenset({"batched"})))


@pytest.fixture
def siluonly():
    from opsadv.registry import reset_registry
    reg = reset_registry()
    rec = reg.register_plugin(SiluOnly(), name="siluonly")
    SiluOnly.calls = []
    yield rec
    reset_registry()


def test_impl_without_the_feature_is_refused_for_geglu(siluonly):
    gu = torch.randn(4, 2 * 8) * 3
    with opsadv.use_backend("auto"):
        assert opsadv.explain("swiglu", gu).chosen == "siluonly.swiglu"
        exp = opsadv.explain("swiglu", gu, activation="gelu_tanh")
        assert exp.chosen != "siluonly.swiglu"
        rej = next(c for c in exp.candidates if c.impl.id == "siluonly.swiglu")
        assert not rej.accepted and any("does not support act_gelu_tanh" in r for r in rej.reasons), rej.reasons
        x = gu.clone().requires_grad_()
        opsadv.ops.swiglu(x).sum().backward()                   # SwiGLU: the silu-only impl, its own contract
        assert SiluOnly.calls == ["fwd", "bwd"]
        SiluOnly.calls.clear()
        x = gu.clone().requires_grad_()
        y = opsadv.ops.swiglu(x, activation="gelu_tanh")
        y.backward(torch.ones_like(y))
    assert SiluOnly.calls == []                                 # never ran GeGLU calls (as silu)
    x64 = gu.double().requires_grad_()
    r = _ref(x64)
    r.backward(torch.ones_like(r))
    assert rel_err(y, r) < 1e-6 and rel_err(x.grad, x64.grad) < 1e-6


def test_declared_features():
    from opsadv.registry import get_registry
    impls = {i.id: i for i in get_registry().impls_by_op["swiglu"]}
    assert "act_gelu_tanh" in impls["reference.swiglu"].features
    assert "act_gelu_tanh" in impls["cuda.triton.swiglu"].features
    assert "act_gelu_tanh" in opsadv.explain("swiglu", torch.randn(2, 4), activation="gelu_tanh").spec.features
    assert "act_gelu_tanh" not in opsadv.explain("swiglu", torch.randn(2, 4)).spec.features


# ---- convert_model: Gemma-style GeGLU MLPs ---------------------------------------------------------------------
_TINY = dict(hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, vocab_size=97, max_position_embeddings=64)     # (head_dim 32: the cuda kernels' smallest)


def _gemma(seed=0):
    torch.manual_seed(seed)
    cfg = tf.GemmaConfig(**_TINY, hidden_act="gelu_pytorch_tanh")
    cfg._attn_implementation = "sdpa"
    return tf.GemmaForCausalLM(cfg)


def _gemma2(seed=0):
    torch.manual_seed(seed)
    cfg = tf.Gemma2Config(**_TINY, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
                          sliding_window=8, attn_logit_softcapping=None, final_logit_softcapping=30.0)
    cfg._attn_implementation = "eager"
    return tf.Gemma2ForCausalLM(cfg)


def _phi3_geglu(seed=0):
    """Phi-3's fused gate_up_proj MLP with a tanh-GELU activation (GeGLU over one Linear)."""
    torch.manual_seed(seed)
    cfg = tf.Phi3Config(**{k: v for k, v in _TINY.items() if k != "head_dim"}, hidden_act="gelu_pytorch_tanh",
                        pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return tf.Phi3ForCausalLM(cfg)


def _inputs(b=2, s=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


MODELS = {"gemma": _gemma, "gemma2": _gemma2, "phi3_geglu": _phi3_geglu}


# (Gemma2 under cuda: its sliding-window layers hand attention a bool mask, which the cuda attention kernels do not
# take on CPU tensors; the GeGLU MLP is the same module as Gemma's)
@pytest.mark.parametrize("name,backend", [("gemma", "reference"), ("gemma2", "reference"), ("phi3_geglu", "reference"),
                                          ("gemma", "cuda"), ("phi3_geglu", "cuda")])
def test_tiny_gemma_converts_with_geglu_and_matches(name, backend):
    orig = MODELS[name]().eval()
    x = _inputs()
    # cuda (the interpreter): fp32 inputs run tensor-core GEMMs in tf32 and attention in fp16 (test_model_matrix's
    # _convert_for), so its tolerances are those; the GeGLU kernel itself computes in float32
    kw = {"precision": opsadv.PrecisionPolicy(matmul="tf32", attention="fp16")} if backend == "cuda" else {}
    tol = {"logits": 1e-5, "loss": 1e-5, "grad": 1e-4} if backend == "reference" else \
        {"logits": 5e-3, "loss": 1e-3, "grad": 5e-2}
    conv = opsadv.convert_model(copy.deepcopy(orig), backend=backend, validate=True,
                                example_inputs={"input_ids": x["input_ids"]}, **kw)
    rep = conv.opsadv_report
    text = str(rep)
    assert rep.validation["passed"], text
    mlps = [m for m in conv.modules() if isinstance(m, SwiGLUMLP)]
    assert len(mlps) == 2 and all(m.activation == "gelu_tanh" for m in mlps), text
    if name == "phi3_geglu":
        assert all(isinstance(m, FusedSwiGLUMLP) for m in mlps) and "fused gate_up_proj GeGLU MLP" in text
    else:
        assert "GeGLU MLP" in text
    assert sorted(conv.state_dict()) == sorted(orig.state_dict())
    impl = f"{backend}.swiglu" if backend == "reference" else "cuda.triton.swiglu"
    # inference: logits as the unconverted model's
    with torch.no_grad(), opsadv.trace() as t:
        a, b = orig(input_ids=x["input_ids"]).logits, conv(input_ids=x["input_ids"]).logits
    assert t.counts.get(impl) == 2, t.counts                     # one GeGLU per layer
    assert "reference.swiglu_gemm" not in t.counts and not any("swiglu_gemm" in k for k in t.counts)
    assert rel_err(b, a) < tol["logits"]
    # training: loss and every parameter's gradient
    orig.train()
    conv.train()
    lo = orig(**x).loss
    lo.backward()
    with opsadv.trace() as t:
        lc = conv(**x).loss
        lc.backward()
    assert t.counts.get(impl) == 4, t.counts                     # forward and backward per layer
    assert abs(lo.item() - lc.item()) <= tol["loss"] * abs(lo.item())
    from opsadv.bench import model_zoo as Z
    g = Z.grad_errors(orig, conv)
    assert g["params"] > 0 and not g["missing"] and g["max_rel_err"] < tol["grad"], g
    # the GeGLU MLPs' own parameters, tightly: their gradients against float64 of the unconverted MLP on the same
    # input (the model's other ops' precision out of the way)
    for mo, mc in zip([m for m in orig.modules() if type(m).__name__.endswith("MLP")], mlps):
        h = torch.randn(2, 5, 64)
        o64 = copy.deepcopy(mo).double()
        o64(h.double()).square().sum().backward()
        mc.zero_grad(set_to_none=True)
        with opsadv.use_backend(backend, **kw):
            mc(h).square().sum().backward()
        for (n, p), q in zip(mc.named_parameters(), o64.parameters()):
            assert rel_err(p.grad, q.grad) < (1e-5 if backend == "reference" else 2e-3), n


def test_geglu_mlp_is_judged_by_the_floor():
    """The GeGLU rewrite is the floor's "mlp" step, as every MLP rewrite: measured slower (a fake timer), undone and
    reported; measured faster, kept."""
    from test_convert_floor import FakeTimer
    x = {"input_ids": _inputs()["input_ids"]}
    for cost, kept in ((+2.0, False), (-2.0, True)):
        m = _gemma(seed=3).eval()
        ref = m(**x).logits
        timer = FakeTimer(m, {SwiGLUMLP: cost})
        conv = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=timer, floor_inputs=x)
        rep = conv.opsadv_report
        by_kind = {d["kind"]: d for d in rep.floor}
        assert by_kind["mlp"]["kept"] is kept
        assert any(isinstance(mm, SwiGLUMLP) for mm in conv.modules()) is kept
        if not kept:
            assert any(c.kind == "kept" and "mlp" in c.what.lower() for c in rep.changes), str(rep)
        torch.testing.assert_close(conv(**x).logits, ref, rtol=1e-4, atol=1e-4)
