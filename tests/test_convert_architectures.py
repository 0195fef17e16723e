"""convert_model across transformers' architectures, not only the ones our benchmarks use: a tiny random model of each
(float32, CPU, reference backend, dropout off so that both sides compute the same thing) converted with the default
options must give the original's outputs on a padded batch and the original's loss and gradients in a training step.

Bounds: outputs on real tokens within 1e-5 relative (Frobenius) of the original's; the training loss within 1e-5
relative; every parameter's gradient within 1e-4 of its own norm plus 1e-4 of the whole gradient's norm (a gradient
that is mathematically zero, e.g. a key projection's bias under softmax, is rounding noise on both sides: measured
float32 errors are ~1e-7 to 2e-6).  An architecture this transformers does not know is skipped with the reason."""
import copy

import pytest
import torch

import opsadv

transformers = pytest.importorskip("transformers")
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification,  # noqa: E402
                          AutoModelForSeq2SeqLM, AutoModelForSequenceClassification)

CAUSAL = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
          "phi", "phi3", "gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "stablelm", "starcoder2", "olmo",
          "olmo2", "cohere", "granite", "glm", "smollm3", "biogpt", "xglm", "codegen", "gpt_bigcode", "mpt",
          "persimmon", "nemotron", "deepseek_v3", "doge", "gpt_oss", "llama4_text", "cohere2", "olmoe", "glm4_moe",
          "minimax", "lfm2", "qwen3_next", "jamba", "exaone4", "ernie4_5", "seed_oss", "hunyuan_v1_dense", "helium")
ENCODERS = ("bert", "roberta", "distilbert", "albert", "deberta-v2", "electra", "modernbert", "mpnet", "big_bird",
            "roformer", "convbert", "squeezebert")
SEQ2SEQ = ("bart", "t5", "mbart", "pegasus", "marian", "m2m_100", "blenderbot", "led", "umt5", "longt5",
           "nllb-moe", "bigbird_pegasus")
VISION = ("vit", "beit", "dinov2")

DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
            n_inner=128, ffn_dim=128, d_model=64, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, head_dim=16, rotary_dim=8, pad_token_id=0,
            n_layers=2, n_heads=4, dim=64, hidden_dim=128, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
            num_layers=2, num_decoder_layers=2, num_heads=4, d_ff=128, d_kv=16, embedding_size=64,
            decoder_start_token_id=0, image_size=32, patch_size=8, pooler_hidden_size=64,
            decoder_vocab_size=128)


# where the shared tiny dimensions do not make a valid model: multi-head latent attention (q/k head dim 24 =
# nope 16 + rope 8, v head dim 16: V is narrower than Q/K), hybrids with an attention layer among their first four
EXTRA = {"deepseek_v3": dict(qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=48,
                             head_dim=8, num_key_value_heads=4, n_routed_experts=4, n_group=1, topk_group=1,
                             first_k_dense_replace=1),
         "qwen3_next": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2),
         "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1)}


def _config(model_type: str):
    try:
        cfg = AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as e:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}: {e}")
    shrink(cfg)
    for k, v in EXTRA.get(model_type, {}).items():
        setattr(cfg, k, v)
    return cfg


def shrink(cfg) -> None:
    """The shared tiny dimensions where the config has them, and every dropout / stochastic depth off (both sides
    must compute alike)."""
    for k, v in DIMS.items():
        if hasattr(cfg, k) or k in getattr(cfg, "attribute_map", {}):
            try:
                setattr(cfg, k, v)
            except (AttributeError, NotImplementedError, ValueError):
                pass                         # (a config that derives it from others)
    for k, v in cfg.to_dict().items():
        if isinstance(v, float) and not isinstance(v, bool) and any(
                w in k for w in ("dropout", "drop_path", "layerdrop", "_pdrop", "drop_rate", "jitter_noise")):
            setattr(cfg, k, 0.0)


def _build(kind: str, model_type: str):
    torch.manual_seed(0)
    cfg = _config(model_type)
    cls = {"causal": AutoModelForCausalLM, "encoder": AutoModelForSequenceClassification,
           "seq2seq": AutoModelForSeq2SeqLM, "vision": AutoModelForImageClassification}[kind]
    # softcapped attention (Gemma-2) is the eager function's: transformers < 5.24 built sdpa, which dropped the softcap
    kw = {"attn_implementation": "eager"} if getattr(cfg, "attn_logit_softcapping", None) else {}
    model = cls.from_config(cfg, **kw).eval()
    g = torch.Generator().manual_seed(1)
    if kind == "vision":
        x = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
        return model, x, {"labels": torch.tensor([0, 1])}, None
    b, s = (3, 19) if kind == "encoder" else (2, 17)
    ids = torch.randint(1, 128, (b, s), generator=g)
    mask = torch.ones_like(ids)
    if kind == "causal":
        mask[1, :5] = 0                      # left padding (generation's)
    else:
        mask[1, 12:] = 0                     # right padding
        if b > 2:
            mask[2, 3:] = 0
    x = {"input_ids": ids, "attention_mask": mask}
    if kind == "seq2seq":
        dec = torch.randint(1, 128, (b, 7), generator=g)
        x["decoder_input_ids"] = dec
        return model, x, {"labels": dec}, None
    if kind == "encoder":
        return model, x, {"labels": torch.tensor([0, 1, 1])}, None
    return model, x, {"labels": ids}, mask.bool()


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_same_grads(ref, conv, what: str, both_ways: bool = False) -> None:
    """Every parameter's gradient in conv within 1e-4 of (its own norm + the whole gradient's norm) of ref's; a
    gradient ref has must be there in conv (both_ways: and only those)."""
    total = torch.sqrt(sum(p.grad.double().norm() ** 2 for p in ref.parameters() if p.grad is not None)).item()
    for (name, p0), p1 in zip(ref.named_parameters(), conv.parameters()):
        if both_ways:
            assert (p0.grad is None) == (p1.grad is None), f"{what}: {name} has a gradient on one side only"
        if p0.grad is None:
            continue
        assert p1.grad is not None, f"{what}: {name} has no gradient"
        err = (p1.grad - p0.grad).norm().item()
        assert err <= 1e-4 * (p0.grad.norm().item() + total), f"{what}: {name} gradient off by {err:.3g}"


def train_step_losses(ref, conv, x, labels) -> tuple[float, float]:
    """One forward + backward of each model in training mode: (ref's loss, conv's loss)."""
    out = []
    for m in (ref, conv):
        m.train()
        loss = m(**x, **labels).loss
        loss.backward()
        out.append(loss.item())
    return out[0], out[1]


CASES = [("causal", t) for t in CAUSAL] + [("encoder", t) for t in ENCODERS] + [("seq2seq", t) for t in SEQ2SEQ] + \
    [("vision", t) for t in VISION]


@pytest.mark.parametrize("kind,model_type", CASES, ids=[t for _, t in CASES])
def test_converted_model_matches_the_original(kind, model_type):
    model, x, labels, real = _build(kind, model_type)
    with torch.no_grad():
        want = model(**x).logits
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    rep = conv.opsadv_report
    assert rep.status == "converted", str(rep)
    assert any(c.kind in ("replaced", "fused", "attention") for c in rep.changes), str(rep)
    with torch.no_grad():
        got = conv(**x).logits
    if real is not None:                     # padded positions of a causal LM are not outputs anyone reads
        want, got = want[real], got[real]
    assert _rel(got, want) < 1e-5, f"{model_type}: outputs off by {_rel(got, want):.3g}\n{rep}"

    loss0, loss1 = train_step_losses(model, conv, x, labels)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_same_grads(model, conv, model_type, both_ways=True)


COMPILED = [("causal", "gpt2"), ("causal", "gemma2"), ("causal", "qwen3_moe"), ("encoder", "bert"), ("seq2seq", "t5"),
            ("vision", "vit")]


@pytest.mark.parametrize("kind,model_type", COMPILED, ids=[t for _, t in COMPILED])
def test_compiled_training_step_matches_the_original(kind, model_type):
    """torch.compile of the converted model's training step (aot_eager: dynamo and AOTAutograd trace the opsadv ops
    and their backward, no codegen), one architecture per family: loss and gradients as the original's in eager;
    and over three steps no more graphs than the original model's compiled step (a graph break or a per-step
    recompile of ours would cost the compiled model its speed)."""
    from torch._dynamo.utils import counters
    model, x, labels, _ = _build(kind, model_type)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    fresh = copy.deepcopy(model).train()        # (its first call, like conv's, sets what a model caches: problem_type)
    model.train()
    conv.train()
    model(**x, **labels).loss.backward()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda: conv(**x, **labels).loss, backend="aot_eager")
    loss = step()
    loss.backward()
    want = model(**x, **labels).loss.item()
    assert abs(loss.item() - want) <= 1e-5 * abs(want)
    assert_same_grads(model, conv, f"{model_type} compiled")
    for _ in range(2):
        step().backward()
    ours = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    theirs = torch.compile(lambda: fresh(**x, **labels).loss, backend="aot_eager")   # as ours: AOT traces the backward too
    for _ in range(3):
        theirs().backward()
    assert ours <= counters["stats"]["unique_graphs"], (ours, counters["stats"]["unique_graphs"])


CHECKPOINTED = [("causal", "llama"), ("causal", "gpt2"), ("encoder", "bert"), ("seq2seq", "t5"), ("vision", "vit")]


@pytest.mark.parametrize("kind,model_type", CHECKPOINTED, ids=[t for _, t in CHECKPOINTED])
@pytest.mark.parametrize("when", ["before", "after"])
def test_gradient_checkpointing_matches_the_original(kind, model_type, when):
    """transformers' gradient checkpointing (the layers' forward recomputed in the backward), enabled before or
    after conversion (transformers' default reentrant form before, the non-reentrant one after): loss and gradients
    as the original's with checkpointing."""
    model, x, labels, _ = _build(kind, model_type)
    ref = copy.deepcopy(model)
    ref.gradient_checkpointing_enable()
    if when == "before":
        model.gradient_checkpointing_enable()
    conv = opsadv.convert_model(model, floor=False, backend="reference", example_inputs=x)
    if when == "after":
        conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert conv.is_gradient_checkpointing
    loss0, loss1 = train_step_losses(ref, conv, x, labels)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0)
    assert_same_grads(ref, conv, model_type)


AUTOCAST = [("causal", "llama"), ("causal", "gpt2"), ("encoder", "bert")]


@pytest.mark.parametrize("kind,model_type", AUTOCAST, ids=[t for _, t in AUTOCAST])
def test_autocast_training_step(kind, model_type):
    """Mixed precision as transformers' Trainer runs it (float32 weights, torch.autocast bf16): the converted
    model's loss is float32, as the original's (a bf16 loss would quantize a logged loss curve to 2^-5 near 5), and
    its loss and gradients are within 2x the original's own autocast error of the float32 step, plus a bf16 floor."""
    model, x, labels, _ = _build(kind, model_type)
    exact, amp = copy.deepcopy(model), copy.deepcopy(model)
    conv = opsadv.convert_model(model, floor=False, backend="reference", example_inputs=x)
    losses = {}
    for name, m, ac in (("exact", exact, False), ("amp", amp, True), ("conv", conv, True)):
        m.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            loss = m(**x, **labels).loss
        assert loss.dtype == torch.float32, (name, loss.dtype)
        loss.backward()
        losses[name] = loss.item()
    err = {n: abs(losses[n] - losses["exact"]) for n in ("amp", "conv")}
    assert err["conv"] <= 2 * err["amp"] + 2 ** -8 * abs(losses["exact"]), (losses, err)
    for (name, p0), pa, pc in zip(exact.named_parameters(), amp.parameters(), conv.parameters()):
        if p0.grad is None:
            continue
        ea, ec = (pa.grad - p0.grad).norm().item(), (pc.grad - p0.grad).norm().item()
        assert ec <= 2 * ea + 2 ** -8 * p0.grad.norm().item() + 1e-6, f"{model_type}: {name} {ec:.3g} vs {ea:.3g}"


def test_eager_decoder_self_attention_made_causal_and_reverted():
    """NLLB-MoE's decoder self-attention says is_causal=False (eager always materializes its causal mask): the
    attention pass sets it True, says so in the report, and its undo puts the module's own False back."""
    from opsadv.convert.hf_attention import attention_pass
    from opsadv.convert.passes import Undo
    from opsadv.convert.report import ConversionReport
    from opsadv.convert.state import RuntimeState
    model, _, _, _ = _build("seq2seq", "nllb-moe")
    dec, enc = model.model.decoder.layers[0], model.model.encoder.layers[0]
    assert dec.self_attn.is_causal is False
    report, undo = ConversionReport(type(model).__name__, 2, "reference", "float32"), Undo()
    assert attention_pass(model, report, undo, RuntimeState())
    assert dec.self_attn.is_causal is True
    assert dec.cross_attention.is_causal is False and enc.self_attn.is_causal is False
    assert "is_causal False -> True" in str(report)
    undo.revert()
    assert dec.self_attn.is_causal is False and "is_causal" in vars(dec.self_attn)


def test_eager_coded_encoder_keeps_its_mask_form():
    """BigBird-Pegasus' encoder computes attention in its own forward (adding the mask to its scores) but builds
    its mask with masking_utils, which reads the config: the encoder gets a private config that keeps 'eager'
    (an additive float mask), the decoder runs opsadv, the report names the encoder, and undo restores it."""
    from opsadv.convert.hf_attention import attention_pass
    from opsadv.convert.passes import Undo
    from opsadv.convert.report import ConversionReport
    from opsadv.convert.state import RuntimeState
    model, _, _, _ = _build("seq2seq", "bigbird_pegasus")
    enc, dec, shared = model.model.encoder, model.model.decoder, model.model.encoder.config
    report, undo = ConversionReport(type(model).__name__, 2, "reference", "float32"), Undo()
    assert attention_pass(model, report, undo, RuntimeState())
    assert enc.config is not shared and enc.config._attn_implementation == "eager"
    assert dec.config._attn_implementation == "opsadv"
    assert "BigBirdPegasusEncoder attention [model.encoder]" in str(report) and "'eager' form" in str(report)
    undo.revert()
    assert enc.config is shared


def test_whisper_speech_encoder_decoder():
    """Whisper (audio features in, AutoModelForSpeechSeq2Seq): outputs on real decoder tokens, the training loss and
    every gradient as the original's, and greedy generate's tokens."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    cfg = WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=128,
                        num_mel_bins=16, max_source_positions=32, max_target_positions=64, pad_token_id=0,
                        decoder_start_token_id=1, eos_token_id=2, bos_token_id=1, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0)
    model = WhisperForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 16, 64, generator=g)
    dec = torch.randint(3, 128, (2, 9), generator=g)
    dmask = torch.ones_like(dec)
    dmask[1, 6:] = 0
    x = dict(input_features=feats, decoder_input_ids=dec, decoder_attention_mask=dmask)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    rep = str(conv.opsadv_report)
    assert conv.opsadv_report.status == "converted", rep
    assert "bias on some only (q_proj with bias, k_proj without, v_proj with bias)" in rep      # says which
    real = dmask.bool()
    with torch.no_grad():
        assert _rel(conv(**x).logits[real], model(**x).logits[real]) < 1e-5
    loss0, loss1 = train_step_losses(model, conv, x, {"labels": dec})
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0)
    assert_same_grads(model, conv, "whisper", both_ways=True)
    model.eval()
    conv.eval()
    with torch.no_grad():
        want = model.generate(input_features=feats, max_new_tokens=8, do_sample=False)
        assert torch.equal(conv.generate(input_features=feats, max_new_tokens=8, do_sample=False), want)


ENCODER_HEADS = [("bert", "qa"), ("roberta", "qa"), ("distilbert", "qa"), ("bert", "token"), ("electra", "token")]


@pytest.mark.parametrize("model_type,head", ENCODER_HEADS, ids=[f"{t}-{h}" for t, h in ENCODER_HEADS])
def test_encoder_heads_on_a_padded_batch(model_type, head):
    """Question answering reads every position (transformers' span loss is a softmax over the whole sequence, padded
    positions included): its encoder is not packed, and its logits at every position, the loss and every gradient
    are the original's.  Token classification reads real positions only (labels -100 on padding): packed."""
    from transformers import AutoModelForQuestionAnswering, AutoModelForTokenClassification
    torch.manual_seed(0)
    cfg = _config(model_type)
    cfg.num_labels = 2 if head == "qa" else 3          # (a span head: start and end)
    cls = AutoModelForQuestionAnswering if head == "qa" else AutoModelForTokenClassification
    # softcapped attention (Gemma-2) is the eager function's: transformers < 5.24 built sdpa, which dropped the softcap
    kw = {"attn_implementation": "eager"} if getattr(cfg, "attn_logit_softcapping", None) else {}
    model = cls.from_config(cfg, **kw).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (3, 19), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 4:] = 0
    x = {"input_ids": ids, "attention_mask": mask}
    if head == "qa":
        labels = {"start_positions": torch.tensor([1, 2, 3]), "end_positions": torch.tensor([4, 5, 3])}
    else:
        labels = {"labels": torch.randint(0, 3, (3, 19), generator=g).masked_fill(mask == 0, -100)}
    key = "start_logits" if head == "qa" else "logits"
    with torch.no_grad():
        want = getattr(model(**x), key)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    rep = conv.opsadv_report
    assert rep.status == "converted", str(rep)
    packed = any(c.kind == "packed" for c in rep.changes)
    assert packed == (head == "token"), str(rep)
    with torch.no_grad():
        got = getattr(conv(**x), key)
    keep = mask.bool() if head == "token" else torch.ones_like(mask, dtype=torch.bool)
    assert _rel(got[keep], want[keep]) < 1e-5, str(rep)
    loss0, loss1 = train_step_losses(model, conv, x, labels)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_same_grads(model, conv, f"{model_type} {head}", both_ways=True)
