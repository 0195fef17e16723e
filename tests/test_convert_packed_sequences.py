"""Padding-free packed batches (one row of several sequences, each with its own position ids, no attention mask:
transformers' DataCollatorWithFlattening, TRL's padding_free): transformers builds a block-diagonal causal mask
from the position ids; the converted model recognises that mask's form and runs causal varlen sparse_attention (a
sliding window too) instead of a dense masked kernel.  Outputs equal the original model's and each sequence run
alone; the training loss and every gradient equal the original's (tiny random models, float32, reference backend)."""
import copy

import pytest
import torch

import opsadv

pytest.importorskip("transformers")
from test_convert_architectures import _build, _rel, assert_same_grads, train_step_losses  # noqa: E402

LENS = [7, 15, 8, 1, 12]
# architecture -> config overrides (a window shorter than the sequences, so that it matters)
ARCHS = {"llama": {}, "qwen2": {}, "phi3": {}, "gpt_neox": {}, "mistral": dict(sliding_window=4),
         "gemma3_text": dict(sliding_window=4)}


def _packed(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (1, sum(LENS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENS])[None]
    starts = [0]
    for n in LENS[:-1]:
        starts.append(starts[-1] + n)
    labels = ids.clone()
    labels[0, starts] = -100                  # (a sequence's first token predicts nothing of the one before)
    return {"input_ids": ids, "position_ids": pos, "use_cache": False}, {"labels": labels}, starts


def _model(arch):
    model, x, _, _ = _build("causal", arch)
    for k, v in ARCHS[arch].items():
        setattr(model.config, k, v)
        for m in model.modules():
            if "sliding_window" in vars(m) and k == "sliding_window" and m.sliding_window is not None:
                m.sliding_window = v
    return model, x


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_sequences_run_varlen_and_match(arch):
    model, x = _model(arch)
    xp, labels, starts = _packed(model)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    with torch.no_grad():
        want = model(**xp).logits
        alone = torch.cat([model(input_ids=xp["input_ids"][:, s:s + n], use_cache=False).logits
                           for s, n in zip(starts, LENS)], 1)
        with opsadv.trace() as t:
            got = conv(**xp).logits
    assert _rel(want, alone) < 1e-5                       # (transformers' packed mask: sequences independent)
    assert _rel(got, want) < 1e-5
    assert t.counts.get("reference.sparse_attention", 0) == model.config.num_hidden_layers, t.counts
    assert "reference.flash_attention" not in t.counts, t.counts
    loss0, loss1 = train_step_losses(model, conv, xp, labels)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert_same_grads(model, conv, arch, both_ways=True)


def test_packed_rows_with_a_mask_or_a_batch_keep_transformers_mask():
    """Forms this does not take (several rows; an explicit attention mask, where transformers does not pack) stay
    transformers' masks, served exactly by the masked kernel."""
    model, x = _model("llama")
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    xp, _, _ = _packed(model)
    two = {k: (torch.cat([v, v.flip(-1) if k == "input_ids" else v]) if torch.is_tensor(v) else v)
           for k, v in xp.items()}
    masked = dict(xp, attention_mask=torch.ones_like(xp["input_ids"]))
    for inputs in (two, masked):
        with torch.no_grad():
            with opsadv.trace() as t:
                got = conv(**inputs).logits
            want = model(**inputs).logits
        assert _rel(got, want) < 1e-5
        assert "reference.sparse_attention" not in t.counts, t.counts


def test_packed_training_step_under_compile():
    """torch.compile (aot_eager) of a packed training step: transformers' mask while tracing (the lengths would be a
    host read), loss and gradients as the original's in eager."""
    model, x = _model("llama")
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    xp, labels, _ = _packed(model)
    model.train()
    conv.train()
    model(**xp, **labels).loss.backward()
    torch._dynamo.reset()
    loss = torch.compile(lambda: conv(**xp, **labels).loss, backend="aot_eager")()
    loss.backward()
    want = model(**xp, **labels).loss.item()
    assert abs(loss.item() - want) <= 1e-5 * abs(want)
    assert_same_grads(model, conv, "llama packed compiled")


@pytest.mark.parametrize("remapped", [False, True], ids=["transformers-5.17-form", "remapped-positions-form"])
@pytest.mark.parametrize("window", [None, 3])
def test_mask_function_takes_both_packed_forms(remapped, window):
    """The packed mask as transformers 5.17 builds it (and_masks(causal or window function, same-sequence function))
    and as later versions do (the causal function under remapped positions): both carry the varlen layout of the
    sequences, and the mask's values are transformers' sdpa mask's."""
    from transformers import masking_utils as mu
    from opsadv.convert.hf_attention import opsadv_mask
    from opsadv.convert.packing import pack_of
    if remapped and not hasattr(mu, "remap_positions_for_packed_sequence"):
        pytest.skip("this transformers has no remap_positions_for_packed_sequence")
    pos = torch.cat([torch.arange(n) for n in LENS])[None]
    seq_ids = mu.find_packed_sequence_indices(pos)
    inner = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    if remapped:
        inner = mu.remap_positions_for_packed_sequence(inner, pos)
    fn = mu.and_masks(inner, mu.packed_sequence_mask_function(seq_ids))
    n = sum(LENS)
    kw = dict(batch_size=1, q_length=n, kv_length=n, q_offset=0, kv_offset=0, mask_function=fn, attention_mask=None,
              allow_is_causal_skip=False, dtype=torch.float32, device=torch.device("cpu"))
    if window is not None:
        kw["local_size"] = window
    m = opsadv_mask(**kw)
    pack = pack_of(m)
    assert pack is not None
    assert torch.equal(m, mu.sdpa_mask(**kw))
    assert torch.equal(pack.layout.dense_mask(device="cpu").reshape(n, n), m.reshape(n, n))
