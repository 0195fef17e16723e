"""convert_model on a PEFT (LoRA) model, the usual way to fine-tune: the transformers model inside the wrapper is
converted (attention, rotary, norms, the fused loss), the adapter-wrapped projections stay the adapter's own code
with a reason in the report, and a training step on a padded batch gives the unconverted wrapper's loss and adapter
gradients (float32, reference backend; bounds as tests/test_convert_architectures.py's)."""
import copy

import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from test_convert_architectures import _build, assert_same_grads, train_step_losses  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("model_type,targets", [("llama", ALL), ("qwen2", ["q_proj", "v_proj"]), ("gpt2", ["c_attn"])])
def test_lora_model_converts_and_trains_as_before(model_type, targets):
    model, x, labels, _ = _build("causal", model_type)
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                         init_lora_weights=False))
    ref = copy.deepcopy(wrapped)
    conv = opsadv.convert_model(wrapped, floor=False, backend="reference")
    assert conv is wrapped and conv.opsadv_report.status == "converted"
    rep = conv.opsadv_report
    kinds = {c.kind for c in rep.changes}
    assert {"attention", "replaced"} <= kinds and any("ForCausalLMLoss" in c.what for c in rep.changes), str(rep)
    if "q_proj" in targets:      # adapter-wrapped projections are not fused away, and the report says why
        skipped = [c for c in rep.changes if c.kind == "skipped" and "adapter" in c.reason]
        assert skipped and all("peft" in c.reason for c in skipped), str(rep)
    with pytest.raises(InvalidArgumentError, match="not converted yet"):
        opsadv.convert_model(wrapped, floor=False, backend="reference")

    loss0, loss1 = train_step_losses(ref, conv, x, labels)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0)
    g0 = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    g1 = {n: p.grad for n, p in conv.named_parameters() if p.grad is not None}
    assert g0 and set(g0) == set(g1) and all("lora_" in n for n in g0)       # only the adapters train
    assert_same_grads(ref, conv, model_type, both_ways=True)


AFTER = [("causal", "llama", ["q_proj", "v_proj", "up_proj", "down_proj"]), ("causal", "phi3", ["gate_up_proj"]),
         ("causal", "gpt2", ["c_attn", "c_fc"]), ("encoder", "bert", ["query", "value", "dense"])]


@pytest.mark.parametrize("kind,model_type,targets", AFTER, ids=[t for _, t, _ in AFTER])
def test_lora_added_after_conversion_trains_as_on_the_original(kind, model_type, targets):
    """get_peft_model(convert_model(model)): the adapters wrap projections that conversion fused (q/k/v, gate/up,
    GEMM + activation, dense + residual + norm) or kept; their terms are in the loss and only they train, as on the
    unconverted model."""
    model, x, labels, _ = _build(kind, model_type)
    cfg = dict(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    assert any(c.kind == "fused" for c in conv.opsadv_report.changes), str(conv.opsadv_report)
    torch.manual_seed(0)
    ref = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    torch.manual_seed(0)
    got = peft.get_peft_model(conv, peft.LoraConfig(**cfg))
    loss0, loss1 = train_step_losses(ref, got, x, labels)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0)
    g0 = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    g1 = {n: p.grad for n, p in got.named_parameters() if p.grad is not None}
    assert g0 and set(g0) == set(g1) and all("lora_" in n or "classifier" in n for n in g0)
    assert_same_grads(ref, got, model_type, both_ways=True)
    got.eval()
    with torch.no_grad():                            # the adapters' terms are there: without them the output moves
        with got.disable_adapter():
            plain = got(**x).logits
        assert (got(**x).logits - plain).abs().max() > 1e-3
