"""mem_opt=3 frees norm and embedding outputs after their last reader (opsadv.convert.release): the
readers come from a probe forward; an output read later by a function, or returned, is left alone; the
release happens only in no-grad calls and when no extra reference holds the tensor; outputs unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import opsadv
from opsadv.convert import release

tf = pytest.importorskip("transformers")


def _llama(layers=2):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(cfg).eval()


_releases = release.releases


@pytest.fixture(autouse=True)
def _small_outputs_count(monkeypatch):
    """These models' outputs are far below the 1 MiB floor of a real release; let them count."""
    monkeypatch.setattr(release, "MIN_RELEASE_BYTES", 0)


def test_llama_outputs_are_freed_after_their_last_reader(reference_backend):
    base = _llama()
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3)
    rels = {(r.producer, r.reader) for r in _releases(conv)}
    for layer in conv.model.layers:
        assert (layer.input_layernorm, layer.self_attn.v_proj) in rels     # after q, k, v read it
        assert (layer.post_attention_layernorm, layer.mlp) in rels
    assert (conv.model.embed_tokens, conv.model.layers[0]) in rels        # its residual add is the last read
    assert "outputs freed after their last reader" in str(conv.opsadv_report)
    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(1))
    before = sum(r.released for r in _releases(conv))
    with torch.no_grad():
        want, got = base(input_ids=ids).logits, conv(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sum(r.released for r in _releases(conv)) - before == 2 * len(conv.model.layers) + 2


def test_an_extra_holder_keeps_the_output(reference_backend):
    """output_hidden_states=True makes transformers keep the final norm's output (hidden_states[-1]):
    one more reference than in the probe, so it is kept whole and the hidden states match the original."""
    base = _llama()
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = base(input_ids=ids, output_hidden_states=True).hidden_states
        got = conv(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    final = next(r for r in _releases(conv) if r.producer is conv.model.norm)
    assert final.kept >= 1

def test_freed_output_is_empty(reference_backend):
    """What a reader the probe did not foresee would meet: an empty tensor (a shape error), never freed
    memory."""
    import weakref
    base = _llama(1)
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3)
    layer = conv.model.layers[0]
    seen = {}

    def check(module, args):                 # o_proj runs after v_proj: the normed state is emptied by then
        out = seen["out"]()
        seen["numel"] = out.numel()
        with pytest.raises(RuntimeError):
            nn.functional.linear(out, layer.self_attn.q_proj.weight)
    hs = [layer.input_layernorm.register_forward_hook(lambda m, a, out: seen.update(out=weakref.ref(out))),
          layer.self_attn.o_proj.register_forward_pre_hook(check)]
    try:
        with torch.no_grad():
            conv(input_ids=torch.randint(0, 101, (1, 5)))
    finally:
        for h in hs:
            h.remove()
    assert seen["numel"] == 0


def test_a_held_view_keeps_its_values(reference_backend):
    """A view taken of the output is one more holder: the output stays whole or, if emptied, the view
    keeps the storage; either way the view's values are intact and the model's output unchanged."""
    base = _llama(1)
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3)
    layer = conv.model.layers[0]
    seen = {}

    def keep(module, args, output):
        seen["view"], seen["copy"] = output.view(-1), output.clone()
    h = layer.input_layernorm.register_forward_hook(keep)
    ids = torch.randint(0, 101, (1, 5))
    try:
        with torch.no_grad():
            got, want = conv(input_ids=ids).logits, base(input_ids=ids).logits
    finally:
        h.remove()
    torch.testing.assert_close(seen["view"], seen["copy"].view(-1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_no_release_with_gradients(reference_backend):
    base = _llama(1)
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3)
    ids = torch.randint(0, 101, (2, 7))
    before = sum(r.released for r in _releases(conv))          # the validation forward released some
    conv(input_ids=ids).logits.float().sum().backward()
    assert sum(r.released for r in _releases(conv)) == before
    assert conv.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_not_installed_below_mem_opt_3(reference_backend):
    conv = opsadv.convert_model(_llama(1), mem_opt=2)
    assert _releases(conv) == [] and "freed after their last reader" not in str(conv.opsadv_report)


class _Parallel(nn.Module):
    """A parallel block (GPT-J / Falcon style): the normed state is read by the projections and then by
    an add outside any module."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = tf.models.llama.modeling_llama.LlamaRMSNorm(d)
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h) + h


class _Returns(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm = tf.models.llama.modeling_llama.LlamaRMSNorm(d)
        self.q = nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h), h


@pytest.mark.parametrize("cls,why", [(_Parallel, "last read outside a module"),
                                     (_Returns, "part of the model's output")])
def test_escaping_outputs_are_left_alone(cls, why, reference_backend):
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        want = model(x)
    conv = opsadv.convert_model(copy.deepcopy(model), mem_opt=3, example_inputs=(x,))
    assert _releases(conv) == []
    assert why in str(conv.opsadv_report)
    with torch.no_grad():
        got = conv(x)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_revert_removes_the_hooks(reference_backend):
    from opsadv.convert import passes
    from opsadv.convert.report import ConversionReport
    model = _llama(1)
    opsadv.convert_model(model, mem_opt=2)             # norms converted, nothing released yet
    undo = passes.Undo()
    rels = release.release_pass(model, ConversionReport("m", 2, "auto", None), undo,
                                {"input_ids": torch.randint(0, 101, (1, 6))}, __import__(
                                    "opsadv.convert.validate", fromlist=["run"]).run)
    assert rels and _releases(model)
    undo.revert()
    assert _releases(model) == []


def test_small_outputs_are_not_worth_a_release(reference_backend, monkeypatch):
    """Below MIN_RELEASE_BYTES (a decode step's states) nothing is emptied; the hooks stay installed."""
    monkeypatch.setattr(release, "MIN_RELEASE_BYTES", 1 << 20)
    conv = opsadv.convert_model(_llama(1), mem_opt=3)
    rels = _releases(conv)
    assert rels and all(r.min_bytes == 1 << 20 for r in rels)
    with torch.no_grad():
        conv(input_ids=torch.randint(0, 101, (1, 5)))
    assert sum(r.released for r in rels) == 0


def test_generate_and_inference_mode_match_the_original(reference_backend):
    """The paths users take: generate() (prefill + cached decode steps, other kwargs than the probe's) and
    inference_mode; the releases happen there and the tokens / logits are the original model's."""
    base = _llama()
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    rels = _releases(conv)
    before = sum(r.released for r in rels)
    with torch.inference_mode():
        torch.testing.assert_close(conv(input_ids=ids).logits, base(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        am = torch.ones_like(ids)
        out = conv.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref = base.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert sum(r.released for r in rels) - before >= 2 * (2 * len(conv.model.layers) + 2)
