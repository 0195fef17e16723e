"""An encoder's local layers (ModernBERT: each token sees the tokens within w both ways) take sparse_attention with
a bidirectional window and the batch's key padding, never the dense masked flash_attention: inference and training,
eager and under torch.compile.  The mask function's form carries the window with the values of transformers' sdpa
mask (other readers: fallbacks).  Compared with the unconverted model in float32 at real positions."""
import copy

import pytest
import torch

import opsadv
from opsadv.convert import hf_attention as H
from opsadv.convert.masks import form_of
from opsadv.core.precision import PrecisionPolicy

from conftest import assert_same_step, attention_impls, rel_err, train_step

transformers = pytest.importorskip("transformers")
from transformers import masking_utils as mu  # noqa: E402

if not hasattr(mu, "create_bidirectional_sliding_window_mask"):
    pytest.skip("this transformers has no bidirectional sliding-window mask", allow_module_level=True)
from transformers import ModernBertConfig, ModernBertForSequenceClassification  # noqa: E402

VOCAB = 97


def modernbert(local_attention=8, layers=3, hidden=48, heads=4):
    """Layers 0 (global), 1 and 2 (local, window local_attention // 2 each way)."""
    torch.manual_seed(0)
    cfg = ModernBertConfig(hidden_size=hidden, intermediate_size=80, num_hidden_layers=layers,
                           num_attention_heads=heads, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, cls_token_id=1, sep_token_id=2, local_attention=local_attention,
                           global_attn_every_n_layers=3, max_position_embeddings=128, num_labels=3)
    return ModernBertForSequenceClassification(cfg).eval()


def convert(orig, **kw):
    kw.setdefault("backend", "reference")
    return opsadv.convert_model(copy.deepcopy(orig), floor=False, **kw)


def batch(seed, b=3, s=37, pads=(0, 11, 36)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    for i, p in enumerate(pads):
        if p:
            am[i, s - p:] = 0
    return ids.masked_fill(am == 0, 0), am, torch.randint(0, 3, (b,), generator=g)


def step(model, ids, am, labels, run=None):
    return train_step(model, dict(input_ids=ids, attention_mask=am, labels=labels), run)


@pytest.mark.parametrize("w,s,padded", [(4, 37, True), (4, 37, False), (1, 9, True), (0, 5, True), (20, 19, True)])
def test_the_form_has_sdpa_values_and_says_the_window(w, s, padded):
    pad = torch.ones(2, s, dtype=torch.bool)      # (transformers hands mask functions a bool padding mask)
    if padded:
        pad[1, s // 2:] = False
    cfg = ModernBertConfig(sliding_window=w)
    kw = dict(batch_size=2, q_length=s, kv_length=s, q_offset=0, kv_offset=0,
              mask_function=mu.sliding_window_bidirectional_mask_function(w), attention_mask=pad,
              allow_is_causal_skip=False, allow_is_bidirectional_skip=True, local_size=w, config=cfg, use_vmap=False)
    want = mu.sdpa_mask(**kw)
    got = H.opsadv_mask(**kw)
    if want is None:                               # no padding and every key in the window: no mask at all
        assert got is None
        return
    assert torch.equal(got, want)
    f = form_of(got)
    assert f is not None and not f.causal and (f.window, f.right) == (w, w)
    assert (f.key_padding is None) == (not padded)
    if padded:
        assert torch.equal(f.key_padding, pad)


def test_an_overlay_on_the_window_keeps_transformers_mask():
    pad = torch.ones(1, 9, dtype=torch.bool)
    fn = mu.and_masks(mu.sliding_window_bidirectional_mask_function(2), lambda b, h, q, k: k != 3)
    kw = dict(batch_size=1, q_length=9, kv_length=9, mask_function=fn, attention_mask=pad, local_size=2,
              allow_is_bidirectional_skip=False, use_vmap=True)
    got = H.opsadv_mask(**kw)
    assert torch.equal(got, mu.sdpa_mask(**kw)) and form_of(got) is None


@pytest.mark.parametrize("pads", [(0, 11, 36), (0, 0, 0)])
def test_local_layers_take_windowed_sparse_attention(pads):
    # the global layer: key padding (sparse_attention) with padding, the dense kernel without
    fwd = ({"reference.sparse_attention": 3} if any(pads) else
           {"reference.sparse_attention": 2, "reference.flash_attention": 1})
    orig = modernbert()
    conv = convert(orig)
    ids, am, labels = batch(1, pads=pads)
    real = am.bool()
    with torch.no_grad():
        want = orig.model(input_ids=ids, attention_mask=am).last_hidden_state
        with opsadv.trace() as t:
            got = conv.model(input_ids=ids, attention_mask=am).last_hidden_state
    assert attention_impls(t) == fwd, str(t)
    assert rel_err(got[real], want[real]) < 1e-5
    assert not conv._opsadv_state.fallbacks
    orig.train()
    conv.train()
    want = step(orig, ids, am, labels)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels)
    assert attention_impls(t) == {k: 2 * v for k, v in fwd.items()}, str(t)      # forward and backward
    assert_same_step(want, got)


def test_compiled_training_step_takes_windowed_sparse_attention():
    orig = modernbert()
    conv = convert(orig)
    orig.train()
    conv.train()
    ids, am, labels = batch(2)
    want = step(orig, ids, am, labels)
    run = torch.compile(conv, backend="aot_eager", fullgraph=False)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels, run=run)
    assert set(attention_impls(t)) == {"reference.sparse_attention"}, str(t)
    assert_same_step(want, got)


def test_cuda_backend_in_the_interpreter():
    """The cuda backend's Triton sparse kernel serves the bidirectional window + key padding, forward and backward
    (the Triton interpreter on CPU; attention in fp16 from fp32 inputs)."""
    orig = modernbert(layers=2, hidden=64)                         # head_dim 16; layer 1 is local
    conv = convert(orig, backend="cuda", precision=PrecisionPolicy(attention="fp16"), opt_level=1, validate=False)
    orig.train()
    conv.train()
    ids, am, labels = batch(3, b=2, s=19, pads=(0, 7))
    want = step(orig, ids, am, labels)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels)
    assert attention_impls(t) == {"cuda.triton.sparse_attention": 4}, str(t)
    assert_same_step(want, got, tol=2e-2)
