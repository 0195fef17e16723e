"""Built-in demo architectures (tiny random configs) for the CLI, examples and GPU probes, plus
loading a local transformers model directory."""
from __future__ import annotations

import torch
from opsadv.core.errors import InvalidArgumentError

from .validate import hf_validation_inputs

DEMOS = ("demo-llama", "demo-mistral", "demo-qwen2", "demo-bert", "demo-roberta", "demo-gpt2")

_DEC = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512)
_ENC = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
            max_position_embeddings=512)


def demo_model(name: str, seed: int = 0, **overrides):
    """A randomly initialised transformers model of the named architecture (eval mode)."""
    import transformers as tf
    torch.manual_seed(seed)
    arch = name.removeprefix("demo-")
    if arch in ("llama", "mistral", "qwen2"):
        cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                              "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                              "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[arch]
        cfg = cfg_cls(**{**_DEC, **overrides})
    elif arch in ("bert", "roberta"):
        cfg_cls, model_cls = {"bert": (tf.BertConfig, tf.BertModel), "roberta": (tf.RobertaConfig, tf.RobertaModel)}[arch]
        cfg = cfg_cls(**{**_ENC, **overrides})
    elif arch == "gpt2":
        cfg_cls, model_cls = tf.GPT2Config, tf.GPT2LMHeadModel
        cfg = cfg_cls(**{**dict(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=512), **overrides})
    else:
        raise ValueError(f"unknown demo architecture {name!r}; known: {list(DEMOS)}")
    return model_cls(cfg).eval()


def check_model_spec(spec: str) -> None:
    """Refuse (InvalidArgumentError) what load_model cannot load, before anything is imported or read: an
    unknown demo name, a path that is not a model directory.  A name like "org/model" is left to load_model
    (transformers' local cache, offline)."""
    import re
    from pathlib import Path

    if spec in DEMOS:
        return
    expected = f"a local transformers model directory (with config.json) or one of {', '.join(DEMOS)}"
    p = Path(spec)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise InvalidArgumentError("load_model", "MODEL", expected, f"{spec!r} (a directory without config.json)")
        return
    if spec.startswith("demo-") or not re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        import difflib
        near = difflib.get_close_matches(spec, DEMOS, 1)
        why = "not a directory" + (f"; did you mean {near[0]}?" if near else "")
        raise InvalidArgumentError("load_model", "MODEL", expected, f"{spec!r} ({why})")


def load_model(spec: str, dtype: torch.dtype | None = None):
    """A demo name, or a local transformers model directory (loaded offline: nothing is downloaded)."""
    if spec in DEMOS:
        m = demo_model(spec)
        return m.to(dtype) if dtype is not None else m
    check_model_spec(spec)
    import transformers as tf
    try:
        cfg = tf.AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as e:      # e.g. an "org/model" name that is not in the local cache
        raise InvalidArgumentError("load_model", "MODEL", "a local transformers model directory or a model in "
                                   "transformers' local cache (nothing is downloaded)",
                                   f"{spec!r} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
    archs = getattr(cfg, "architectures", None) or []
    cls = getattr(tf, archs[0], None) if archs else None
    cls = cls or tf.AutoModel
    kw = {"dtype": dtype} if dtype is not None else {}
    return cls.from_pretrained(spec, local_files_only=True, **kw).eval()


def example_inputs(model, batch: int = 2, seq: int = 32, device=None) -> dict:
    """Unpadded token ids for a text model; for vision, audio and encoder-decoder models the inputs validation
    generates from the config (pixel_values, input_features, decoder_input_ids)."""
    if getattr(model, "main_input_name", "input_ids") != "input_ids" or getattr(model.config, "is_encoder_decoder",
                                                                                 False):
        x = hf_validation_inputs(model, batch, seq)
        return {k: v.to(device) for k, v in x.items()} if device is not None else x
    vocab = int(getattr(model.config, "vocab_size", 512))
    ids = torch.randint(0, vocab, (batch, seq))
    am = torch.ones(batch, seq, dtype=torch.long)
    dev = device or next(model.parameters()).device
    return {"input_ids": ids.to(dev), "attention_mask": am.to(dev)}
