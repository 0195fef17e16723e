"""Optimizer.export(model, path): example inputs generated for transformers models, batch and sequence dims
dynamic by default, so the loaded program runs at other batch sizes / lengths and matches the eager original."""
import copy

import pytest
import torch

import opsadv
from opsadv.convert.export import _pinned_dims, auto_dynamic_shapes

tf = pytest.importorskip("transformers")
from test_convert_generated_inputs import tiny  # noqa: E402


def _llama():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()


def _bert():
    torch.manual_seed(0)
    return tf.BertModel(tf.BertConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=128)).eval()


def _tokens(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    am = torch.ones(b, s, dtype=torch.long)
    am[-1, s - s // 3:] = 0
    return {"input_ids": torch.randint(0, 128, (b, s), generator=g), "attention_mask": am}


def _rel(a, b, keep=None):
    a, b = a.double(), b.double()
    if keep is not None:
        a, b = a[keep], b[keep]
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_export_without_inputs_runs_at_other_shapes(tmp_path, arch, reference_backend):
    m = _llama() if arch == "llama" else _bert()
    orig = copy.deepcopy(m)
    key = "logits" if arch == "llama" else "last_hidden_state"
    path = tmp_path / f"{arch}.pt2"
    opsadv.Optimizer(device="cpu", floor=False).export(m, path)           # no example inputs
    note = m.opsadv_report.notes[-1]
    assert "dynamic" in note and "input_ids dim 0" in note and "input_ids dim 1" in note and "fixed" not in note
    mod = opsadv.load(path)
    for b, s in ((3, 7), (1, 37), (5, 130)):                             # (the example was b2 s24)
        x = _tokens(b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref = getattr(orig(**x), key)
        got = mod(**x)[key]
        assert got.shape == ref.shape
        assert _rel(got, ref, x["attention_mask"].bool()) < 1e-5


def test_fixed_shapes_on_request(tmp_path, reference_backend):
    m = _bert()
    path = tmp_path / "fixed.pt2"
    x = _tokens(2, 11, seed=0)
    opsadv.Optimizer(device="cpu", floor=False).export(m, path, x, dynamic_shapes=None)
    assert "fixed shapes" in m.opsadv_report.notes[-1]
    mod = opsadv.load(path)
    mod(**x)
    with pytest.raises(Exception, match="11|size|shape|Guard"):
        mod(**_tokens(2, 12, seed=1))


@pytest.mark.parametrize("name", ["t5", "vit"])
def test_export_other_model_kinds_at_another_batch(tmp_path, name, reference_backend):
    m = tiny(name)
    orig = copy.deepcopy(m)
    path = tmp_path / f"{name}.pt2"
    opsadv.Optimizer(device="cpu", floor=False).export(m, path)
    mod = opsadv.load(path)
    g = torch.Generator().manual_seed(5)
    if name == "vit":
        x = {"pixel_values": torch.randn(3, 3, 32, 32, generator=g)}
        key = "last_hidden_state"
    else:
        x = {"input_ids": torch.randint(0, 128, (3, 9), generator=g), "attention_mask": torch.ones(3, 9, dtype=torch.long),
             "decoder_input_ids": torch.randint(0, 128, (3, 5), generator=g)}
        key = "logits"
    with torch.no_grad():
        ref = getattr(orig(**x), key)
    got = mod(**x)[key]
    assert got.shape == ref.shape and _rel(got, ref) < 1e-5


def test_auto_dims_and_pinned_report():
    x = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "pixel_values": torch.zeros(2, 3, 4, 4),
         "labels": torch.zeros(2, 5, dtype=torch.long)}
    d = auto_dynamic_shapes(x)
    assert set(d["input_ids"]) == {0, 1} and set(d["pixel_values"]) == {0} and d["labels"] is None

    class M(torch.nn.Module):
        def forward(self, a):
            return a * 2
    ep = torch.export.export(M(), (), {"a": torch.zeros(2, 3)})          # static: every dim fixed
    assert _pinned_dims(ep, ["a"], {"a": {0: None, 1: None}}) == ["a dim 0 (fixed at 2)", "a dim 1 (fixed at 3)"]


def test_export_argument_errors(tmp_path, reference_backend):
    with pytest.raises(opsadv.errors.InvalidArgumentError, match="dynamic_shapes"):
        opsadv.Optimizer(device="cpu", floor=False).export(_bert(), tmp_path / "m.pt2", dynamic_shapes="yes")
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(opsadv.errors.InvalidArgumentError, match="example_inputs"):
        opsadv.Optimizer(device="cpu", floor=False).export(net, tmp_path / "n.pt2", validate=False)
