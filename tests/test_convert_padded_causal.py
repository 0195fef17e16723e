"""Padded causal batches in a converted decoder take the causal + key-padding kernels (sparse_attention with
its own backward), never the dense masked flash_attention: right padding in training, left padding in
generate (prefill and decode with a DynamicCache), eager and under torch.compile (static and dynamic
shapes).  The mask function's causal form (opsadv_mask) carries what the attention needs, with the
values of transformers' sdpa mask.  Compared with the unconverted model in float32 at real positions."""
import copy

import pytest
import torch

import opsadv
from opsadv.convert import hf_attention as H
from opsadv.ops.sparse_attention.layout import SparseLayout
from opsadv.core.precision import PrecisionPolicy

from conftest import assert_same_step, attention_impls, rel_err, train_step

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

VOCAB = 97


def llama(layers=2, hidden=48, heads=4, kv=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=VOCAB, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def convert(orig, **kw):
    kw.setdefault("backend", "reference")
    return opsadv.convert_model(copy.deepcopy(orig), floor=False, **kw)


def batch(seed, b=3, s=23, pads=(0, 6, 14), left=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (b, s), generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    for i, p in enumerate(pads):
        if p and left:
            am[i, :p] = 0
        elif p:
            am[i, s - p:] = 0
    ids = ids.masked_fill(am == 0, 0)
    return ids, am, ids.masked_fill(am == 0, -100)


def step(model, ids, am, labels, run=None):
    return train_step(model, dict(input_ids=ids, attention_mask=am, labels=labels), run)


# ---- the mask function's causal form ----------------------------------------------------------------------
def _sdpa(**kw):
    return mu.sdpa_mask(**{**kw, "allow_is_causal_skip": False})


@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (1, 9), (3, 11)])
def test_causal_form_has_sdpa_values_and_says_causal(q_len, kv_len):
    pad = torch.ones(2, kv_len, dtype=torch.long)
    pad[0, :2] = 0                                 # left padding
    pad[1, kv_len - 1:] = 0
    kw = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len, kv_offset=0,
              mask_function=mu.causal_mask_function, attention_mask=pad, device="cpu")
    m = H.opsadv_mask(**kw)
    f = H.causal_mask_of(m)
    assert f is not None and f.causal and torch.equal(f.key_padding, pad.bool())
    assert f.block_mask.shape == (1, 1, 1, 1) and bool(f.block_mask.all())
    assert torch.equal(m, _sdpa(**kw))
    assert H.key_padding_of(m) is None             # never mistaken for the bidirectional form


def test_causal_forms_of_equal_padding_share_one_key_padding_tensor():
    """Every step's mask of the same padding hands the layers the same key padding tensor: a compiled layer stack
    (regional compilation) gets it as a graph input, and the sparse kernels' tile index, cached on it, is then built
    once instead of on every step (with its host reads).  Different padding gets its own."""
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, 6:] = 0
    kw = dict(batch_size=2, q_length=9, kv_length=9, mask_function=mu.causal_mask_function, device="cpu")
    a = H.causal_mask_of(H.opsadv_mask(**kw, attention_mask=pad)).key_padding
    b = H.causal_mask_of(H.opsadv_mask(**kw, attention_mask=pad.clone())).key_padding
    assert a is b and torch.equal(a, pad.bool())
    other = pad.clone()
    other[0, 8:] = 0
    c = H.causal_mask_of(H.opsadv_mask(**kw, attention_mask=other)).key_padding
    assert c is not a and torch.equal(c, other.bool()) and torch.equal(a, pad.bool())


def test_layers_take_the_layout_the_mask_function_built(monkeypatch):
    """The eager layers' layout lookup gets the layout the mask function built for this mask: no second read of the
    mask's values (each is a device-to-host copy on a GPU)."""
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, 6:] = 0
    m = H.opsadv_mask(batch_size=2, q_length=9, kv_length=9, mask_function=mu.causal_mask_function, device="cpu",
                      attention_mask=pad)
    kpm = H.causal_mask_of(m).key_padding

    def read_again(*a, **k):
        raise AssertionError("the mask's values were read again")
    monkeypatch.setattr(H.SparseLayout, "key_padding", read_again)
    lay = H._padding_layout(m, kpm, 9, 9, True)
    assert lay.key_padding_mask is kpm and lay.causal and lay.dense_blocks


def test_traced_padding_layout_resolves_like_the_eager_one(monkeypatch):
    """While tracing (no value read) the padding layout says dense_blocks as the eager one does, so a compiled call
    resolves in the eager call's bucket: the same kernel and tuned config the eager floor measured."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 6:] = False
    eager = H._padding_layout(torch.zeros(2, 1, 9, 9, dtype=torch.bool), pad, 9, 9, True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)      # as dynamo traces
    with FakeTensorMode() as mode:
        fpad = mode.from_tensor(pad)
        traced = H._padding_layout(torch.empty(2, 1, 9, 9, dtype=torch.bool), fpad, 9, 9, True,
                                   torch.ones(1, 1, 1, 1, dtype=torch.bool))
    assert eager.dense_blocks and traced.dense_blocks and traced.key_padding_mask is fpad


def test_causal_form_without_padding():
    kw = dict(batch_size=2, q_length=5, kv_length=5, mask_function=mu.causal_mask_function,
              attention_mask=torch.ones(2, 5, dtype=torch.long), device="cpu")
    assert H.opsadv_mask(**kw) is None             # plain causal: the attention's is_causal
    m = H.opsadv_mask(**{**kw, "allow_is_causal_skip": False})
    assert H.causal_mask_of(m) == (True, None, None, None, 0) and torch.equal(m, _sdpa(**kw))
    # chunked prefill over a cache without padding: causal bottom-right, never a crop of the keys
    kw2 = dict(batch_size=1, q_length=3, kv_length=8, q_offset=5, mask_function=mu.causal_mask_function,
               device="cpu")
    m2 = H.opsadv_mask(**kw2)
    assert H.causal_mask_of(m2) == (True, None, None, None, 0) and torch.equal(m2, _sdpa(**kw2))


@pytest.mark.parametrize("change", [dict(kv_offset=2), dict(q_offset=1), dict(local_size=4),
                                    dict(mask_function=mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=int)),
                                         local_size=3),
                                    dict(q_offset=torch.tensor(0))])
def test_other_masks_stay_transformers_masks(change):
    kw = dict(batch_size=2, q_length=6, kv_length=6, mask_function=mu.causal_mask_function,
              attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]), device="cpu", allow_is_causal_skip=False)
    kw.update(change)
    m = H.opsadv_mask(**kw)
    assert H.form_of(m) is None and torch.equal(m, mu.sdpa_mask(**kw))


# ---- a converted decoder -----------------------------------------------------------------------------------
def test_right_padded_forward_takes_the_key_padding_kernel(dispatch_calls):
    orig = llama()
    conv = convert(orig)
    ids, am, _ = batch(1)
    with torch.no_grad(), opsadv.trace() as t:
        want, got = orig(input_ids=ids, attention_mask=am).logits, conv(input_ids=ids, attention_mask=am).logits
    keep = am.bool()
    assert rel_err(got[keep], want[keep]) < 1e-5
    assert attention_impls(t) == {"reference.sparse_attention": 2}, str(t)
    specs = [s for s, _ in dispatch_calls if s.op == "sparse_attention"]
    assert specs and all({"causal", "key_padding"} <= s.features for s in specs)


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_padded_training_step_matches(left):
    orig = llama()
    conv = convert(orig)
    orig.train()
    conv.train()
    ids, am, labels = batch(2, pads=(0, 5, 12), left=left)
    want = step(orig, ids, am, labels)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels)
    assert attention_impls(t) == {"reference.sparse_attention": 4}, str(t)     # 2 layers, forward + backward
    assert_same_step(want, got)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_padded_training_step(monkeypatch, dynamic):
    """Under torch.compile the layout is built from the mask tensors, never their values (key_padding reads them);
    the backward is the sparse op's own."""
    orig = llama()
    conv = convert(orig)
    orig.train()
    conv.train()
    ids, am, labels = batch(3)
    want = step(orig, ids, am, labels)
    run = torch.compile(conv, backend="aot_eager", dynamic=dynamic)

    def no_value_read(*a, **k):
        raise AssertionError("a layout was built from mask values while tracing")
    monkeypatch.setattr(SparseLayout, "key_padding", no_value_read)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels, run)
    assert attention_impls(t) == {"reference.sparse_attention": 4}, str(t)
    assert_same_step(want, got)


def test_left_padded_generate_matches():
    orig = llama()
    conv = convert(orig)
    ids, am, _ = batch(4, s=11, pads=(0, 3, 6), left=True)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=7, do_sample=False, pad_token_id=0)
    want = orig.generate(**kw)
    with opsadv.trace() as t:
        got = conv.generate(**kw)
    assert torch.equal(got, want)
    # prefill and every decode step of both layers: causal + key padding (the padded prompt stays in the cache)
    assert attention_impls(t) == {"reference.sparse_attention": 2 * 7}, str(t)


def test_decode_step_logits_match():
    orig = llama()
    conv = convert(orig)
    ids, am, _ = batch(5, s=13, pads=(0, 4, 9), left=True)
    with torch.no_grad():
        pa, pb = orig(input_ids=ids, attention_mask=am, use_cache=True), conv(input_ids=ids, attention_mask=am,
                                                                              use_cache=True)
        nxt = torch.tensor([[5], [7], [11]])
        am2 = torch.cat([am, torch.ones(3, 1, dtype=am.dtype)], 1)
        a = orig(input_ids=nxt, attention_mask=am2, past_key_values=pa.past_key_values).logits
        b = conv(input_ids=nxt, attention_mask=am2, past_key_values=pb.past_key_values).logits
    assert rel_err(b, a) < 1e-5


def test_cuda_backend_in_the_interpreter():
    """The cuda backend's Triton sparse kernel (forward and backward) serves the padded training step (the
    Triton interpreter on CPU; attention in fp16 from fp32 inputs)."""
    orig = llama(layers=1, hidden=64, heads=4, kv=2)           # head_dim 16
    conv = convert(orig, backend="cuda", precision=PrecisionPolicy(attention="fp16"), opt_level=1, validate=False)
    orig.train()
    conv.train()
    ids, am, labels = batch(6, b=2, s=19, pads=(0, 7))
    want = step(orig, ids, am, labels)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels)
    assert attention_impls(t) == {"cuda.triton.sparse_attention": 2}, str(t)
    assert_same_step(want, got, tol=2e-2)


def test_a_layout_cached_under_inference_mode_serves_training(reference_backend):
    """Cached layouts (content-cached key padding, lru-cached constructors) made inside torch.inference_mode()
    hold normal tensors: a later training call saves them for its backward."""
    am = torch.tensor([[1] * 9 + [0] * 4, [1] * 13])
    with torch.inference_mode():
        first = SparseLayout.from_padding_mask(am, causal=True, block_size=16)
        varlen = SparseLayout.varlen([5, 8], causal=True, block_size=16)
    assert not first.key_padding_mask.is_inference() and not first.block_mask.is_inference()
    assert not varlen.cu_seqlens.is_inference()
    lay = SparseLayout.from_padding_mask(am, causal=True, block_size=16)
    assert lay is first                                            # the cached one
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 13, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    opsadv.ops.sparse_attention(q, k, v, lay).sum().backward()
    want = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=lay.dense_mask(), enable_gqa=True).sum(), (q, k, v))
    for t, w in zip((q, k, v), want):
        assert rel_err(t.grad, w) < 1e-10
