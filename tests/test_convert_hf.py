"""convert_model on transformers models (tiny random configs): attention through the
AttentionInterface seam, norms/MLPs/QKV by structure, validation, generate, save_pretrained,
training, tune_for_hardware, refusal.  Reference backend (CPU) unless the test says otherwise."""
import copy

import pytest
import torch

import opsadv
from opsadv.convert import ValidationError, validate as _val
from opsadv.errors import InvalidArgumentError
from opsadv.convert.modules import OpsadvNorm, QKVProjection, SwiGLUMLP, LinearAct, DenseResidualNorm

transformers = pytest.importorskip("transformers")
from transformers import (BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          RobertaConfig, RobertaModel)

DEC = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=128, max_position_embeddings=128)
ENC = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
           max_position_embeddings=130)


def make(arch):
    torch.manual_seed(0)
    if arch == "llama":
        m = LlamaForCausalLM(LlamaConfig(**DEC))
    elif arch == "mistral":
        m = MistralForCausalLM(MistralConfig(**DEC, sliding_window=8))
    elif arch == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**DEC))
    elif arch == "bert":
        m = BertModel(BertConfig(**ENC))
    elif arch == "roberta":
        m = RobertaModel(RobertaConfig(**ENC, pad_token_id=1))
    else:
        m = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=128))
    return m.eval()


def inputs(batch=2, seq=19, pad=5, vocab=128):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, vocab, (batch, seq), generator=g)
    am = torch.ones(batch, seq, dtype=torch.long)
    am[-1, seq - pad:] = 0
    return {"input_ids": ids, "attention_mask": am}


def primary(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "bert", "roberta", "gpt2"])
def test_convert_matches_original(arch):
    orig = make(arch)
    model = copy.deepcopy(orig)
    conv = opsadv.convert_model(model, backend="reference")
    assert conv is model and type(conv) is type(orig)               # same object, same class
    rep = conv.opsadv_report
    assert rep.validation["passed"] and rep.validation["rel_err"] < 1e-5, str(rep)
    assert "opsadv" in str(rep) and rep.count("attention") == 1
    assert conv.config._attn_implementation == "opsadv"
    kinds = {type(m) for m in conv.modules()}
    assert OpsadvNorm in kinds
    if arch in ("llama", "mistral", "qwen2"):
        assert {SwiGLUMLP, QKVProjection} <= kinds
    if arch in ("bert", "roberta"):
        assert {LinearAct, DenseResidualNorm, QKVProjection} <= kinds
    if arch == "gpt2":
        assert LinearAct in kinds
    assert sorted(conv.state_dict()) == sorted(orig.state_dict())  # parameter names unchanged
    x = inputs(seq=23, pad=7)
    with opsadv.trace() as t, torch.no_grad():
        a, b = primary(orig(**x)), primary(conv(**x))
    keep = x["attention_mask"].bool()
    assert torch.allclose(a[keep], b[keep], rtol=1e-4, atol=1e-5)
    assert any("flash_attention" in k or "sparse_attention" in k for k in t.counts), t.counts


def test_opt_levels():
    m0 = opsadv.convert_model(make("llama"), backend="reference", opt_level=0)
    assert m0.opsadv_report.changes == [] and m0.config._attn_implementation != "opsadv"
    m1 = opsadv.convert_model(make("llama"), backend="reference", opt_level=1)
    kinds = {type(m) for m in m1.modules()}
    assert OpsadvNorm in kinds and SwiGLUMLP not in kinds and QKVProjection not in kinds
    m3 = opsadv.convert_model(make("llama"), backend="reference", opt_level=3)
    assert m3._opsadv_state.effective().experimental
    assert SwiGLUMLP in {type(m) for m in m3.modules()}


def test_generate_and_decode_with_cache():
    orig = make("llama")
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference")
    ids = inputs(batch=1, seq=7, pad=0)["input_ids"]
    ga = orig.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    gb = conv.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ga, gb)


def test_save_pretrained_roundtrip(tmp_path):
    orig = make("qwen2")
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference")
    conv.save_pretrained(tmp_path)
    back = Qwen2ForCausalLM.from_pretrained(tmp_path).eval()      # a plain transformers model again
    x = inputs()
    with torch.no_grad():
        assert torch.allclose(back(**x).logits, orig(**x).logits, atol=1e-6)


def test_offloaded_weights_are_refused_and_the_model_left_as_it_was(tmp_path):
    """accelerate's disk offload keeps layer 1's weights on the meta device outside its forward: converting would fuse
    those (meta) weights, so convert_model refuses, naming a parameter and the offload, and changes nothing."""
    pytest.importorskip("accelerate")
    orig = make("llama")
    orig.save_pretrained(tmp_path)
    dm = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
          "model.rotary_emb": "cpu", "lm_head": "cpu"}
    off = LlamaForCausalLM.from_pretrained(tmp_path, device_map=dm, offload_folder=str(tmp_path / "off")).eval()
    before = type(off.model.layers[1].self_attn.q_proj), off.config._attn_implementation
    with pytest.raises(InvalidArgumentError, match=r"meta device.*layers\.1\..*offloads to disk"):
        opsadv.convert_model(off, backend="reference")
    assert (type(off.model.layers[1].self_attn.q_proj), off.config._attn_implementation) == before
    assert not hasattr(off, "opsadv_report")
    x = inputs()
    with torch.no_grad():
        assert torch.allclose(off(**x).logits, orig(**x).logits, atol=1e-6)


class _Classifier(torch.nn.Module):
    """A task head on a transformers backbone, as users write them."""

    def __init__(self, backbone, n=3):
        super().__init__()
        self.backbone, self.head = backbone, torch.nn.Linear(backbone.config.hidden_size, n)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def test_module_holding_one_transformers_model_converts_it(tmp_path):
    """convert_model(wrapper) without example_inputs converts the transformers model inside (its generated inputs
    validate it) and leaves the rest; a wrapper with two raises, naming them."""
    orig = _Classifier(make("bert"))
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference")
    assert conv.opsadv_report is conv.backbone.opsadv_report and conv.opsadv_report.status == "converted"
    assert any(c.kind in ("replaced", "fused") for c in conv.opsadv_report.changes)
    assert type(conv.head) is torch.nn.Linear
    x = inputs()
    with torch.no_grad():
        assert torch.allclose(conv(**x), orig(**x), atol=1e-5)
    half = opsadv.convert_model(copy.deepcopy(orig), backend="reference", precision="bf16")   # the head is cast too
    assert half.head.weight.dtype == half.backbone.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    assert torch.allclose(half(**x).float(), orig(**x), atol=0.1)
    two = torch.nn.ModuleDict({"query": make("bert"), "doc": make("roberta")})
    with pytest.raises(InvalidArgumentError, match=r"2 transformers models \(query, doc\)"):
        opsadv.convert_model(two, backend="reference")
    assert not hasattr(two["query"], "opsadv_report")
    with pytest.raises(InvalidArgumentError, match="not wrapped in DataParallel yet"):    # a wrapper, not a holder
        opsadv.convert_model(torch.nn.DataParallel(make("bert")), backend="reference")


def test_sentence_transformer_converts_and_encodes_as_before(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models as st_models
    from transformers import BertTokenizer
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(123)]
    (tmp_path / "vocab.txt").write_text("\n".join(words))
    BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    make("bert").save_pretrained(tmp_path)
    enc = st_models.Transformer(str(tmp_path))
    model = st.SentenceTransformer(modules=[enc, st_models.Pooling(64, "mean")], device="cpu").eval()
    sents = [" ".join(f"w{(i * 7 + j) % 120}" for j in range(n)) for i, n in enumerate([3, 17, 9, 30, 1])]
    want = model.encode(sents, convert_to_tensor=True, batch_size=5)
    conv = opsadv.convert_model(model, backend="reference")
    assert conv is model and conv.opsadv_report.status == "converted"
    got = conv.encode(sents, convert_to_tensor=True, batch_size=5)      # a padded batch
    assert torch.allclose(got, want, atol=1e-5)


def test_training_gradients_reach_original_parameters(reference_backend):
    # (backward ops resolve under the policy in force at .backward() time: keep it the reference too)
    orig = make("llama").train()
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference").train()
    x = inputs()
    labels = x["input_ids"].clone()
    orig(**x, labels=labels).loss.backward()
    conv(**x, labels=labels).loss.backward()
    po, pc = dict(orig.named_parameters()), dict(conv.named_parameters())
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"):
        assert pc[name].grad is not None, name
        err = (pc[name].grad - po[name].grad).norm() / po[name].grad.norm()
        assert err < 1e-4, (name, err)
    # an optimizer step (in place) is seen by the fused inference path
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    opt.step()
    with torch.no_grad():
        conv.eval()
        ref = copy.deepcopy(orig)
        for (n, p) in ref.named_parameters():
            p.copy_(pc[n])
        ref.eval()
        assert torch.allclose(conv(**x).logits, ref(**x).logits, atol=1e-5)


def test_refused_with_numbers_and_model_restored(monkeypatch):
    monkeypatch.setitem(_val.REL_LIMIT, torch.float32, 1e-14)
    model = make("llama")
    with pytest.raises(ValidationError) as ei:
        opsadv.convert_model(model, backend="reference")
    assert "rel_err=" in str(ei.value) and ei.value.metrics["rel_err"] > 1e-14
    assert model.config._attn_implementation != "opsadv"
    assert not any(type(m).__module__.startswith("opsadv") for m in model.modules())
    assert not hasattr(model, "opsadv_report")
    with pytest.warns(RuntimeWarning, match="beyond the limits"):
        kept = opsadv.convert_model(model, backend="reference", validate="warn")
    assert "FAILED" in kept.opsadv_report.status and kept.config._attn_implementation == "opsadv"


@pytest.mark.parametrize("arg,value", [("opt_level", 4), ("opt_level", -1), ("tile_size", 16), ("tile_size", 512),
                                       ("tile_size", 96), ("max_streams", 0), ("max_streams", 9), ("mem_opt", 4),
                                       ("mem_opt", -1), ("validate", "yes"), ("precision", "int8")])
def test_seed_arguments_validated(arg, value):
    with pytest.raises(opsadv.errors.InvalidArgumentError, match=arg if arg != "precision" else "precision"):
        opsadv.convert_model(make("gpt2"), backend="reference", **{arg: value})


def test_seed_arguments_reach_the_policy():
    m = opsadv.convert_model(make("gpt2"), backend="reference", tile_size=64, max_streams=2, mem_opt=1)
    assert dict(m._opsadv_state.policy.options) == {"tile_size": 64, "max_streams": 2, "mem_opt": 1}


def test_tune_for_hardware_on_cpu():
    conv = opsadv.convert_model(make("llama"), backend="reference")
    tuned = conv.tune_for_hardware(device="cpu", batch_size=2, seq_len=16)
    assert tuned is conv                                     # `optimized = converted.tune_for_hardware(...)`
    rep = conv.opsadv_tune_report
    assert rep.calls_per_impl and all(k.startswith("reference") for k in rep.calls_per_impl)
    assert len(rep.steps) == 3 and "chosen kernels" in str(rep)
    # the padded step's causal + key padding calls run sparse_attention
    assert set(rep.per_op) == {"flash_attention", "sparse_attention", "gemm", "swiglu_gemm", "rms_norm",
                               "rotary_embedding"}, rep.per_op
    assert not conv._opsadv_state.policy.autotune
    from opsadv.core.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="timing"):
        conv.tune_for_hardware(device="cpu", batch_size=2, seq_len=16, timing="gpu")
    seen = []
    from opsadv.convert import tune as T
    orig = T._tuning_policy
    T._tuning_policy = lambda base, timing=None: seen.append(orig(base, timing).timing) or orig(base, timing)
    try:
        conv.tune_for_hardware(device="cpu", batch_size=2, seq_len=16, timing="graph", progress=False)
    finally:
        T._tuning_policy = orig
    assert seen == ["graph"] and conv._opsadv_state.policy.timing == "wall"      # restored after tuning


def test_padded_encoder_uses_key_padding_form():
    from opsadv.convert.hf_attention import key_padding_of, opsadv_mask
    pad = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    from transformers.masking_utils import bidirectional_mask_function
    m = opsadv_mask(batch_size=2, q_length=4, kv_length=4, mask_function=bidirectional_mask_function,
                    attention_mask=pad)
    assert m.shape == (2, 1, 4, 4) and m.stride(2) == 0
    assert torch.equal(key_padding_of(m), pad.bool())


def test_interpreter_backend_auto():
    """One small conversion through 'auto' (the cuda backend's kernels in the Triton interpreter)."""
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=64)).eval()
    conv = opsadv.convert_model(m, example_inputs=inputs(batch=2, seq=9, pad=3, vocab=64))
    assert conv.opsadv_report.validation["passed"], str(conv.opsadv_report)


def test_dtype_move_and_deepcopy_after_conversion():
    orig = make("llama")
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference")
    x = inputs()
    twin = copy.deepcopy(conv)                                   # independent copy, still converted
    conv.to(torch.float64)                                       # fused buffers follow the parameters
    with torch.no_grad():
        a = conv(**x).logits
        b = copy.deepcopy(orig).to(torch.float64)(**x).logits
        c = twin(**x).logits
    assert a.dtype == torch.float64 and torch.allclose(a, b, atol=1e-6)   # (HF norms compute in fp32)
    assert torch.allclose(c, orig(**x).logits, atol=1e-5)
    with torch.no_grad():
        twin.model.layers[0].mlp.gate_proj.weight.mul_(0)        # in-place edits reach the fused weight
        orig2 = copy.deepcopy(orig)
        orig2.model.layers[0].mlp.gate_proj.weight.mul_(0)
        assert torch.allclose(twin(**x).logits, orig2(**x).logits, atol=1e-5)


def test_inference_mode_then_training(reference_backend):
    conv = opsadv.convert_model(make("llama"), backend="reference")
    conv.to(torch.float64).to(torch.float32)                     # drop the fused buffers: rebuilt below
    x = inputs()
    with torch.inference_mode():
        conv(**x)                                                # fuses inside inference mode
    conv.train()
    conv(**x, labels=x["input_ids"]).loss.backward()             # parameters are still normal tensors
    assert conv.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_pickle_roundtrip_keeps_conversion(tmp_path):
    import io
    orig = make("gpt2")
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference")
    buf = io.BytesIO()
    torch.save(conv, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.tune_for_hardware.model is back and back.config._attn_implementation == "opsadv"
    x = inputs()
    with torch.no_grad():
        keep = x["attention_mask"].bool()
        assert torch.allclose(back(**x).logits[keep], orig(**x).logits[keep], atol=1e-5)


def test_mem_opt_runs_mlps_over_row_chunks(monkeypatch):
    """mem_opt >= 2 bounds the MLP intermediate by running it over row chunks: same outputs and
    gradients; the report says so."""
    from opsadv.convert import modules, passes
    monkeypatch.setitem(passes.MLP_CHUNK_BYTES, 3, 7 * 96 * 4)        # 7 rows of the 96-wide fp32 intermediate
    monkeypatch.setattr(modules, "MIN_CHUNK_ROWS", 1)
    orig = make("llama")
    plain = opsadv.convert_model(copy.deepcopy(orig), backend="reference")
    chunked = opsadv.convert_model(copy.deepcopy(orig), backend="reference", mem_opt=3)
    mlps = [m for m in chunked.modules() if isinstance(m, SwiGLUMLP)]
    assert mlps and all(m.row_chunk_bytes == 7 * 96 * 4 for m in mlps)
    assert any(c.kind == "memory" for c in chunked.opsadv_report.changes)
    calls = []
    orig_mlp = SwiGLUMLP._mlp
    monkeypatch.setattr(SwiGLUMLP, "_mlp", lambda self, x: calls.append(x.shape[0]) or orig_mlp(self, x))
    batch = inputs()
    with torch.no_grad():
        a, b = primary(plain(**batch)), primary(chunked(**batch))
    calls.clear()
    with torch.no_grad():
        chunked(**batch)
    assert max(calls) == 7 and sum(calls) == 2 * 2 * 19             # 2 layers x 38 rows, in chunks of 7
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with opsadv.use_backend("reference"):
        primary(plain(**batch)).square().mean().backward()
        primary(chunked(**batch)).square().mean().backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), chunked.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_mem_opt_3_keeps_qkv_unfused():
    """mem_opt=3 leaves q/k/v as three GEMMs (a fused output would keep the pre-rotary q alive as
    one buffer); the report says why; outputs unchanged.  mem_opt 2 still fuses."""
    orig = make("llama")
    frugal = opsadv.convert_model(copy.deepcopy(orig), backend="reference", mem_opt=3)
    fused = opsadv.convert_model(copy.deepcopy(orig), backend="reference", mem_opt=2)
    assert not any(isinstance(m, QKVProjection) for m in frugal.modules())
    assert any(isinstance(m, QKVProjection) for m in fused.modules())
    why = [c.reason for c in frugal.opsadv_report.changes if c.kind == "skipped" and c.what == "q/k/v projections"]
    assert why and all("mem_opt=3" in r for r in why)
    batch = inputs()
    with torch.no_grad():
        torch.testing.assert_close(primary(frugal(**batch)), primary(orig(**batch)), rtol=1e-4, atol=1e-5)


class _QFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(16, 8) for _ in range(3))

    def forward(self, x, other=None):
        kv = x if other is None else other
        return self.query(x) * 2 + self.value(kv) - self.key(kv)


class _KeyFirst(_QFirst):           # ConvBERT's order: key, value, then query
    def forward(self, x, other=None):
        k = self.key(x)
        v = self.value(x)
        return self.query(x) * 2 + k - v


def test_fused_qkv_serves_k_and_v_in_either_order_and_keeps_nothing():
    """q first, then v and k (either order) on one input: one fused GEMM per forward, and nothing held after the
    forward (a stash left for the next call held an activation and made a compiled graph guard on it)."""
    torch.manual_seed(0)
    m = _QFirst()
    conv = opsadv.convert_model(copy.deepcopy(m), backend="reference", floor=False, validate=False)
    group = conv.query.group
    for _ in range(2):
        x = torch.randn(3, 5, 16)
        with opsadv.trace() as t:
            got = conv(x)
        torch.testing.assert_close(got, m(x))
        assert t.counts == {"reference.gemm": 1} and group.stash is None


def test_qkv_called_key_first_stays_three_projections():
    """A forward that calls k / v before q (ConvBERT) is not fused: the fused GEMM runs at q's call, so k and v
    would run twice; the report says so."""
    conv = opsadv.convert_model(_KeyFirst(), backend="reference", floor=False, validate=False)
    assert not isinstance(conv.query, QKVProjection)
    why = [c.reason for c in conv.opsadv_report.changes if c.what == "q/k/v projections"]
    assert why and "calls key before query" in why[0], why


def test_fused_qkv_with_k_and_v_on_another_input_keeps_nothing():
    """q on one input, k and v on another (cross-attention a name does not reveal): correct outputs, k and v as plain
    projections, no stash left after the forward."""
    torch.manual_seed(0)
    m = _QFirst()
    conv = opsadv.convert_model(copy.deepcopy(m), backend="reference", floor=False, validate=False)
    for _ in range(2):
        x, other = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
        torch.testing.assert_close(conv(x, other), m(x, other))
        assert conv.query.group.stash is None


def test_a_compiled_model_is_converted_inside_its_wrapper():
    """convert_model(torch.compile(model)): the model inside torch.compile's wrapper is converted and the wrapper
    returned (its report read through it); the compiled call then runs the converted modules."""
    orig = make("llama")
    wrapped = torch.compile(copy.deepcopy(orig), backend="eager")
    out = opsadv.convert_model(wrapped, backend="reference", floor=False)
    assert out is wrapped and any(isinstance(m, QKVProjection) for m in wrapped._orig_mod.modules())
    assert "converted" in str(out.opsadv_report)
    batch = inputs()
    with torch.no_grad(), opsadv.trace() as t:
        got = primary(out(**batch))
    torch.testing.assert_close(got, primary(orig(**batch)), rtol=1e-4, atol=1e-5)
    assert "reference.gemm" in t.counts, t.counts
