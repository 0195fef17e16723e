"""Conversion changes only the model it is given (transformers 5 shares one config object between models
built from it, and modules read config._attn_implementation at call time); undoing a conversion puts the
original config objects back.  Calls opsadv has no kernel for run the model's ORIGINAL attention
implementation (Gemma-2's softcapping under 'eager'); attention layers are counted by the modules that call
the attention interface (T5, GPT-NeoX included)."""
import copy

import pytest
import torch

import opsadv
from opsadv.convert import ValidationError, hf_attention as H, validate as _val

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, GPTNeoXConfig,  # noqa: E402
                          GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, PretrainedConfig, T5Config,
                          T5ForConditionalGeneration)

DEC = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=97, max_position_embeddings=128)


def ids_and_mask(b=2, s=13, pad=4, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (b, s), generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    am[-1, s - pad:] = 0
    return ids, am


def configs_of(model) -> set[int]:
    return {id(v) for m in model.modules() for v in vars(m).values() if isinstance(v, PretrainedConfig)}


def two_models_one_config():
    cfg = LlamaConfig(**DEC)
    torch.manual_seed(0)
    a = AutoModelForCausalLM.from_config(cfg).eval()
    torch.manual_seed(0)
    b = AutoModelForCausalLM.from_config(cfg).eval()
    assert a.config is b.config is cfg and a.model.layers[0].self_attn.config is cfg    # what transformers 5 does
    return cfg, a, b


def test_converting_one_model_leaves_the_other_alone():
    cfg, a, b = two_models_one_config()
    before = cfg._attn_implementation
    ids, am = ids_and_mask()
    with torch.no_grad():
        want = b(input_ids=ids, attention_mask=am).logits
    conv = opsadv.convert_model(a, backend="reference", floor=False)
    assert cfg._attn_implementation == before and b.config is cfg
    assert conv.config._attn_implementation == "opsadv" and conv.config is not cfg
    assert configs_of(conv) == {id(conv.config)}                  # every module reads the converted copy
    with torch.no_grad(), opsadv.trace() as t:
        got = b(input_ids=ids, attention_mask=am).logits
    assert not t.counts, str(t)                                    # no opsadv op ran in the other model
    assert torch.equal(got, want)
    with torch.no_grad(), opsadv.trace() as t:
        conv(input_ids=ids, attention_mask=am)
    assert any("attention" in k for k in t.counts), str(t)


def test_a_refused_conversion_restores_the_shared_config(monkeypatch):
    monkeypatch.setitem(_val.REL_LIMIT, torch.float32, 1e-14)
    cfg, a, b = two_models_one_config()
    with pytest.raises(ValidationError):
        opsadv.convert_model(a, backend="reference", floor=False)
    assert a.config is cfg and configs_of(a) == {id(cfg)}
    assert cfg._attn_implementation != "opsadv"
    assert not any(hasattr(m, "_opsadv_attn_before") or hasattr(m, "_opsadv_state") for m in a.modules())


def test_an_attention_step_the_floor_undoes_restores_the_shared_config():
    """A timer that says every rewrite made the model slower: the floor undoes each step, attention included."""
    cfg, a, b = two_models_one_config()
    def slower(fn):                    # any rewrite in place (a module of ours, our attention, a rebound forward)
        fn()
        return 1.0 + (a.config._attn_implementation == "opsadv") + any(
            type(x).__module__.startswith("opsadv") or "forward" in x.__dict__ for x in a.modules())
    conv = opsadv.convert_model(a, backend="reference", floor=True, floor_timer=slower)
    assert conv.opsadv_report.count("attention") == 0
    assert conv.config is cfg and configs_of(conv) == {id(cfg)} and cfg._attn_implementation != "opsadv"


def t5_inputs():
    ids, am = ids_and_mask(s=9, pad=3, vocab=64)
    return {"input_ids": ids, "attention_mask": am, "decoder_input_ids": ids[:, :5]}


def test_sub_configs_are_copied_with_their_model():
    cfg = T5Config(d_model=32, d_ff=48, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16, vocab_size=64)
    torch.manual_seed(0)
    a = T5ForConditionalGeneration(cfg).eval()
    b = T5ForConditionalGeneration(cfg).eval()
    conv = opsadv.convert_model(a, backend="reference", floor=False, example_inputs=t5_inputs())
    assert configs_of(conv).isdisjoint(configs_of(b))            # encoder / decoder configs included
    assert all(c._attn_implementation != "opsadv" for m in b.modules() for c in vars(m).values()
               if isinstance(c, PretrainedConfig))


# ---- the fallback is the model's original implementation -----------------------------------------------------
def gemma2(attn):
    cfg = Gemma2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=64,
                       sliding_window=4, attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
                       attn_implementation=attn)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(cfg).eval()


def test_softcapping_runs_the_models_original_eager_attention():
    orig = gemma2("eager")
    assert orig.config._attn_implementation == "eager"
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference", floor=False)
    rep = str(conv.opsadv_report)
    assert "'eager' -> 'opsadv'" in rep and "run the model's original attention ('eager')" in rep, rep
    ids, am = ids_and_mask(s=11, pad=3, vocab=64)
    with torch.no_grad():
        want = orig(input_ids=ids, attention_mask=am).logits
        got = conv(input_ids=ids, attention_mask=am).logits
    keep = am.bool()
    assert torch.allclose(got[keep], want[keep], atol=1e-5, rtol=1e-4)
    assert conv._opsadv_state.fallbacks.get("attention softcapping -> eager", 0) >= 4   # 2 layers x 2 forwards


def test_dropout_runs_the_original_sdpa_and_eager():
    """Attention dropout in training: sdpa stays sdpa, eager stays eager (same dropout draws: same output)."""
    for attn in ("sdpa", "eager"):
        cfg = LlamaConfig(**DEC, attention_dropout=0.5, attn_implementation=attn)
        torch.manual_seed(0)
        orig = LlamaForCausalLM(cfg).train()
        conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference", floor=False).train()
        ids, am = ids_and_mask()
        torch.manual_seed(7)
        want = orig(input_ids=ids, attention_mask=am).logits
        torch.manual_seed(7)
        got = conv(input_ids=ids, attention_mask=am).logits
        keep = am.bool()
        assert torch.allclose(got[keep], want[keep], atol=1e-5, rtol=1e-4), attn
        assert conv._opsadv_state.fallbacks == {f"attention dropout -> {attn}": 2}


def test_fallback_calls_compile_once():
    """Calls served by the model's own attention (attention dropout in training, Gemma-2's softcapping) inside a
    compiled graph: one graph for every call (the fallback count is an int the graph wrote: dynamo recompiled at each
    call, then ran eagerly past its recompile limit); the count is of eager calls."""
    from torch._dynamo.utils import counters
    cfg = LlamaConfig(**DEC, attention_dropout=0.5, attn_implementation="sdpa")
    torch.manual_seed(0)
    llama = opsadv.convert_model(LlamaForCausalLM(cfg).train(), backend="reference", floor=False).train()
    softcap = opsadv.convert_model(gemma2("eager"), backend="reference", floor=False, validate=False)
    for model, train, vocab in ((llama, True, 97), (softcap, False, 64)):
        ids, am = ids_and_mask(vocab=vocab)
        before = dict(model._opsadv_state.fallbacks)      # (conversion's own eager calls)
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(lambda: model(input_ids=ids, attention_mask=am).logits, backend="eager")   # noqa: B023
        for _ in range(4):
            with torch.set_grad_enabled(train):
                out = fn()
            if train:
                out.float().sum().backward()
        assert counters["stats"]["unique_graphs"] == 1, type(model).__name__
        assert model._opsadv_state.fallbacks == before


def test_fallback_target_never_refuses_the_call(monkeypatch):
    conv = opsadv.convert_model(gemma2("eager"), backend="reference", floor=False, validate=False)
    attn = conv.model.layers[0].self_attn
    assert attn._opsadv_attn_before == "eager"
    assert H.fallback_target(attn, "dropout")[0] == "eager"
    monkeypatch.setattr(attn, "_opsadv_attn_before", "sdpa")   # sdpa cannot softcap: the model's eager serves it
    name, fn = H.fallback_target(attn, "softcapping")
    assert name == "eager" and fn.__module__ == type(attn).__module__
    assert H.fallback_target(attn, "dropout")[0] == "sdpa"
    monkeypatch.setattr(attn, "_opsadv_attn_before", "flash_attention_2")   # masks of another form
    assert H.fallback_target(attn, "dropout")[0] == "eager"


# ---- attention layers are counted by the modules that call the attention interface -------------------------
@pytest.mark.parametrize("arch", ["t5", "neox", "llama"])
def test_report_counts_the_attention_layers(arch):
    torch.manual_seed(0)
    if arch == "t5":
        m = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=2,
                                                d_kv=16, vocab_size=64)).eval()
        n = 2 + 2 * 2                          # encoder self, decoder self + cross
    elif arch == "neox":
        m = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, vocab_size=64)).eval()
        n = 2
    else:
        m = LlamaForCausalLM(LlamaConfig(**DEC)).eval()
        n = 2
    conv = opsadv.convert_model(m, backend="reference", floor=False,
                                example_inputs=t5_inputs() if arch == "t5" else None)
    line = next(c.what for c in conv.opsadv_report.changes if c.kind == "attention")
    assert f"; {n} layers;" in line, line
    assert len(H.attention_modules(conv)) == n
    assert all(getattr(x, "_opsadv_state", None) is conv._opsadv_state for _, x in H.attention_modules(conv))
