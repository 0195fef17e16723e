"""The MLP training path: the weight gradient of gemm / swiglu_gemm lands in the weight's own layout (no
transposing copy by AccumulateGrad), every backward impl computes it that way, the ops' fakes promise that layout,
and the converted SwiGLU MLPs (separate gate / up projections fused as [W_gate|W_up], and Phi-3's gate_up_proj)
train like the modules they replace: gradients of the input, both weights and biases against float64, odd
shapes, strided inputs, gradient accumulation, an optimizer step, and without a copy of the fused weight."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opsadv
from opsadv.convert.modules import FusedSwiGLUMLP, SwiGLUMLP
from opsadv.core.op_common import as_weight_grad_layout, empty_weight_grad, transposed_weight, weight_grad
from opsadv.registry import get_registry

from conftest import HAS_CUDA, rel_err
from test_cuda_gemm import _ctx, _gemm_spec, _swiglu_spec

DEV = "cuda" if HAS_CUDA else "cpu"


def _layout_ok(db: torch.Tensor, b: torch.Tensor) -> bool:
    return db.t().is_contiguous() if transposed_weight(b) else db.is_contiguous()


def _b(kind: str, k: int, n: int, g) -> torch.Tensor:
    if kind == "weight_t":                              # nn.Linear weight.t()
        return torch.randn(n, k, generator=g).to(DEV).t()
    if kind == "row_major":
        return torch.randn(k, n, generator=g).to(DEV)
    return torch.randn(k, 2 * n, generator=g).to(DEV)[:, ::2]      # neither: strided columns


def test_layout_helpers():
    w = torch.randn(7, 5)
    assert transposed_weight(w.t()) and not transposed_weight(w) and not transposed_weight(w.t()[:, ::2])
    assert not transposed_weight(torch.randn(1, 5).t())                 # (5, 1): row-major as well
    for b in (w, w.t(), torch.randn(5, 14)[:, ::2]):
        e = empty_weight_grad(b)
        assert e.shape == b.shape and _layout_ok(e, b)
        fixed = as_weight_grad_layout(torch.randn(b.shape[1], b.shape[0]).t(), b)
        assert _layout_ok(fixed, b)
    a2, dz = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 7, dtype=torch.float64)
    for b in (w.t().double(), torch.randn(5, 7, dtype=torch.float64)):
        db = weight_grad(a2, dz, b)
        assert _layout_ok(db, b) and torch.allclose(db, a2.t() @ dz)


GEMM_IMPLS = ["reference.gemm", "cuda.cublas.gemm_epilogue", "cuda.triton.gemm", "cuda.triton.gemm_tma",
              "cuda.triton.gemm_persistent"]
SWIGLU_IMPLS = ["reference.swiglu_gemm", "cuda.cublas.swiglu_gemm", "cuda.triton.swiglu_gemm",
                "cuda.triton.swiglu_gemm_tma"]


def _impl(impl_id):
    return next(i for op in ("gemm", "swiglu_gemm") for i in get_registry().impls_by_op[op] if i.id == impl_id)


@pytest.mark.parametrize("impl_id", GEMM_IMPLS)
@pytest.mark.parametrize("kind", ["weight_t", "row_major", "strided"])
def test_gemm_backward_weight_grad_layout(impl_id, kind):
    """Each impl's own backward (no core fix-up in between) writes db in b's layout, with the right values."""
    if kind == "strided" and ("tma" in impl_id or "persistent" in impl_id):
        pytest.skip("TMA impls take 16-byte aligned rows")
    g = torch.Generator().manual_seed(len(kind) + len(impl_id))
    m, k, n = 19, 40, 24
    a = torch.randn(2, m, k, generator=g).to(DEV)
    b = _b(kind, k, n, g)
    go = torch.randn(2, m, n, generator=g).to(DEV)
    bias = torch.randn(n, generator=g).to(DEV)
    impl = _impl(impl_id)
    ctx = _ctx(_gemm_spec(a, b, bias, "gelu_tanh", None, 0.5, True)) if impl.backend == "cuda" else None
    for act in ("none", "gelu_tanh"):
        da, db, dbias = impl.backward(ctx, go, a, b, bias, act, 0.5)
        ref = _impl("reference.gemm").backward(None, go.double(), a.double(), b.double(), bias.double(), act, 0.5)
        assert _layout_ok(db, b), (impl_id, kind, act, db.stride())
        for got, want in zip((da, db, dbias), ref):
            assert rel_err(got, want) < 1e-4, (impl_id, kind, act)


@pytest.mark.parametrize("impl_id", SWIGLU_IMPLS)
@pytest.mark.parametrize("kind", ["weight_t", "row_major"])
def test_swiglu_gemm_backward_weight_grad_layout(impl_id, kind):
    g = torch.Generator().manual_seed(len(kind) + len(impl_id))
    m, k, n = 13, 32, 24
    x = torch.randn(m, k, generator=g).to(DEV)
    w = _b(kind, k, 2 * n, g)
    go = torch.randn(m, n, generator=g).to(DEV)
    impl = _impl(impl_id)
    ctx = _ctx(_swiglu_spec(x, w, None, True)) if impl.backend == "cuda" else None
    dx, dw, _ = impl.backward(ctx, go, x, w, None)
    rdx, rdw, _ = _impl("reference.swiglu_gemm").backward(None, go.double(), x.double(), w.double(), None)
    assert _layout_ok(dw, w), (impl_id, kind, dw.stride())
    assert rel_err(dx, rdx) < 1e-4 and rel_err(dw, rdw) < 1e-4


@pytest.mark.parametrize("kind", ["weight_t", "row_major", "strided"])
def test_backward_ops_keep_the_fake_layout(kind):
    """torch.ops.opsadv.{gemm,swiglu_gemm}_backward: real and fake outputs agree (strides included), and an impl
    returning another layout is put in the promised one."""
    g = torch.Generator().manual_seed(3)
    a, go = torch.randn(6, 16, generator=g), torch.randn(6, 12, generator=g)
    b = _b(kind, 16, 12, g).cpu()
    with opsadv.use_backend("reference"):
        torch.library.opcheck(torch.ops.opsadv.gemm_backward.default, (go, a, b, None, "none", 1.0))
        torch.library.opcheck(torch.ops.opsadv.swiglu_gemm_backward.default, (go[:, :6], a, b, None))
        _, db, _ = torch.ops.opsadv.gemm_backward(go, a, b, None, "none", 1.0)
    assert _layout_ok(db, b)


def test_core_fixes_an_impl_that_returns_another_layout(monkeypatch):
    from opsadv.core import dispatch
    real = dispatch.call

    def row_major_db(key, make_spec, args, *rest):             # an impl that ignores b's layout
        out = real(key, make_spec, args, *rest)
        return (out[0], out[1].contiguous(), out[2]) if key[0] == "gemm" and key[1] else out
    monkeypatch.setattr(dispatch, "call", row_major_db)
    a, go = torch.randn(6, 16), torch.randn(6, 12)
    b = torch.randn(12, 16).t()
    with opsadv.use_backend("reference"):
        _, db, _ = torch.ops.opsadv.gemm_backward(go, a, b, None, "none", 1.0)
    assert db.t().is_contiguous() and torch.allclose(db, a.t() @ go, atol=1e-5)


# ---- the converted MLPs in training ----------------------------------------------------------------------------
ACTS = {"silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}


class LlamaLikeMLP(nn.Module):
    """Llama's MLP (act silu) or Gemma's (act gelu_tanh: GeGLU)."""

    def __init__(self, hidden, inter, bias, act="silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act

    def forward(self, x):
        return self.down_proj(ACTS[self.act](self.gate_proj(x)) * self.up_proj(x))


class Phi3LikeMLP(nn.Module):
    def __init__(self, hidden, inter, bias, act="silu"):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act

    def forward(self, x):
        g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(ACTS[self.act](g) * u)


def _converted(orig):
    m = copy.deepcopy(orig)
    new = (SwiGLUMLP(m.gate_proj, m.up_proj, m.down_proj, activation=m.act) if isinstance(m, LlamaLikeMLP)
           else FusedSwiGLUMLP(m.gate_up_proj, m.down_proj, activation=m.act))
    with torch.no_grad():
        new(torch.randn(2, orig.down_proj.out_features))          # an inference call fuses [W_gate|W_up]
    return new


def _grads(module, x, go):
    x = x.detach().requires_grad_()
    out = module(x)
    out.backward(go)
    return out, x.grad, {n: p.grad for n, p in module.named_parameters()}


def _check_training(orig, conv, x, go, backend, tol):
    o64 = copy.deepcopy(orig).double()
    ref_out, ref_dx, ref_dp = _grads(o64, x.double(), go.double())
    with opsadv.use_backend(backend, precision="tf32") if backend == "cuda" else opsadv.use_backend(backend):
        out, dx, dp = _grads(conv, x, go)
    assert rel_err(out, ref_out) < tol and rel_err(dx, ref_dx) < tol
    assert set(dp) == set(ref_dp)
    for n, gr in dp.items():
        assert gr is not None and gr.shape == ref_dp[n].shape, n
        assert rel_err(gr, ref_dp[n]) < tol, n
    return dp


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 7, 24, 40), (1, 1, 8, 16), (2, 33, 40, 56)])
def test_swiglu_mlp_training_matches_float64(backend, bias, shape, act):
    b, s, hidden, inter = shape
    torch.manual_seed(sum(shape) + bias)
    orig = LlamaLikeMLP(hidden, inter, bias, act).to(DEV)
    conv = _converted(orig)
    x, go = torch.randn(b, s, hidden, device=DEV), torch.randn(b, s, hidden, device=DEV)
    with opsadv.trace() as t:
        dp = _check_training(orig, conv, x, go, backend, 1e-4)
    if backend == "cuda":
        assert t.counts["cuda.triton.swiglu"] == 2                # the pointwise op's kernels, forward and backward
    # the fused weight entered the graph without a copy; its gradient's row blocks became the two .grad tensors
    gw, uw = dp["gate_proj.weight"], dp["up_proj.weight"]
    assert gw.is_contiguous() and uw.is_contiguous()
    assert gw.untyped_storage().data_ptr() == uw.untyped_storage().data_ptr()
    assert uw.data_ptr() - gw.data_ptr() == gw.numel() * gw.element_size()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_strided_input_and_gradient_accumulation(backend, act):
    torch.manual_seed(11)
    orig = LlamaLikeMLP(24, 40, True, act).to(DEV)
    conv = _converted(orig)
    xs = torch.randn(5, 2, 24, device=DEV).transpose(0, 1)        # a non-contiguous (2, 5, 24) input
    assert not xs.is_contiguous()
    go = torch.randn(2, 5, 24, device=DEV)
    _check_training(orig, conv, xs, go, backend, 1e-4)
    first = {n: p.grad.clone() for n, p in conv.named_parameters()}
    _check_training(orig, copy.deepcopy(conv), xs, go, backend, 1e-4)    # (fresh grads on a copy)
    with opsadv.use_backend(backend, precision="tf32") if backend == "cuda" else opsadv.use_backend(backend):
        conv(xs).backward(go)                                      # a second backward accumulates
    for n, p in conv.named_parameters():
        assert rel_err(p.grad, 2 * first[n]) < 1e-5, n


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_optimizer_step_then_train_again(backend):
    """An optimizer step updates the parameters in place: the fused buffer (their storage) follows, and the next
    step's gradients are those of the updated weights; after .to() (no longer fused) training still works."""
    torch.manual_seed(12)
    orig = LlamaLikeMLP(16, 24, False).to(DEV)
    conv = _converted(orig)
    x, go = torch.randn(3, 16, device=DEV), torch.randn(3, 16, device=DEV)
    ctx = (lambda: opsadv.use_backend(backend, precision="tf32")) if backend == "cuda" else \
        (lambda: opsadv.use_backend(backend))
    opt_c = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(orig.parameters(), lr=1e-2)
    for _ in range(3):
        for m, opt in ((conv, opt_c), (orig, opt_o)):
            opt.zero_grad(set_to_none=True)
            with ctx():
                m(x).backward(go)
            opt.step()
    for (n, p), q in zip(conv.named_parameters(), orig.parameters()):
        assert rel_err(p, q) < 1e-4, n
    moved = copy.deepcopy(conv).double()                          # the views are gone: a concatenation serves
    moved.zero_grad(set_to_none=True)
    with opsadv.use_backend("reference"):
        moved(x.double()).backward(go.double())
    ref = copy.deepcopy(orig).double()
    ref(x.double()).backward(go.double())
    for (n, p), q in zip(moved.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-6, n


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("bias", [False, True])
def test_phi3_gate_up_mlp_training(backend, bias, act):
    torch.manual_seed(13 + bias)
    orig = Phi3LikeMLP(24, 40, bias, act).to(DEV)
    conv = _converted(orig)
    x, go = torch.randn(2, 9, 24, device=DEV), torch.randn(2, 9, 24, device=DEV)
    dp = _check_training(orig, conv, x, go, backend, 1e-4)
    assert dp["gate_up_proj.weight"].is_contiguous()             # written in the weight's layout


def test_qkv_fused_weight_gradients_share_one_buffer():
    """The same no-copy path serves the fused [W_q|W_k|W_v] of a converted attention block."""
    from opsadv.convert.modules import QKVGroup, QKVProjection
    torch.manual_seed(14)
    lins = [nn.Linear(16, n) for n in (16, 8, 8)]
    ref = [copy.deepcopy(lin).double() for lin in lins]
    group = QKVGroup(*lins)
    projs = [QKVProjection(lin, r, group) for r, lin in enumerate(lins)]
    with torch.no_grad(), opsadv.use_backend("reference"):
        for p in projs:
            p(torch.randn(2, 16))                                  # fuses
    x = torch.randn(3, 16)
    with opsadv.use_backend("reference"):
        outs = [p(x) for p in projs]
    sum(o.square().sum() for o in outs).backward()
    xd = x.double()
    sum(r(xd).square().sum() for r in ref).backward()
    for lin, r in zip(lins, ref):
        assert rel_err(lin.weight.grad, r.weight.grad) < 1e-5 and rel_err(lin.bias.grad, r.bias.grad) < 1e-5
    ptrs = {lin.weight.grad.untyped_storage().data_ptr() for lin in lins}
    assert len(ptrs) == 1


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("fused", [False, True])
def test_no_grad_calls_run_swiglu_gemm_for_silu_only(act, fused):
    """Inference: SwiGLU runs the fused-epilogue swiglu_gemm; GeGLU (no gelu_tanh epilogue there) runs the GEMM
    then swiglu(activation="gelu_tanh"); both match float64."""
    torch.manual_seed(16 + fused)
    orig = (Phi3LikeMLP if fused else LlamaLikeMLP)(24, 40, True, act)
    conv = _converted(orig)
    x = torch.randn(3, 5, 24)
    with opsadv.use_backend("reference"), opsadv.trace() as t, torch.no_grad():
        out = conv(x)
    assert rel_err(out, copy.deepcopy(orig).double()(x.double())) < 1e-5
    if act == "silu":
        assert "reference.swiglu_gemm" in t.counts and "reference.swiglu" not in t.counts, t.counts
    else:
        assert t.counts.get("reference.swiglu") == 1 and "reference.swiglu_gemm" not in t.counts, t.counts
    assert conv.activation == act and f"activation={act}" in repr(conv)


@pytest.mark.parametrize("act_name,kind", [("silu", "SwiGLU"), ("gelu_pytorch_tanh", "GeGLU"), ("gelu_new", "GeGLU"),
                                           ("gelu", None), ("relu", None)])
def test_the_mlp_pass_recognizes_gated_activations(act_name, kind):
    """transformers' activation modules decide by what they compute: SiLU -> SwiGLU, tanh GELU (GELUTanh /
    PytorchGELUTanh, NewGELU) -> GeGLU, the others are reported with the reason; a GeGLU conversion trains like the
    original (float64)."""
    from transformers.activations import ACT2FN
    from opsadv.convert.passes import _mlp_candidate

    class HFMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)
            self.act_fn = ACT2FN[act_name]

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    torch.manual_seed(15)
    orig = HFMLP()
    new, desc = _mlp_candidate(copy.deepcopy(orig))
    if kind is None:
        assert new is None and "gated kernels" in desc
        return
    assert isinstance(new, SwiGLUMLP) and desc.startswith(kind)
    assert new.activation == ("silu" if kind == "SwiGLU" else "gelu_tanh")
    x, go = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    xd = x.double().requires_grad_()
    o64 = copy.deepcopy(orig).double()
    o64(xd).backward(go.double())
    xc = x.clone().requires_grad_()
    with opsadv.use_backend("reference"):
        new(xc).backward(go)
    assert rel_err(xc.grad, xd.grad) < 1e-5
    for (n, p), q in zip(new.named_parameters(), o64.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, n
