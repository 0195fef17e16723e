"""A catalogue of transformers architectures built from configs in code (no hub, random weights), for the
models bench suite (suite_models.py) and the CPU model-matrix tests.

Each entry names the transformers config class, its kwargs per size, the model classes (inference and
training), the Liger-Kernel apply function where Liger supports the architecture, and the input kind:
  "causal"  decoder-only LM (token ids; labels = ids, -100 at padded positions)
  "encoder" BERT-like, ModernBERT (token ids + attention_mask with ~30% right padding; sequence-classification labels)
  "vision"  ViT (pixel_values; image-classification labels)
  "seq2seq" T5, BART (encoder ids + mask, decoder_input_ids / labels)
Sizes: "tiny" (CPU tests: two layers, hidden 64), "0.5b" and "1.5b": the dimensions of the real model named in
`like` (where no model of that architecture exists at that size, the nearest shape, said so there); llama3 also has
"8b-4l" (Llama-3-8B cut to 4 layers: the models suite's causal-LM loss cell).
Class names are strings, resolved on build: the catalogue imports without transformers, and an entry whose
class a transformers version lacks fails on build only."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

SIZES = ("tiny", "0.5b", "1.5b")
KINDS = ("causal", "encoder", "vision", "seq2seq")


@dataclass(frozen=True)
class ModelSpec:
    name: str                                  # "qwen2"
    config: str                                # transformers config class, e.g. "Qwen2Config"
    model: str                                 # inference class, e.g. "Qwen2ForCausalLM" / "BertModel"
    kind: str                                  # one of KINDS
    sizes: dict[str, dict[str, Any]]           # size -> config kwargs (on top of `common`)
    common: dict[str, Any] = field(default_factory=dict)
    train_model: str | None = None             # training class where it differs (encoders: a classification head)
    liger: str | None = None                   # liger_kernel.transformers apply function, where Liger supports it
    like: dict[str, str] = field(default_factory=dict)   # size -> whose dimensions
    features: str = ""                         # what the architecture exercises
    attn: str = "sdpa"                         # transformers' attention implementation of the unconverted model

    def config_kwargs(self, size: str) -> dict[str, Any]:
        if size not in self.sizes:
            raise KeyError(f"{self.name}: no size {size!r} (sizes: {sorted(self.sizes)})")
        return copy.deepcopy({**self.common, **self.sizes[size]})


def _rope(theta: float, **kw) -> dict:
    return {"rope_type": kw.pop("rope_type", "default"), "rope_theta": float(theta), **kw}


_TINY_DEC = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
_TINY_ENC = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                 max_position_embeddings=256)

_ENTRIES = [
    ModelSpec(
        "llama3", "LlamaConfig", "LlamaForCausalLM", "causal", liger="apply_liger_kernel_to_llama",
        features="RMSNorm, SwiGLU, GQA, Llama-3 rope scaling, tied embeddings",
        common=dict(tie_word_embeddings=True, rms_norm_eps=1e-5),
        sizes={
            "tiny": dict(_TINY_DEC, rope_parameters=_rope(500000.0, rope_type="llama3", factor=32.0,
                                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=64)),
            "0.5b": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_parameters=_rope(100000.0)),
            "1.5b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=_rope(500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192)),
            # the models suite's causal-LM loss cell (suite_models.LM_LOSS_CELL): the 8B's head and loss, its
            # vocabulary's logits the step's largest tensor
            "8b-4l": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                          tie_word_embeddings=False,
                          rope_parameters=_rope(500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=8192)),
        },
        like={"0.5b": "SmolLM2-360M (Llama architecture; no Llama-3 of this size)", "1.5b": "Llama-3.2-1B",
              "8b-4l": "Llama-3-8B's dimensions (untied 128256 vocabulary), 4 of its 32 layers"}),
    ModelSpec(
        "qwen2", "Qwen2Config", "Qwen2ForCausalLM", "causal", liger="apply_liger_kernel_to_qwen2",
        features="qkv bias, tied embeddings, GQA 7:1",
        common=dict(tie_word_embeddings=True, rms_norm_eps=1e-6),
        sizes={
            "tiny": dict(_TINY_DEC, rope_parameters=_rope(1e6)),
            "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_parameters=_rope(1e6)),
            "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_parameters=_rope(1e6)),
        },
        like={"0.5b": "Qwen2-0.5B", "1.5b": "Qwen2-1.5B"}),
    ModelSpec(
        "qwen3", "Qwen3Config", "Qwen3ForCausalLM", "causal", liger="apply_liger_kernel_to_qwen3",
        features="q/k RMSNorm, head dim 128, tied embeddings",
        common=dict(tie_word_embeddings=True, rms_norm_eps=1e-6, attention_bias=False),
        sizes={
            "tiny": dict(_TINY_DEC, head_dim=32, rope_parameters=_rope(1e6)),
            "0.5b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         rope_parameters=_rope(1e6)),
            "1.5b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         rope_parameters=_rope(1e6)),
        },
        like={"0.5b": "Qwen3-0.6B", "1.5b": "Qwen3-1.7B"}),
    ModelSpec(
        "mistral", "MistralConfig", "MistralForCausalLM", "causal", liger="apply_liger_kernel_to_mistral",
        features="sliding window 1024 (shorter than Mistral's 4096, so the s2048 cells run it), GQA, "
                 "head dims 96 / 80",
        common=dict(tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=1024),
        sizes={
            "tiny": dict(_TINY_DEC, sliding_window=8, rope_parameters=_rope(10000.0)),
            "0.5b": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=96, vocab_size=32000, max_position_embeddings=8192,
                         rope_parameters=_rope(100000.0)),
            "1.5b": dict(hidden_size=2560, intermediate_size=6912, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=80, vocab_size=32000, max_position_embeddings=16384,
                         rope_parameters=_rope(10000.0)),
        },
        like={"0.5b": "h2o-danube3-500m (in the Mistral architecture)", "1.5b": "h2o-danube-1.8b (Mistral)"}),
    ModelSpec(
        "gemma2", "Gemma2Config", "Gemma2ForCausalLM", "causal", liger="apply_liger_kernel_to_gemma2",
        attn="eager",            # transformers has no sdpa path with softcapping
        features="GeGLU (gelu tanh), (1+w) RMSNorms pre and post, attention softcap 50 / final logit softcap 30, "
                 "alternating local (window 512) / global layers, head dim 256, MQA",
        common=dict(tie_word_embeddings=True, rms_norm_eps=1e-6, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", sliding_window=512),
        sizes={
            "tiny": dict(_TINY_DEC, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                         rope_parameters=_rope(10000.0)),
            "0.5b": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, vocab_size=262144,
                         max_position_embeddings=32768, rope_parameters=_rope(10000.0)),
            "1.5b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, vocab_size=262144,
                         max_position_embeddings=32768, rope_parameters=_rope(10000.0)),
        },
        like={"0.5b": "Gemma-3-270M's dimensions in the Gemma-2 architecture (no Gemma-2 below 2B)",
              "1.5b": "Gemma-3-1B's dimensions in the Gemma-2 architecture"}),
    ModelSpec(
        "phi3", "Phi3Config", "Phi3ForCausalLM", "causal", liger="apply_liger_kernel_to_phi3",
        features="fused qkv_proj and gate_up_proj, MHA, head dim 96",
        common=dict(tie_word_embeddings=False, rms_norm_eps=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
                    attention_dropout=0.0, pad_token_id=0),
        sizes={
            "tiny": dict(_TINY_DEC, num_key_value_heads=4, rope_parameters=_rope(10000.0)),
            "0.5b": dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                         num_key_value_heads=12, vocab_size=32064, max_position_embeddings=4096,
                         original_max_position_embeddings=4096, rope_parameters=_rope(10000.0)),
            "1.5b": dict(hidden_size=2304, intermediate_size=6144, num_hidden_layers=20, num_attention_heads=24,
                         num_key_value_heads=24, vocab_size=32064, max_position_embeddings=4096,
                         original_max_position_embeddings=4096, rope_parameters=_rope(10000.0)),
        },
        like={"0.5b": "Phi-3-mini's shape (head dim 96, MHA) scaled to 0.33B (no Phi-3 below 3.8B)",
              "1.5b": "Phi-3-mini's shape scaled to 1.4B"}),
    ModelSpec(
        "gpt2", "GPT2Config", "GPT2LMHeadModel", "causal",
        features="Conv1D projections, LayerNorm, GELU(tanh) MLP, learned positions (extended to 2048)",
        common=dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_positions=2048),
        sizes={
            "tiny": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256),
            "0.5b": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257),
            "1.5b": dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257),
        },
        like={"0.5b": "GPT-2 medium (355M)", "1.5b": "GPT-2 XL (1.56B)"}),
    ModelSpec(
        "gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", "causal",
        features="parallel residual, partial rotary (25%), fused query_key_value, LayerNorm, GELU MLP",
        common=dict(use_parallel_residual=True, tie_word_embeddings=False, attention_dropout=0.0,
                    hidden_dropout=0.0, layer_norm_eps=1e-5, hidden_act="gelu"),
        sizes={
            "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=256, max_position_embeddings=256,
                         rope_parameters=_rope(10000.0, partial_rotary_factor=0.25)),
            "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         vocab_size=50304, max_position_embeddings=2048,
                         rope_parameters=_rope(10000.0, partial_rotary_factor=0.25)),
            "1.5b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
                         vocab_size=50304, max_position_embeddings=2048,
                         rope_parameters=_rope(10000.0, partial_rotary_factor=0.25)),
        },
        like={"0.5b": "Pythia-410M", "1.5b": "Pythia-1.4B"}),
    ModelSpec(
        "bert", "BertConfig", "BertModel", "encoder", train_model="BertForSequenceClassification",
        features="post-LN encoder, GELU MLP, learned positions, key padding",
        common=dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2),
        sizes={
            "tiny": dict(_TINY_ENC),
            "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         vocab_size=30522, max_position_embeddings=512),
            "1.5b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         vocab_size=30522, max_position_embeddings=512),
        },
        like={"0.5b": "BERT-large (335M)", "1.5b": "Megatron-BERT 1.3B's dimensions in the BERT architecture"}),
    ModelSpec(
        "modernbert", "ModernBertConfig", "ModernBertModel", "encoder",
        train_model="ModernBertForSequenceClassification",
        features="pre-LN encoder without biases, rotary, GeGLU MLP (one Wi), local layers (a token sees the 64 tokens "
                 "each way; bidirectional window) between global ones, key padding",
        common=dict(attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0, num_labels=2,
                    global_attn_every_n_layers=3, local_attention=128, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, cls_token_id=1, sep_token_id=2),
        sizes={
            "tiny": dict(_TINY_ENC, num_hidden_layers=3, local_attention=8),     # layers 1, 2 local (window 4)
            "0.5b": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16,
                         vocab_size=50368, max_position_embeddings=8192),
            "1.5b": dict(hidden_size=2048, intermediate_size=5248, num_hidden_layers=28, num_attention_heads=32,
                         vocab_size=50368, max_position_embeddings=8192),
        },
        like={"0.5b": "ModernBERT-large (395M)", "1.5b": "ModernBERT-large's shape at hidden 2048 (1.4B)"}),
    ModelSpec(
        "xlm_roberta", "XLMRobertaConfig", "XLMRobertaModel", "encoder",
        train_model="XLMRobertaForSequenceClassification",
        features="RoBERTa encoder, 250k vocabulary, padding-offset positions",
        common=dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1, num_labels=2),
        sizes={
            "tiny": dict(_TINY_ENC, max_position_embeddings=258),
            "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         vocab_size=250002, max_position_embeddings=514),
            "1.5b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         vocab_size=250002, max_position_embeddings=514),
        },
        like={"0.5b": "XLM-R large (560M)",
              "1.5b": "XLM-R large's shape at hidden 2048 (1.7B; between XLM-R large and XL)"}),
    ModelSpec(
        "vit", "ViTConfig", "ViTModel", "vision", train_model="ViTForImageClassification",
        features="patch embedding (conv), pre-LN encoder, no padding, head dims 80 / 104",
        common=dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, image_size=224, num_labels=1000),
        sizes={
            "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         image_size=32, patch_size=8, num_labels=10),
            "0.5b": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                         patch_size=14),
            "1.5b": dict(hidden_size=1664, intermediate_size=8192, num_hidden_layers=48, num_attention_heads=16,
                         patch_size=14),
        },
        like={"0.5b": "ViT-H/14 (632M)", "1.5b": "ViT-G/14 (1.8B)"}),
    ModelSpec(
        "bart", "BartConfig", "BartForConditionalGeneration", "seq2seq",
        features="encoder-decoder, learned positions, post-LN, GELU MLP, cross-attention over the padded encoder batch",
        common=dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                    eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None),
        sizes={
            "tiny": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256,
                         max_position_embeddings=256),
            "0.5b": dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                         decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265,
                         max_position_embeddings=1024),
            "1.5b": dict(d_model=2048, encoder_layers=12, decoder_layers=12, encoder_attention_heads=32,
                         decoder_attention_heads=32, encoder_ffn_dim=8192, decoder_ffn_dim=8192, vocab_size=50265,
                         max_position_embeddings=1024),
        },
        like={"0.5b": "BART-large (406M)", "1.5b": "BART-large's shape at hidden 2048"}),
    ModelSpec(
        "t5", "T5Config", "T5ForConditionalGeneration", "seq2seq",
        features="encoder-decoder, relative position bias, gated GELU, RMS-style T5 LayerNorm, cross-attention",
        common=dict(feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        sizes={
            "tiny": dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                         vocab_size=256),
            "0.5b": dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12,
                         vocab_size=32128),
            "1.5b": dict(d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_decoder_layers=24, num_heads=16,
                         vocab_size=32128),
        },
        like={"0.5b": "Flan-T5-base (248M)", "1.5b": "Flan-T5-large (783M)"}),
]

ZOO: dict[str, ModelSpec] = {e.name: e for e in _ENTRIES}


def spec(name: str) -> ModelSpec:
    if name not in ZOO:
        raise KeyError(f"no model {name!r} in the zoo ({sorted(ZOO)})")
    return ZOO[name]


def make_config(name: str, size: str, attn: str | None = None):
    """A fresh config object of the entry (transformers 5 keeps the config object a model is built from as
    model.config, so two models must never share one)."""
    import transformers
    e = spec(name)
    cfg = getattr(transformers, e.config)(**e.config_kwargs(size))
    cfg._attn_implementation = attn or e.attn
    return cfg


def build(name: str, size: str, device="cpu", dtype: torch.dtype = torch.float32, *, train: bool = False,
          attn: str | None = None, seed: int = 0, config=None):
    """A randomly initialized model of the entry at `size` on `device` in `dtype` (eval mode), with its own
    config object (deep-copied where `config` is given).  attn: transformers' attention implementation (default:
    the entry's, "sdpa" except where transformers has none).  train=True builds the training class (encoders: the
    sequence-classification model) in train mode."""
    import transformers
    e = spec(name)
    cfg = copy.deepcopy(config) if config is not None else make_config(name, size, attn)
    cls = getattr(transformers, (e.train_model or e.model) if train else e.model)
    torch.manual_seed(seed)
    with torch.device(device):
        m = cls(cfg)
    m = m.to(dtype)
    gc = getattr(m, "generation_config", None)
    if gc is not None:           # random weights: greedy decoding must not stop early on an EOS
        gc.eos_token_id = None
        gc.pad_token_id = getattr(cfg, "pad_token_id", None) or 0
    return m.train() if train else m.eval()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def vocab_size(cfg) -> int:
    return int(getattr(cfg, "vocab_size", None) or 256)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def padded_lengths(batch: int, seq: int, fraction: float = 0.3, seed: int = 0) -> torch.Tensor:
    """Row lengths with ~`fraction` of the batch's tokens padding (uniform in [1 - 2 fraction, 1] * seq; the
    first row is full)."""
    if fraction <= 0:
        return torch.full((batch,), seq, dtype=torch.long)
    lo = max(1, int(round((1 - 2 * fraction) * seq)))
    lens = torch.randint(lo, seq + 1, (batch,), generator=_generator(seed))
    lens[0] = seq
    return lens


def _mask(lens: torch.Tensor, seq: int) -> torch.Tensor:
    return (torch.arange(seq)[None, :] < lens[:, None]).long()


def causal_inputs(cfg, batch: int, seq: int, *, pad_tokens: int = 0, labels: bool = False, device="cpu",
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids; pad_tokens > 0: the last row right-padded by that many tokens (attention_mask 0 there, labels
    -100).  Unpadded batches carry no attention_mask (transformers runs them as plain causal)."""
    v = vocab_size(cfg)
    ids = torch.randint(0, v, (batch, seq), generator=_generator(seed))
    out = {"input_ids": ids}
    if pad_tokens:
        lens = torch.full((batch,), seq, dtype=torch.long)
        lens[-1] = seq - pad_tokens
        out["attention_mask"] = _mask(lens, seq)
    if labels:
        lab = ids.clone()
        if pad_tokens:
            lab[out["attention_mask"] == 0] = -100
        out["labels"] = lab
    return {k: t.to(device) for k, t in out.items()}


def packed_inputs(cfg, total: int, *, labels: bool = False, device="cpu", seed: int = 0) -> dict:
    """A padding-free packed batch (DataCollatorWithFlattening's form): one row of `total` tokens holding sequences
    of lengths drawn uniformly from [total / 32, total / 4] (the last one cut to fit), position ids restarting at
    each sequence, labels -100 on each sequence's first token, use_cache=False (transformers detects the packing
    only without a cache)."""
    g = _generator(seed)
    lo, hi = max(1, total // 32), max(1, total // 4)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(min(int(torch.randint(lo, hi + 1, (1,), generator=g)), total - sum(lens)))
    ids = torch.randint(0, vocab_size(cfg), (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    out = {"input_ids": ids, "position_ids": pos}
    if labels:
        lab = ids.clone()
        lab[pos == 0] = -100
        out["labels"] = lab
    out = {k: t.to(device) for k, t in out.items()}
    out["use_cache"] = False
    return out


def encoder_inputs(cfg, batch: int, seq: int, *, pad_fraction: float = 0.3, labels: bool = False, device="cpu",
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids + attention_mask with ~pad_fraction right padding; labels: one class per row."""
    v = vocab_size(cfg)
    g = _generator(seed)
    ids = torch.randint(2, v, (batch, seq), generator=g)
    am = _mask(padded_lengths(batch, seq, pad_fraction, seed), seq)
    ids = ids.masked_fill(am == 0, int(getattr(cfg, "pad_token_id", 0) or 0))
    out = {"input_ids": ids, "attention_mask": am}
    if labels:
        out["labels"] = torch.randint(0, int(getattr(cfg, "num_labels", 2)), (batch,), generator=g)
    return {k: t.to(device) for k, t in out.items()}


def vision_inputs(cfg, batch: int, *, labels: bool = False, device="cpu", seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = _generator(seed)
    px = torch.randn(batch, int(cfg.num_channels), int(cfg.image_size), int(cfg.image_size), generator=g)
    out = {"pixel_values": px.to(device=device, dtype=dtype)}
    if labels:
        out["labels"] = torch.randint(0, int(cfg.num_labels), (batch,), generator=g).to(device)
    return out


def seq2seq_inputs(cfg, batch: int, seq: int, dec_seq: int, *, pad_fraction: float = 0.0, labels: bool = False,
                   device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Encoder ids + attention_mask (~pad_fraction right padding) and decoder_input_ids; labels: the decoder
    targets, decoder_input_ids their right shift (as the model derives them), so the inputs without labels
    still run the same forward."""
    out = encoder_inputs(cfg, batch, seq, pad_fraction=pad_fraction, device="cpu", seed=seed)
    dec = torch.randint(2, vocab_size(cfg), (batch, dec_seq), generator=_generator(seed + 1))
    if labels:
        start = int(getattr(cfg, "decoder_start_token_id", 0) or 0)
        out["labels"] = dec
        dec = torch.cat([torch.full((batch, 1), start, dtype=dec.dtype), dec[:, :-1]], 1)
    out["decoder_input_ids"] = dec
    return {k: t.to(device) for k, t in out.items()}


def without_labels(inputs: dict) -> dict:
    """The same inputs for a forward without a loss (validation inputs of a training batch)."""
    return {k: v for k, v in inputs.items() if k != "labels"}


def inputs(name: str, cfg, batch: int, seq: int, *, padded: bool = False, labels: bool = False, device="cpu",
           dtype: torch.dtype = torch.float32, seed: int = 0, dec_seq: int | None = None,
           pad_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Inputs of the entry's kind.  padded: encoders / seq2seq ~30% right padding; causal LMs one row
    right-padded by `pad_tokens` (default ~15% of seq)."""
    kind = spec(name).kind
    if kind == "causal":
        pt = (pad_tokens if pad_tokens is not None else max(1, int(0.15 * seq))) if padded else 0
        return causal_inputs(cfg, batch, seq, pad_tokens=pt, labels=labels, device=device, seed=seed)
    if kind == "encoder":
        return encoder_inputs(cfg, batch, seq, pad_fraction=0.3 if padded else 0.0, labels=labels, device=device,
                              seed=seed)
    if kind == "vision":
        return vision_inputs(cfg, batch, labels=labels, device=device, seed=seed, dtype=dtype)
    return seq2seq_inputs(cfg, batch, seq, dec_seq or max(2, seq // 4), pad_fraction=0.3 if padded else 0.0,
                          labels=labels, device=device, seed=seed)


__all__ = ["ModelSpec", "ZOO", "SIZES", "KINDS", "spec", "make_config", "build", "inputs", "n_params", "grad_errors",
           "without_labels", "causal_inputs", "packed_inputs", "encoder_inputs", "vision_inputs", "seq2seq_inputs", "padded_lengths"]


def grad_errors(ref_model, model, floor: float = 1e-3) -> dict[str, Any]:
    """Every parameter's gradient in `model` against `ref_model`'s (same parameter names): the largest relative
    error ||g - g_ref|| / max(||g_ref||, floor * largest ||g_ref||) and the parameter it is at.  The floor keeps
    gradients that are zero in exact arithmetic (a key bias under softmax: ~1e-12 either way) from reading as
    100% errors.  `missing`: parameters where exactly one of the two has a gradient (max_rel_err is inf then)."""
    ref = dict(ref_model.named_parameters())
    got = dict(model.named_parameters())
    if ref.keys() != got.keys():
        return {"max_rel_err": float("inf"), "worst": sorted(ref.keys() ^ got.keys())[:3], "missing": [], "params": 0}
    norms = {n: p.grad.detach().double().norm().item() for n, p in ref.items() if p.grad is not None}
    top = max(norms.values(), default=0.0)
    worst, where, missing = 0.0, None, []
    for n, p in ref.items():
        g, h = p.grad, got[n].grad
        if g is None or h is None:
            if (g is None) != (h is None):
                missing.append(n)
            continue
        d = (h.detach().double() - g.detach().double()).norm().item()
        e = d / max(norms[n], floor * top, 1e-30)
        if not e == e or e > worst:          # NaN counts as the worst
            worst, where = (float("inf") if e != e else e), n
    if missing:                               # a gradient that never arrives is the worst error there is
        worst, where = float("inf"), missing[0]
    return {"max_rel_err": worst, "worst": where, "missing": missing, "params": len(norms)}
