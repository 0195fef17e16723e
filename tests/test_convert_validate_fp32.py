"""Half-precision validation against the original's own rounding: an output over the relative limit passes when its
error against the float32 original is within NOISE_FACTOR x the original's own (and KL / top-1 hold); it fails
otherwise, and when no float32 copy fits the metrics say why."""
import pytest
import torch

import opsadv
from opsadv.convert import validate as V
from opsadv.errors import ValidationError

tf = pytest.importorskip("transformers")


def _llama_bf16(layers=3):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _ids():
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, 101, (2, 13), generator=g)}


@pytest.fixture
def tight_bf16_limit(monkeypatch):
    """A relative limit no bf16 conversion meets: the float32 rule alone decides."""
    monkeypatch.setitem(V.REL_LIMIT, torch.bfloat16, 1e-12)


def test_within_the_originals_own_rounding_passes(tight_bf16_limit):
    conv = opsadv.convert_model(_llama_bf16(), backend="reference", floor=False, example_inputs=_ids())
    m = conv.opsadv_report.validation
    assert m["passed"] and m["rel_err"] > 1e-12 and "passed_by" in m
    assert 0 < m["rel_err_vs_fp32"] <= V.NOISE_FACTOR * m["orig_rel_err_vs_fp32"]


def test_beyond_the_originals_own_rounding_fails(tight_bf16_limit, monkeypatch):
    monkeypatch.setattr(V, "NOISE_FACTOR", 1e-6)
    with pytest.raises(ValidationError) as e:
        opsadv.convert_model(_llama_bf16(), backend="reference", floor=False, example_inputs=_ids())
    assert "orig_rel_err_vs_fp32" in str(e.value)


def test_a_wrong_conversion_fails_the_float32_rule_too(tight_bf16_limit, monkeypatch):
    """An error far beyond bf16 rounding (the converted norms scale their output) is not excused by the rule."""
    from opsadv.convert import modules
    orig = modules.OpsadvNorm.forward
    monkeypatch.setattr(modules.OpsadvNorm, "forward", lambda self, *a, **k: orig(self, *a, **k) * 1.05)
    with pytest.raises(ValidationError):
        opsadv.convert_model(_llama_bf16(), backend="reference", floor=False, example_inputs=_ids())


def test_no_fp32_copy_when_it_would_not_fit(tight_bf16_limit, monkeypatch):
    monkeypatch.setattr(V, "FP32_REF_MEMORY_SHARE", 0.0)
    conv = opsadv.convert_model(_llama_bf16(), backend="reference", floor=False, example_inputs=_ids(),
                                validate="warn")
    m = conv.opsadv_report.validation
    assert not m["passed"] and "float32 copy" in m["no_fp32_reference"]


def test_float32_models_are_judged_as_before():
    """No float32 copy is made of a float32 model (its limit is already the float32 one)."""
    torch.manual_seed(0)
    m = _llama_bf16().float()
    conv = opsadv.convert_model(m, backend="reference", floor=False, example_inputs=_ids())
    v = conv.opsadv_report.validation
    assert v["passed"] and "rel_err_vs_fp32" not in v and "no_fp32_reference" not in v


@pytest.mark.parametrize("masked", [False, True])
def test_compare_in_row_chunks_equals_one_pass(monkeypatch, masked):
    """compare() walks the rows in float64 chunks (a large batch's logits never exist whole in float64): chunks of
    7 rows give the metrics of one chunk holding every row, with padding rows excluded and a tie counted as one."""
    from opsadv.convert import validate as V
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 11, 50, generator=g)
    b = a + 0.05 * torch.randn(3, 11, 50, generator=g)
    b[0, 2] = a[0, 2]
    top = a[0, 2].topk(2).indices                 # a near-tie: the runner-up nudged past the top by less than the error
    b[0, 2, top[1]] = a[0, 2, top[0]] + 1e-3
    inputs = {"attention_mask": torch.ones(3, 11, dtype=torch.long)}
    if masked:
        inputs["attention_mask"][1, :4] = 0
        b[1, :4] = 1e6                            # padding rows: wrong by far, and excluded
    whole = V.compare({"logits": a}, {"logits": b}, inputs, torch.float32)
    monkeypatch.setattr(V, "CHUNK_ELEMENTS", 7 * 50)
    chunked = V.compare({"logits": a}, {"logits": b}, inputs, torch.float32)
    assert whole["tokens"] == (29 if masked else 33) and whole["top1_ties"] >= 1
    for k, v in whole.items():
        assert chunked[k] == pytest.approx(v, rel=1e-12), k
    # against a direct float64 computation over the real rows
    keep = inputs["attention_mask"].bool().reshape(-1)
    x, y = a.reshape(-1, 50)[keep].double(), b.reshape(-1, 50)[keep].double()
    assert whole["rel_err"] == pytest.approx(((y - x).norm() / x.norm()).item(), rel=1e-12)
    lp, lq = x.log_softmax(-1), y.log_softmax(-1)
    assert whole["kl"] == pytest.approx((lp.exp() * (lp - lq)).sum(-1).mean().item(), rel=1e-12)


def test_compare_non_finite_output_fails():
    from opsadv.convert import validate as V
    a = torch.randn(2, 5, 9)
    b = a.clone()
    b[1, 3, 2] = float("nan")
    m = V.compare({"logits": a}, {"logits": b}, {}, torch.float32)
    assert not m["passed"] and m["rel_err"] == float("inf") and m["kl"] == float("inf")
