"""T5's gated MLP (T5DenseGatedActDense: wo(dropout(act(wi_0(x)) * wi_1(x)))) is rewritten into one [W_wi_0|W_wi_1]
GEMM + the swiglu op, its child names (and state_dict keys) kept: outputs and gradients equal the original's in
float32 (eval, and training with dropout under the same seed), a float32 `wo` under a bfloat16 model (T5's
_keep_in_fp32_modules) gets the product cast first (and the norms after it hand bfloat16 on, as T5LayerNorm does),
and activations without a gated kernel are left alone."""
import copy

import pytest
import torch

import opsadv

from conftest import rel_err

transformers = pytest.importorskip("transformers")
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402


def _t5(ff="gated-gelu", dropout=0.0, seed=0):
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=97, d_model=48, d_kv=16, d_ff=72, num_layers=2, num_decoder_layers=1, num_heads=3,
                   feed_forward_proj=ff, dropout_rate=dropout)
    return T5ForConditionalGeneration(cfg)


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(0, 97, (3, 11), generator=g),
                decoder_input_ids=torch.randint(0, 97, (3, 7), generator=g))


def _convert(m, x):
    return opsadv.convert_model(copy.deepcopy(m), floor=False, backend="reference", example_inputs=x)


def _gated(model):
    return [type(b.layer[-1].DenseReluDense).__name__ for b in (*model.encoder.block, *model.decoder.block)]


@pytest.mark.parametrize("ff", ["gated-gelu", "gated-silu"])
def test_gated_mlp_rewritten_names_kept_outputs_equal(ff):
    m, x = _t5(ff).eval(), _inputs()
    conv = _convert(m, x)
    assert _gated(conv) == ["NamedGatedMLP"] * 3
    assert list(conv.state_dict()) == list(m.state_dict())
    fused = [c for c in conv.opsadv_report.changes if "wi_0, wi_1, wo" in c.what]
    assert len(fused) == 3 and ("GeGLU" if ff == "gated-gelu" else "SwiGLU") in fused[0].what
    with torch.no_grad():
        assert rel_err(conv(**_inputs(2)).logits, m(**_inputs(2)).logits) < 1e-5


def test_training_with_dropout_matches_under_the_same_seed():
    m, x = _t5(dropout=0.2), _inputs()
    conv = _convert(m, x)
    m.train(), conv.train()
    outs = []
    for model in (m, conv):
        torch.manual_seed(7)
        out = model(**_inputs(3), labels=_inputs(4)["decoder_input_ids"])
        out.loss.backward()
        outs.append(out)
    assert rel_err(outs[1].logits, outs[0].logits) < 1e-5
    for name in ("wi_0", "wi_1", "wo"):
        a = getattr(m.encoder.block[0].layer[1].DenseReluDense, name).weight.grad
        b = getattr(conv.encoder.block[0].layer[1].DenseReluDense, name).weight.grad
        assert rel_err(b, a) < 1e-5, name


def test_float32_wo_under_a_bfloat16_model_gets_the_product_cast():
    m = _t5().to(torch.bfloat16).eval()
    for b in (*m.encoder.block, *m.decoder.block):
        b.layer[-1].DenseReluDense.wo.float()           # T5's _keep_in_fp32_modules = ["wo"]
    x = _inputs()
    conv = _convert(m, x)
    assert _gated(conv) == ["NamedGatedMLP"] * 3
    mlp = conv.encoder.block[0].layer[1].DenseReluDense
    h = torch.randn(2, 5, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        want = m.encoder.block[0].layer[1].DenseReluDense(h)
        got = mlp(h)
    assert got.dtype == want.dtype == torch.float32 and rel_err(got, want) < 2e-2
    # the float32 MLP output makes the residual stream float32: T5LayerNorm hands bfloat16 on to the next layer's
    # projections (the norm rewrite keeps that rule: cast_to_weight), and the whole model still runs
    assert all(n.cast_to_weight for n in conv.modules() if type(n).__name__ == "OpsadvNorm")
    with torch.no_grad():
        assert rel_err(conv(**_inputs(2)).logits.float(), m(**_inputs(2)).logits.float()) < 3e-2


def test_relu_gated_mlp_is_left_with_the_reason():
    m, x = _t5("gated-relu").eval(), _inputs()
    conv = _convert(m, x)
    assert _gated(conv) == ["T5DenseGatedActDense"] * 3
    why = [c.reason for c in conv.opsadv_report.changes if c.kind == "skipped" and "wi_0, wi_1" in c.reason]
    assert why and "ReLU" in why[0]
