"""Inputs generated from a transformers model's config when `example_inputs` is not given: token ids (text),
decoder_input_ids (encoder-decoder: T5, Whisper), pixel_values (vision: ViT), input_features (audio: Whisper);
any other input kind is refused with an error naming what to pass.  Tiny random configs, no hub."""
import pytest
import torch

import opsadv
from opsadv.convert.validate import hf_validation_inputs

tf = pytest.importorskip("transformers")


def tiny(name):
    torch.manual_seed(0)
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1, dropout_rate=0.0)).eval()
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=96, image_size=32, patch_size=8, num_channels=3)).eval()
    if name == "whisper":
        return tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=16,
            max_source_positions=32, max_target_positions=40, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)).eval()
    raise ValueError(name)


EXPECTED = {
    "t5": {"input_ids": (2, 24), "attention_mask": (2, 24), "decoder_input_ids": (2, 13)},
    "vit": {"pixel_values": (2, 3, 32, 32)},
    "whisper": {"input_features": (2, 16, 64), "decoder_input_ids": (2, 13)},
}


@pytest.mark.parametrize("name", ["t5", "vit", "whisper"])
def test_generated_inputs_follow_the_config(name):
    m = tiny(name)
    x = hf_validation_inputs(m)
    assert {k: tuple(v.shape) for k, v in x.items()} == EXPECTED[name]
    if "pixel_values" in x or "input_features" in x:
        assert next(v for v in x.values()).dtype == torch.float32
    if "decoder_input_ids" in x:
        assert (x["decoder_input_ids"][:, 0] == m.config.decoder_start_token_id).all()
        assert int(x["decoder_input_ids"].max()) < m.config.vocab_size
    with torch.no_grad():
        m(**x)                                  # the model takes them as they are


@pytest.mark.parametrize("name", ["t5", "vit", "whisper"])
def test_convert_model_without_example_inputs(name, reference_backend):
    m = tiny(name)
    c = opsadv.convert_model(m, floor=False)
    rep = c.opsadv_report
    assert rep.validation["passed"], rep
    assert rep.validation["tokens"] > 0
    assert any(ch.kind in ("replaced", "fused", "attention") for ch in rep.changes), rep    # something runs opsadv ops
    assert set(c._opsadv_example_inputs) == set(EXPECTED[name])


def test_unknown_input_kind_names_what_to_pass(reference_backend):
    m = tiny("vit")
    m.main_input_name = "input_values"          # e.g. a raw-waveform model (wav2vec2-style)
    with pytest.raises(opsadv.errors.InvalidArgumentError) as e:
        opsadv.convert_model(m, floor=False)
    msg = str(e.value)
    assert "example_inputs" in msg and "'input_values'" in msg and "ViTModel" in msg


def test_tune_for_hardware_of_a_vision_model(reference_backend):
    c = opsadv.convert_model(tiny("vit"), floor=False)
    c.tune_for_hardware(device="cpu", batch_size=3, progress=False)
    rep = c.opsadv_tune_report
    assert rep.shapes == ["pixel_values (3, 3, 32, 32)"] and rep.calls_per_impl
