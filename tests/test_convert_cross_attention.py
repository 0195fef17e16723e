"""An encoder-decoder's cross-attention over a padded encoder batch (s_q != s_k) takes sparse_attention with the
encoder's key padding (its own backward), not the dense masked flash_attention: training eager and under
torch.compile, and the prompt step of generate; one-query decode steps keep the dense kernel with the padding
broadcast.  Compared with the unconverted model in float32."""
import copy

import pytest
import torch

import opsadv
from opsadv.core.precision import PrecisionPolicy

from conftest import assert_same_step, attention_impls, train_step

transformers = pytest.importorskip("transformers")
from transformers import BartConfig, BartForConditionalGeneration  # noqa: E402

VOCAB = 97


def bart(hidden=48, heads=4):
    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=VOCAB, d_model=hidden, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=80,
                     decoder_ffn_dim=80, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=None)
    return BartForConditionalGeneration(cfg).eval()


def convert(orig, **kw):
    kw.setdefault("backend", "reference")
    return opsadv.convert_model(copy.deepcopy(orig), floor=False, **kw)


def batch(seed, b=3, s=19, t=7, pads=(0, 7, 18)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    for i, p in enumerate(pads):
        if p:
            am[i, s - p:] = 0
    return dict(input_ids=ids.masked_fill(am == 0, 1), attention_mask=am,
                labels=torch.randint(3, VOCAB, (b, t), generator=g))


def same_step(want, got, tol=1e-4):
    # a key projection's bias gets a gradient zero in exact arithmetic (softmax ignores it): rounding noise both sides
    assert_same_step(want, got, tol, grad_floor=True)


def test_training_cross_attention_takes_key_padding_sparse_attention():
    orig = bart()
    conv = convert(orig)
    orig.train()
    conv.train()
    x = batch(1)
    want = train_step(orig, x)
    with opsadv.trace() as t:
        got = train_step(conv, x)
    # encoder self-attention and cross-attention (2 + 2 layers): key padding; decoder self-attention: causal, no mask
    assert attention_impls(t) == {"reference.sparse_attention": 8, "reference.flash_attention": 4}, str(t)
    same_step(want, got)


def test_compiled_training_step():
    orig = bart()
    conv = convert(orig)
    orig.train()
    conv.train()
    x = batch(2)
    want = train_step(orig, x)
    run = torch.compile(conv, backend="aot_eager")
    with opsadv.trace() as t:
        got = train_step(conv, x, run=run)
    assert attention_impls(t) == {"reference.sparse_attention": 8, "reference.flash_attention": 4}, str(t)
    same_step(want, got)


def test_generate_matches():
    orig = bart()
    conv = convert(orig)
    x = batch(3)
    x.pop("labels")
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    with torch.no_grad():
        want = orig.generate(**x, **kw)
        got = conv.generate(**x, **kw)
    assert torch.equal(got, want)


def test_cuda_backend_in_the_interpreter():
    """The cuda backend's Triton sparse kernel serves cross-attention over key padding (s_q != s_k), forward and
    backward (the Triton interpreter on CPU; attention in fp16 from fp32 inputs)."""
    orig = bart(hidden=128)                                         # head_dim 32
    conv = convert(orig, backend="cuda", precision=PrecisionPolicy(attention="fp16"), opt_level=1, validate=False)
    orig.train()
    conv.train()
    x = batch(4, b=2, s=21, t=9, pads=(0, 8))
    want = train_step(orig, x)
    with opsadv.trace() as t:
        got = train_step(conv, x)
    assert attention_impls(t).get("cuda.triton.sparse_attention") == 8, str(t)
    same_step(want, got, tol=2e-2)


# ---- the bidirectional padding form (encoders, cross-attention): the layout built once ---------------------------
def _plain(pad, q_len):
    from transformers import masking_utils as mu
    from opsadv.convert import hf_attention as H
    return H.opsadv_mask(batch_size=pad.shape[0], q_length=q_len, kv_length=pad.shape[1], device="cpu",
                         mask_function=mu.bidirectional_mask_function, attention_mask=pad.bool())


@pytest.mark.parametrize("q_len", [9, 4])
def test_forms_of_equal_padding_share_one_key_padding_tensor(q_len):
    """As the causal form's: every step's mask of the same padding hands the layers the same key padding tensor (a
    compiled layer stack's graph input; the kernels' tile index is cached on it), so the tile lists are built once,
    not per step.  Other padding gets its own; values as transformers' mask."""
    from opsadv.convert.masks import key_padding_of
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, 6:] = 0
    a, b = (key_padding_of(_plain(p, q_len)) for p in (pad, pad.clone()))
    assert a.data_ptr() == b.data_ptr() and torch.equal(a, pad.bool())
    other = pad.clone()
    other[0, 8:] = 0
    c = key_padding_of(_plain(other, q_len))
    assert c.data_ptr() != a.data_ptr() and torch.equal(c, other.bool())


def test_layers_take_the_layout_the_mask_function_built(monkeypatch):
    """The eager layers' layout lookup gets the layout the mask function built: no second read of the mask."""
    from opsadv.convert import hf_attention as H
    from opsadv.convert.masks import key_padding_of
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, 6:] = 0
    m = _plain(pad, 4)                                             # cross-attention: 4 queries, 9 keys

    def read_again(*a, **k):
        raise AssertionError("the mask's values were read again")
    monkeypatch.setattr(H.SparseLayout, "key_padding", read_again)
    lay = H._padding_layout(m, key_padding_of(m), 4, 9, False)
    assert lay.seq_q == 4 and not lay.causal and torch.equal(lay.key_padding_mask, pad.bool())
