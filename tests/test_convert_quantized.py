"""Models whose linear layers hold quantized weights (bitsandbytes' Linear4bit / Linear8bitLt for QLoRA, torchao's
tensor subclasses): nn.Linear subclasses whose weight is packed integer storage that only their own forward can
read.  convert_model leaves those layers computing as they do (no fused q|k|v or gate|up GEMM, no FP8 copy, no fused
loss over a quantized lm_head), says so in the report, and converts the rest (attention, norms, rotary); the
outputs and a training step's loss and gradients equal the unconverted quantized model's.  Simulated here with an
int8 weight-only Linear (bitsandbytes itself needs a GPU for its training path)."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opsadv
from opsadv.convert.modules import quantized_linear

pytest.importorskip("transformers")
from test_convert_architectures import _build, _rel, assert_same_grads  # noqa: E402


class Int8Weight(nn.Parameter):
    """Packed storage (int8 codes), as bitsandbytes' Params4bit / Int8Params are Parameter subclasses."""


class Int8Linear(nn.Linear):
    """Weight-only int8: codes and a per-row scale; the forward dequantizes (what such a layer's kernel does)."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None)
        w = lin.weight.detach()
        scale = w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        self.weight = Int8Weight(torch.round(w / scale).to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)
        if lin.bias is not None:
            self.bias = nn.Parameter(lin.bias.detach().clone())

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype), self.bias)


def _quantize(model, names=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    for m in list(model.modules()):
        for n, child in list(m.named_children()):
            if n in names and type(child) is nn.Linear:
                setattr(m, n, Int8Linear(child))
    return model


def test_quantized_linear_is_recognised():
    lin = nn.Linear(8, 4)
    assert quantized_linear(lin) is None
    assert quantized_linear(Int8Linear(lin)) == "Int8Linear (Int8Weight int8)"
    fp = nn.Linear(8, 4)
    fp.weight = nn.Parameter(fp.weight.detach().half())
    assert quantized_linear(fp) is None                          # a float weight in another dtype is plain


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_quantized_projections_are_left_and_the_rest_converted(arch):
    model, x, _, _ = _build("causal", arch)
    qm = _quantize(model)
    conv = opsadv.convert_model(copy.deepcopy(qm), floor=False, backend="reference", example_inputs=x)
    text = str(conv.opsadv_report)
    assert "quantized q_proj, k_proj, v_proj (Int8Linear (Int8Weight int8))" in text or arch == "phi3", text
    assert "quantized gate_proj, up_proj, down_proj (Int8Linear (Int8Weight int8))" in text or arch == "phi3", text
    assert "attention implementation 'sdpa' -> 'opsadv'" in text and "opsadv.rms_norm" in text
    layers = conv.model.layers
    assert all(type(getattr(l.self_attn, n, None)) in (Int8Linear, type(None)) for l in layers
               for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    with torch.no_grad():
        want = qm(**x).logits
        with opsadv.trace() as t:
            got = conv(**x).logits
    assert _rel(got, want) < 1e-5 and "reference.gemm" not in t.counts and "reference.swiglu_gemm" not in t.counts
    labels = {"labels": x["input_ids"]}
    for m in (qm, conv):
        m.train()
        m(**x, **labels).loss.backward()
    assert_same_grads(qm, conv, f"{arch} int8", both_ways=True)


def test_quantized_lm_head_keeps_the_models_loss():
    model, x, _, _ = _build("causal", "llama")
    model.config.tie_word_embeddings = False
    model.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    qm = _quantize(model, names=("lm_head",))
    conv = opsadv.convert_model(copy.deepcopy(qm), floor=False, backend="reference", example_inputs=x)
    assert "lm_head is quantized (Int8Linear (Int8Weight int8))" in str(conv.opsadv_report)
    for m in (qm, conv):
        m.train()
    with opsadv.trace() as t:
        got = conv(**x, labels=x["input_ids"])
    want = qm(**x, labels=x["input_ids"])
    assert got.logits is not None and "reference.linear_cross_entropy" not in t.counts
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())


def test_fp8_leaves_quantized_linears():
    model, x, _, _ = _build("causal", "llama")
    qm = _quantize(model, names=("o_proj",))
    conv = opsadv.convert_model(copy.deepcopy(qm), floor=False, backend="reference", example_inputs=x,
                                precision="fp8", validate=False)
    assert all(type(l.self_attn.o_proj) is Int8Linear for l in conv.model.layers)


def test_no_gradient_reaching_an_op_gives_none_for_its_inputs():
    """A consumer whose backward returns no input gradient (a quantized layer that computes none) leaves the op's
    backward with None for every output: the op returns None for its inputs, as aten's formulas do."""

    class NoInputGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, w):
            ctx.save_for_backward(t)
            return t * w

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            return None, (g * t).sum()

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    x = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    nw = torch.ones(8, dtype=torch.float64, requires_grad=True)
    w = torch.ones((), dtype=torch.float64, requires_grad=True)
    lay = opsadv.SparseLayout.dense(5, causal=True, block_size=4)
    with opsadv.use_backend("reference"):
        outs = [opsadv.ops.flash_attention(q, k, v, causal=True), opsadv.ops.sparse_attention(q, k, v, lay),
                opsadv.ops.rms_norm(x, nw)]
        for out in outs:
            NoInputGrad.apply(out, w).sum().backward()
    assert q.grad is None and k.grad is None and v.grad is None and x.grad is None and nw.grad is None
    assert w.grad is not None
