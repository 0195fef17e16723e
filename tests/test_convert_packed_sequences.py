"""Padding-free packed batches (one row of several sequences, each with its own position ids, no attention mask:
transformers' DataCollatorWithFlattening, TRL's padding_free): transformers builds a block-diagonal causal mask
from the position ids; the converted model recognises that mask's form and runs causal varlen sparse_attention (a
sliding window too) instead of a dense masked kernel.  Outputs equal the original model's and each sequence run
alone; the training loss and every gradient equal the original's (tiny random models, float32, reference backend)."""
import copy

import pytest
import torch

import opsadv
from opsadv import SparseLayout
from opsadv.core.errors import InvalidArgumentError

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


def _batches(model, x):
    """name -> (inputs, labels): the packed row; two packed rows; a plain batch without a cache (which transformers
    also builds the packed form for while compiling: it cannot tell on the host that nothing is packed)."""
    xp, labels, _ = _packed(model)
    two = {k: (torch.cat([v, v]) if torch.is_tensor(v) else v) for k, v in xp.items()}
    two["input_ids"] = torch.cat([xp["input_ids"], xp["input_ids"].flip(-1)])
    return {"packed": (xp, labels), "two packed rows": (two, {"labels": torch.cat([labels["labels"]] * 2)}),
            "plain, use_cache=False": ({"input_ids": x["input_ids"], "use_cache": False},
                                       {"labels": x["input_ids"]})}


def _eager_then_compiled(model, conv, inputs, labels, **compile_kw):
    """One training step of the original in eager and of the converted model under torch.compile, from zeroed
    gradients: (eager loss, compiled loss, the compiled step's opsadv.trace)."""
    for m in (model, conv):
        m.train()
        m.zero_grad(set_to_none=True)
    want = model(**inputs, **labels).loss
    want.backward()
    torch._dynamo.reset()
    step = torch.compile(lambda: conv(**inputs, **labels).loss, **compile_kw)
    with opsadv.trace() as t:
        loss = step()
        loss.backward()
    return want, loss, t


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
def test_compiled_training_steps_without_a_cache_run_varlen(arch):
    """torch.compile (aot_eager, fullgraph) of a training step without a cache: transformers' traced packed mask is
    recognised by its structure and its segments are read off its values on the device, so each layer runs causal
    varlen sparse_attention (a window on Mistral's and Gemma-3's local layers) instead of the dense masked kernel;
    loss and every gradient as the original's in eager."""
    model, x = _model(arch)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    n = model.config.num_hidden_layers
    for what, (inputs, labels) in _batches(model, x).items():
        want, loss, t = _eager_then_compiled(model, conv, inputs, labels, backend="aot_eager", fullgraph=True)
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), what
        assert_same_grads(model, conv, f"{arch} {what} compiled", both_ways=True)
        assert t.counts.get("reference.sparse_attention", 0) == 2 * n, (what, t.counts)    # forward + backward
        assert "reference.flash_attention" not in t.counts, (what, t.counts)


def test_compiled_cache_free_step_whose_attention_falls_back():
    """Gemma-2's softcapped attention has no opsadv kernel: under compile its calls get the packed form's mask too,
    and the fallback (the modeling file's eager attention) reads transformers' own (b, 1, s, s) values from it, not
    the layout's rows laid end to end."""
    from test_convert_architectures import _build
    model, x, _, _ = _build("causal", "gemma2")
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="reference", example_inputs=x)
    inputs, labels = {"input_ids": x["input_ids"], "use_cache": False}, {"labels": x["input_ids"]}
    want, loss, _ = _eager_then_compiled(model, conv, inputs, labels, backend="aot_eager")
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert_same_grads(model, conv, "gemma2 compiled fallback", both_ways=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a GPU")
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_gpu_compiled_training_steps_without_a_cache_run_varlen(arch):
    """The same on the GPU (bf16, backend auto, inductor): each batch's segments come from the mask on the device
    (cu_seqlens of b * s + 1 entries, most of them empty trailing segments) and a CUDA sparse_attention kernel
    serves forward and backward; loss and gradients within bf16 rounding of the unconverted model's in eager."""
    model, x = _model(arch)
    model = model.to("cuda", torch.bfloat16)
    conv = opsadv.convert_model(copy.deepcopy(model), floor=False, backend="auto",
                                example_inputs={k: v.cuda() for k, v in x.items()})
    for what, (inputs, labels) in _batches(model, x).items():
        inputs = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in inputs.items()}
        labels = {k: v.cuda() for k, v in labels.items()}
        want, loss, t = _eager_then_compiled(model, conv, inputs, labels)
        assert loss.item() == pytest.approx(want.item(), rel=2e-2), what
        ran = [k for k in t.counts if "attention" in k or "varlen" in k]      # (impl ids: cuda.sdpa.flash_varlen)
        assert ran and not any("flash_attention" in k or k.startswith("reference") for k in ran), (what, t.counts)
        for (name, a), b in zip(model.named_parameters(), conv.parameters()):
            rel = ((b.grad.float() - a.grad.float()).norm() / a.grad.float().norm().clamp_min(1e-30)).item()
            assert rel < 0.05, (what, name, rel)


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("lens", [[5, 1, 7], [13], [1, 1, 1], [4, 9, 2, 3]], ids=str)
def test_packed_segments_reads_transformers_mask(lens, window):
    """packed_segments on transformers' own packed masks (two rows, lengths with 1-token sequences, a window of
    1): cu_seqlens over the rows laid end to end (b * s + 1 entries, trailing ones = b * s), whose varlen layout is
    exactly the mask; the layout's segments never cross a row."""
    from transformers import masking_utils as mu
    from opsadv.ops.sparse_attention.packed_segments import expected_mask, packed_segments
    s = sum(lens)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    pos = torch.cat([pos, torch.arange(s)[None] + 2])          # second row: one sequence starting at position 2
    seq_ids = mu.find_packed_sequence_indices(pos)
    if seq_ids is None:
        seq_ids = torch.zeros_like(pos)
    inner = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    fn = mu.and_masks(inner, mu.packed_sequence_mask_function(seq_ids))
    m = mu.sdpa_mask(batch_size=2, q_length=s, kv_length=s, q_offset=0, kv_offset=0, mask_function=fn,
                     attention_mask=None, allow_is_causal_skip=False, dtype=torch.float32, device=torch.device("cpu"))
    left = None if window is None else window - 1
    cu = packed_segments(m, left)
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    real = starts + [s] if window != 1 else list(range(2 * s))
    want = real + [2 * s] * (2 * s + 1 - len(real))
    assert cu.dtype == torch.int32 and cu.tolist() == want
    assert torch.equal(expected_mask(m, -1 if left is None else left), m)
    lay = SparseLayout.varlen([b - a for a, b in zip(want[:-1], want[1:])], causal=True,
                              window=left, block_size=8)
    dense = lay.dense_mask().reshape(2 * s, 2 * s)
    assert torch.equal(dense[:s, :s], m[0, 0]) and torch.equal(dense[s:, s:], m[1, 0])
    assert not dense[:s, s:].any() and not dense[s:, :s].any()


def test_packed_segments_refuses_another_pattern():
    """A mask that is not causal within its segments (a bidirectional block, as an image overlay adds; a window
    the caller did not name) is refused with the op and the argument named, never run as the wrong pattern."""
    from opsadv.ops.sparse_attention.packed_segments import packed_segments
    s = 9
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    overlay = causal.clone()
    overlay[2:5, 2:5] = True
    window = causal & ~torch.ones(s, s, dtype=torch.bool).tril(-3)
    for bad, left in ((overlay, None), (window, None), (causal, 1)):
        with pytest.raises(InvalidArgumentError, match="packed_segments.*mask"):
            packed_segments(bad[None, None], left)
    with pytest.raises(InvalidArgumentError, match="packed_segments.*bool tensor"):
        packed_segments(causal[None, None].float())
    assert packed_segments(window[None, None], 2).tolist() == [0] + [s] * s
    # compared a block of rows at a time: a difference in any block, the last one included, is seen
    from opsadv.ops.sparse_attention.packed_segments import _matches, _segments
    for rows in (2, 4, 9):
        _, start = _segments(causal[None, None], -1)
        assert _matches(causal[None, None], start, -1, rows_per_step=rows)
        late = causal.clone()
        late[8, 0] = False
        _, start = _segments(late[None, None], -1)
        assert not _matches(late[None, None], start, -1, rows_per_step=rows)


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
