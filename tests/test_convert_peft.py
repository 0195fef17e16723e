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
