"""convert_model on vision-language models with an image in the batch (tiny random models, float32, CPU, reference
backend): the vision tower and the language model both converted, outputs on real tokens, the training loss and
every gradient as the original's (bounds as tests/test_convert_architectures.py), and the causal-LM loss fused
(its probe call must build text-only inputs from the language model's config: vocabulary, no image placeholder
token).  Vision-text dual encoders (CLIP, SigLIP) and their vision towers alone likewise."""
import copy

import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: E402

from test_convert_architectures import _rel, assert_same_grads, shrink, train_step_losses  # noqa: E402

IMAGE_TOKEN = 5
# model type -> (image tokens per image, config overrides of the top config, of the vision config, extra inputs)
VLMS = {
    "llava": (16, {}, {}),                          # CLIP vision tower, 16 patches (the CLS token dropped)
    "gemma3": (4, dict(mm_tokens_per_image=4, boi_token_index=6, eoi_token_index=7), {}),   # SigLIP, pooled to 4
    "mistral3": (4, {}, {}),                        # Pixtral vision tower, patch merger 2x2
    "qwen2_5_vl": (4, dict(vision_start_token_id=6, vision_end_token_id=7),
                   dict(embed_dim=64, out_hidden_size=64, intermediate_size=128, fullatt_block_indexes=[1],
                        window_size=16)),          # windowed vision attention, M-RoPE in the LM
}


def _shrink(cfg) -> None:
    """shrink() of the config and of its sub-configs (vision, text)."""
    shrink(cfg)
    for name in getattr(cfg, "sub_configs", {}):
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink(sub)


def _config(model_type: str):
    try:
        cfg = AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as e:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}: {e}")
    _shrink(cfg)
    return cfg


def _vlm(model_type: str):
    n_img, top, vision = VLMS[model_type]
    torch.manual_seed(0)
    cfg = _config(model_type)
    for k, v in dict(image_size=32, patch_size=8, num_channels=3, **vision).items():
        if hasattr(cfg.vision_config, k):
            setattr(cfg.vision_config, k, v)
    for k in ("image_token_index", "image_token_id"):
        if hasattr(cfg, k):
            setattr(cfg, k, IMAGE_TOKEN)
    for k, v in top.items():
        setattr(cfg, k, v)
    if model_type == "qwen2_5_vl":                     # M-RoPE sections of the tiny head dim (16: 8 frequencies)
        cfg.text_config.rope_parameters = dict(cfg.text_config.rope_parameters, mrope_section=[2, 3, 3])
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 100, (2, 12 + n_img), generator=g)
    ids[:, 3:3 + n_img] = IMAGE_TOKEN
    mask = torch.ones_like(ids)
    x = {"input_ids": ids, "attention_mask": mask}
    if model_type == "qwen2_5_vl":                     # flattened patches (t 2 x 8 x 8 x 3 channels), a 4 x 4 grid each
        ids[:, 2], ids[:, 3 + n_img] = 6, 7
        mask[1, :2] = 0                                # (a left-padded row too)
        x.update(pixel_values=torch.randn(32, 3 * 2 * 8 * 8, generator=g),
                 image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))
    else:
        x["pixel_values"] = torch.randn(2, 3, 32, 32, generator=g)
    if model_type == "mistral3":
        x["image_sizes"] = torch.tensor([[32, 32], [32, 32]])
    return model, x, mask.bool()


@pytest.mark.parametrize("model_type", list(VLMS))
def test_vision_language_model_with_an_image(model_type):
    model, x, real = _vlm(model_type)
    with torch.no_grad():
        want = model(**x).logits
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    rep = str(conv.opsadv_report)
    assert conv.opsadv_report.status == "converted", rep
    assert "linear_cross_entropy" in rep, rep
    assert "vision" in rep or "visual" in rep, rep     # the vision tower's modules are rewritten too
    with torch.no_grad():
        got = conv(**x).logits
    assert _rel(got[real], want[real]) < 1e-5, rep
    labels = {"labels": x["input_ids"].masked_fill(x["input_ids"] == IMAGE_TOKEN, -100)}
    loss0, loss1 = train_step_losses(model, conv, x, labels)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_same_grads(model, conv, model_type, both_ways=True)


DUAL = {"clip": ("CLIPConfig", "CLIPModel"), "siglip": ("SiglipConfig", "SiglipModel"),
        "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel"), "siglip_vision": ("SiglipVisionConfig", "SiglipVisionModel")}


@pytest.mark.parametrize("name", list(DUAL))
def test_vision_text_encoders(name):
    cfg_cls, model_cls = (getattr(transformers, n) for n in DUAL[name])
    torch.manual_seed(0)
    cfg = cfg_cls()
    _shrink(cfg)
    for sub in (getattr(cfg, "vision_config", cfg), getattr(cfg, "text_config", None)):
        if sub is not None:
            for k, v in dict(image_size=32, patch_size=8, hidden_size=64, projection_size=64).items():
                if hasattr(sub, k):
                    setattr(sub, k, v)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    x = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    key = "pooler_output"
    if name in ("clip", "siglip"):
        x["input_ids"] = torch.randint(1, 100, (2, 7), generator=g)
        key = "logits_per_image"
    with torch.no_grad():
        want = getattr(model(**x), key)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    assert conv.opsadv_report.status == "converted", str(conv.opsadv_report)
    with torch.no_grad():
        got = getattr(conv(**x), key)
    assert _rel(got, want) < 1e-5
    model.train()
    conv.train()
    for m in (model, conv):
        getattr(m(**x), key).square().sum().backward()
    assert_same_grads(model, conv, name, both_ways=True)


@pytest.mark.parametrize("model_type", list(VLMS))
def test_vision_language_generate_over_paged_cache(model_type):
    """Greedy generate with an image over opsadv.PagedKVCache: the language model's layers take the cache (the vision
    tower's attention never sees it), the tokens are the original model's; Gemma-3's sliding-window layers are
    refused with the reason."""
    model, x, _ = _vlm(model_type)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    if model_type == "gemma3":
        with pytest.raises(InvalidArgumentError, match="sliding window"):
            opsadv.PagedKVCache(conv)
        return
    with torch.no_grad():
        want = model.generate(**x, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with opsadv.trace() as t:
            got = conv.generate(**x, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                past_key_values=opsadv.PagedKVCache(conv))
    assert torch.equal(got, want)
    assert t.counts.get("reference.paged_attention", 0) > 0, t.counts
