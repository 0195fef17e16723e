"""Sliding-window decoders in a converted model (Mistral, Qwen2 with use_sliding_window, Gemma-2/3 local layers):
the mask function recognises transformers' sliding-window causal call and hands over a causal + window form (the
values of transformers' sdpa mask; transformers' window w is window = w - 1 keys before the query), the attention
runs causal + window (+ key padding) sparse_attention, and a one-query decode step without padding the dense
kernel over the window's keys.  Other windowed masks (overlays, chunks, static caches) stay transformers'.
Compared with the unconverted model at real positions (float32 and float64)."""
import copy

import pytest
import torch

import opsadv
from opsadv.convert import hf_attention as H
from opsadv.core.precision import PrecisionPolicy
from opsadv.ops.sparse_attention.layout import SparseLayout

from conftest import rel_err

transformers = pytest.importorskip("transformers")
from transformers import (DynamicCache, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,  # noqa: E402
                          Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
from transformers import masking_utils as mu  # noqa: E402

VOCAB = 97
ARCHS = ["mistral", "qwen2", "gemma2"]


def build(arch, window, layers=2, hidden=48, heads=4, kv=2, dtype=torch.float32):
    """A tiny model and, per layer, whether it is a sliding-window layer."""
    torch.manual_seed(0)
    common = dict(hidden_size=hidden, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=VOCAB, max_position_embeddings=128, sliding_window=window)
    if arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    elif arch == "qwen2":            # layer 0 full, layer 1 sliding
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=1))
    elif arch == "gemma2":           # layer 0 sliding, layer 1 full; no softcapping (it has no opsadv kernel)
        hd = hidden // heads
        model = Gemma2ForCausalLM(Gemma2Config(**common, head_dim=hd, query_pre_attn_scalar=hd,
                                               attn_logit_softcapping=None, final_logit_softcapping=None))
    else:                            # gemma3 text: sliding, full, sliding ...
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=hidden // heads, sliding_window_pattern=2))
    lt = getattr(model.config, "layer_types", None) or ["sliding_attention"] * layers
    return model.to(dtype).eval(), [t == "sliding_attention" for t in lt]


def convert(orig, **kw):
    kw.setdefault("backend", "reference")
    return opsadv.convert_model(copy.deepcopy(orig), floor=False, **kw)


def batch(seed, b=3, s=13, pads=(0, 4, 7), left=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (b, s), generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    for i, p in enumerate(pads):
        if p and left:
            am[i, :p] = 0
        elif p:
            am[i, s - p:] = 0
    ids = ids.masked_fill(am == 0, 0)
    labels = ids.masked_fill(am == 0, -100)
    # left padding: the first real token's label is predicted from a padding position, whose output is undefined
    # (a query with no key in its window: Gemma-2's eager attention averages every key, sdpa and opsadv give 0)
    labels[:, 0] = labels[:, 0].masked_fill(am[:, 0] == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(am[:, :-1] == 0, -100)
    return ids, am, labels


class Calls(list):
    """What the converted attention asked of opsadv: (op, window left or None, masked, key padding, s_q, s_k)."""

    def windowed(self):
        return [c for c in self if c[1] is not None]


@pytest.fixture
def calls(monkeypatch):
    seen = Calls()
    seen.layouts = []
    flash, sparse = opsadv.ops.flash_attention, opsadv.ops.sparse_attention

    def spy_flash(q, k, v, **kw):
        seen.append(("flash", None, kw.get("attn_mask") is not None, False, q.shape[2], k.shape[2]))
        return flash(q, k, v, **kw)

    def spy_sparse(q, k, v, layout, **kw):
        seen.layouts.append(layout)
        seen.append(("sparse", layout.window_left if layout.window is not None else None, False,
                     layout.key_padding_mask is not None, q.shape[2], k.shape[2]))
        return sparse(q, k, v, layout, **kw)
    monkeypatch.setattr(opsadv.ops, "flash_attention", spy_flash)
    monkeypatch.setattr(opsadv.ops, "sparse_attention", spy_sparse)
    return seen


def attention_impls(t) -> dict:
    return {k: v for k, v in t.counts.items() if "attention" in k}


# ---- the mask function's window form ----------------------------------------------------------------------
def _kw(w, q_len, kv_len, q_off, kv_off, pad):
    return dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=q_off, kv_offset=kv_off, device="cpu",
                mask_function=mu.sliding_window_causal_mask_function(w), attention_mask=pad, local_size=w)


def _pad(total, left):
    pad = torch.ones(2, total, dtype=torch.bool)     # (as transformers passes it to the mask function)
    if left:
        pad[1, :3] = 0
    else:
        pad[1, total - 2:] = 0
    return pad


@pytest.mark.parametrize("w", [3, 5, 7])
@pytest.mark.parametrize("q_len,kv_len,q_off,kv_off", [(13, 13, 0, 0), (37, 37, 0, 0), (1, 13, 12, 0),
                                                       (3, 16, 13, 0), (1, 7, 20, 14), (4, 10, 8, 2)],
                         ids=["prefill13", "prefill37", "decode", "chunk", "sliding-cache", "sliding-chunk"])
@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_window_form_has_transformers_values(w, q_len, kv_len, q_off, kv_off, padding):
    """The form's values are transformers' sdpa mask's; its window (w - 1) with causal and the key padding, as a
    SparseLayout, allows exactly the same pairs (the boundary: a query sees itself and the w - 1 keys before it)."""
    pad = None if padding is None else _pad(kv_off + kv_len, padding == "left")
    kw = _kw(w, q_len, kv_len, q_off, kv_off, pad)
    want = mu.sdpa_mask(**{**kw, "allow_is_causal_skip": False})
    m = H.opsadv_mask(**kw)
    kpm = None if padding is None else pad[:, kv_off:kv_off + kv_len]
    if kpm is not None and bool(kpm.all()):  # the padding is out of these keys (a sliding cache moved past it)
        kpm = None
    if w >= kv_len and kpm is None:          # the window covers every key: plain causal (the attention's is_causal)
        assert m is None
        return
    assert torch.equal(m, want)
    f = H.causal_mask_of(m)
    assert f is not None and f.causal and H.key_padding_of(m) is None
    assert f.window == (w - 1 if w < kv_len else None)
    assert (f.key_padding is None) == (kpm is None) and (kpm is None or torch.equal(f.key_padding, kpm))
    lay = (SparseLayout.sliding_window(q_len, (w - 1, 0), seq_k=kv_len, causal=True, block_size=H.BLOCK)
           if f.window is not None else SparseLayout.dense(q_len, kv_len, causal=True, block_size=H.BLOCK))
    if kpm is not None:
        lay = lay.with_(key_padding_mask=kpm)
    assert torch.equal(lay.dense_mask().expand_as(want), want)
    if f.window is not None:                 # the window layout's block mask (the band allows)
        assert f.block_mask.shape == lay.block_mask.shape and not bool(f.block_mask.any())


@pytest.mark.parametrize("w,kv_len,window", [(13, 13, None), (16, 13, None), (12, 13, 11)])
def test_window_boundary_against_the_sequence(w, kv_len, window):
    """w >= the keys: plain causal (no padding: None, the attention's is_causal); one key less: a window."""
    kw = _kw(w, kv_len, kv_len, 0, 0, None)
    m = H.opsadv_mask(**kw)
    if window is None:
        assert m is None
        m = H.opsadv_mask(**{**kw, "allow_is_causal_skip": False})
        assert H.causal_mask_of(m) == (True, None, None, None, 0)
    else:
        assert H.causal_mask_of(m).window == window
    assert torch.equal(m, mu.sdpa_mask(**{**kw, "allow_is_causal_skip": False}))


def test_sliding_window_recognised_only_plain():
    assert H._sliding_window_of(mu.sliding_window_causal_mask_function(5)) == 5
    extra = mu.sliding_window_overlay(2)
    for fn in (mu.causal_mask_function, mu.and_masks(mu.sliding_window_causal_mask_function(5), extra),
               mu.or_masks(mu.sliding_window_causal_mask_function(5), extra),
               mu.chunked_causal_mask_function(5, torch.zeros(2, dtype=torch.long)),
               mu.sliding_window_bidirectional_mask_function(5), mu.and_masks(mu.causal_mask_function, extra)):
        assert H._sliding_window_of(fn) is None


@pytest.mark.parametrize("change", [
    dict(mask_function=mu.and_masks(mu.sliding_window_causal_mask_function(3), mu.sliding_window_overlay(2))),
    dict(q_offset=torch.tensor(0)),           # a static cache's tensor offset
    dict(q_offset=1),                         # queries not at the end of the keys
    dict(local_size=4)])                      # a local size that is not the window's
def test_other_window_masks_stay_transformers_masks(change):
    kw = {**_kw(3, 6, 6, 0, 0, torch.tensor([[1] * 6, [1] * 4 + [0] * 2])), "allow_is_causal_skip": False, **change}
    m = H.opsadv_mask(**kw)
    assert H.form_of(m) is None and torch.equal(m, mu.sdpa_mask(**kw))


@pytest.mark.parametrize("kind", ["sliding", "chunked", "packed"])
def test_mask_function_under_dynamo(kind):
    """fullgraph torch.compile through the mask function: the plain sliding window still gets its form; closures
    holding traced tensors (chunks' left padding, packed positions) are never made constants (no graph break)."""
    import torch._dynamo
    sliding, chunked = MistralConfig(sliding_window=3), MistralConfig(sliding_window=None)
    chunked.attention_chunk_size = 3

    def masks(am, pos):
        pad = am.bool()
        kw = dict(batch_size=2, q_length=6, kv_length=6, attention_mask=pad, local_size=3, config=sliding,
                  device="cpu")
        if kind == "chunked":
            kw.update(mask_function=mu.chunked_causal_mask_function(3, (am == 0).sum(-1)), config=chunked)
        elif kind == "packed":
            seq = mu.find_packed_sequence_indices(pos)
            kw.update(mask_function=mu.and_masks(mu.remap_positions_for_packed_sequence(
                mu.sliding_window_causal_mask_function(3), pos), mu.packed_sequence_mask_function(seq)),
                attention_mask=None, allow_is_causal_skip=False)
        else:
            kw.update(mask_function=mu.sliding_window_causal_mask_function(3))
        m = H.opsadv_mask(**kw)
        f = H.form_of(m)
        return m, -1 if f is None else f.window

    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    want = masks(am, pos)
    try:
        got = torch.compile(masks, fullgraph=True, backend="eager")(am, pos)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got[0], want[0]) and got[1] == want[1] == (2 if kind == "sliding" else -1)


# ---- converted models ---------------------------------------------------------------------------------------
def _expected(windowed_layers, w, s, padded):
    """Per layer: the window the attention must run with (None: plain causal), and whether sparse serves it."""
    out = []
    for win in windowed_layers:
        if win and w < s:
            out.append(("sparse", w - 1))
        else:
            out.append(("sparse" if padded else "flash", None))
    return out


@pytest.mark.parametrize("arch,w", [(a, w) for a in ARCHS for w in (3, 5, 7)] + [("gemma3", 5)])
def test_forward_matches_and_runs_window_kernels(arch, w, calls):
    orig, windowed = build(arch, w)
    conv = convert(orig)
    assert f"sliding-window layers (window {w})" in str(conv.opsadv_report)
    for s in (1, 13, 37):
        for padding in ((None,) if s == 1 else (None, "right", "left")):
            ids, am, _ = batch(s, s=s, pads=(0, s // 3, s // 2), left=padding == "left")
            if padding is None:
                am = torch.ones_like(am)
            calls.clear()
            with torch.no_grad(), opsadv.trace() as t:
                want = orig(input_ids=ids, attention_mask=am).logits
                got = conv(input_ids=ids, attention_mask=am).logits
            keep = am.bool()
            assert rel_err(got[keep], want[keep]) < 1e-5, (s, padding)
            ran = [(c[0], c[1]) for c in calls]
            assert ran == _expected(windowed, w, s, padding is not None), (s, padding, calls)
            assert not any(c[2] for c in calls), calls          # never the dense masked kernel
            n_sparse = sum(1 for r in ran if r[0] == "sparse")
            assert attention_impls(t).get("reference.sparse_attention", 0) == n_sparse, str(t)
    assert not conv._opsadv_state.fallbacks


def test_one_layout_per_forward_and_kind(calls):
    """Gemma-2's alternating local / global layers: each kind's layout is built once per forward and shared by its
    layers (the kernel's tile index with it); each layer gets its own kind's."""
    orig, windowed = build("gemma2", 5, layers=4)
    conv = convert(orig)
    ids, am, _ = batch(9, s=13, pads=(0, 4, 6))
    calls.clear()
    calls.layouts.clear()
    with torch.no_grad():
        conv(input_ids=ids, attention_mask=am)
    assert windowed == [True, False, True, False]
    assert [c[1] for c in calls] == [4, None, 4, None] and all(c[3] for c in calls), calls
    lay = calls.layouts
    assert lay[0] is lay[2] and lay[1] is lay[3] and lay[0] is not lay[1]
    assert lay[0].window == (4, 0) and lay[0].causal and lay[1].window is None and lay[1].causal


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_forward_float64(arch, calls):
    """float64 models (their RMSNorms compute in float32 in transformers: ~1e-7 apart; the attention alone is
    compared at 1e-12 below).  Gemma-2's own eager attention gives NaN in float64 with padding: not compared."""
    orig, windowed = build(arch, 5, dtype=torch.float64)
    conv = convert(orig)
    calls.clear()
    ids, am, _ = batch(7, s=37, pads=(0, 9, 20), left=True)
    with torch.no_grad():
        want, got = orig(input_ids=ids, attention_mask=am).logits, conv(input_ids=ids, attention_mask=am).logits
    keep = am.bool()
    assert rel_err(got[keep], want[keep]) < 1e-6
    assert len(calls.windowed()) == sum(windowed) and all(c[1] == 4 and c[3] for c in calls.windowed())


@pytest.mark.parametrize("q_len,kv_len,q_off,kv_off", [(37, 37, 0, 0), (1, 13, 12, 0), (3, 16, 13, 0), (1, 5, 20, 16),
                                                       (4, 8, 8, 4)],
                         ids=["prefill", "decode-trim", "chunk-trim", "sliding-cache", "sliding-chunk"])
@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_attention_float64_matches_the_masked_reference(q_len, kv_len, q_off, kv_off, padding, reference_backend,
                                                        calls):
    """The converted attention on our window form, forward and backward in float64, against torch's sdpa on
    transformers' mask (rows with no allowed key excluded: transformers' sdpa leaves them undefined)."""
    w = 5
    pad = None if padding is None else _pad(kv_off + kv_len, padding == "left")
    kw = _kw(w, q_len, kv_len, q_off, kv_off, pad)
    mask = H.opsadv_mask(**kw)
    dense = mu.sdpa_mask(**{**kw, "allow_is_causal_skip": False})
    g = torch.Generator().manual_seed(q_len * 100 + kv_len)
    q = torch.randn(2, 4, q_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, kv_len, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = H.opsadv_attention_forward(module, q, k, v, mask, scaling=0.25, sliding_window=w)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.25,
                                                           enable_gqa=True).transpose(1, 2)
    rows = dense.any(-1)[:, 0, :, None, None].expand_as(out)            # (b, s_q, h, d): rows with a key
    assert rel_err(out[rows], ref[rows]) < 1e-12
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64) * rows
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-12
    assert not any(c[2] for c in calls), calls                           # never the dense masked kernel
    (op, win, _, padded, s_q, s_k), = calls
    if w < kv_len:                           # sparse with the window over the keys it reaches; one query: flash
        assert s_k == min(kv_len, q_len + w - 1), calls
        assert (op, win) == ("sparse", w - 1) or (op == "flash" and q_len == 1), calls
    else:
        assert win is None and s_k == kv_len, calls


def step(model, ids, am, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(want, got, tol=1e-4):
    (wl, wg), (gl, gg) = want, got
    assert abs(wl.item() - gl.item()) <= tol * abs(wl.item())
    assert wg.keys() == gg.keys() and wg
    for n in wg:
        assert torch.isfinite(gg[n]).all(), n
        assert rel_err(gg[n], wg[n]) < tol, (n, rel_err(gg[n], wg[n]))


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("arch", ARCHS)
def test_training_step_matches(arch, padding, calls):
    orig, windowed = build(arch, 5)
    conv = convert(orig)
    calls.clear()
    orig.train()
    conv.train()
    ids, am, labels = batch(2, s=13, pads=(0, 3, 6), left=padding == "left")
    if padding is None:
        am, labels = torch.ones_like(am), ids.clone()
    want = step(orig, ids, am, labels)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels)
    assert [c[1] for c in calls.windowed()] == [4] * sum(windowed), calls
    assert not any(c[2] for c in calls), calls
    # forward and backward of each windowed layer (and of padded full layers)
    n_sparse = sum(1 for c in calls if c[0] == "sparse")
    assert attention_impls(t).get("reference.sparse_attention") == 2 * n_sparse, str(t)
    assert_same_step(want, got)


@pytest.mark.parametrize("cache", ["sliding", "full"])
@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_past_the_window(arch, padding, cache, calls):
    """generate() with a DynamicCache past the window gives the unconverted model's tokens: with the config's
    sliding layers (the cache keeps w - 1 keys) and without (a plain DynamicCache keeps every key: the attention
    trims them to the window's).  Decode steps without padding run the dense kernel over the last w keys."""
    w = 5
    orig, windowed = build(arch, w)
    conv = convert(orig)
    ids, am, _ = batch(4, s=11, pads=(0, 3, 6), left=True)
    if padding is None:
        am = torch.ones_like(am)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=9, do_sample=False, pad_token_id=0)
    make = (lambda m: {}) if cache == "sliding" else (lambda m: {"cache": DynamicCache()})
    want = orig.generate(**kw, **make(orig))
    calls.clear()
    got = conv.generate(**kw, **make(conv))
    assert torch.equal(got, want)
    assert not any(c[2] for c in calls), calls
    n = len(windowed)                         # one call per layer and forward: layer = call index mod n
    assert len(calls) == 9 * n and all(c[4] == 1 for c in calls[n:]), calls
    win_decode = [c for i, c in enumerate(calls[n:]) if windowed[i % n]]
    if padding is None:                       # one query, no padding: the dense kernel over at most the last w keys
        assert all(c[0] == "flash" and c[5] <= w for c in win_decode) and win_decode[-1][5] == w, win_decode
    else:                                     # past the window: the window's keys (and their padding) only
        assert all(c[5] <= w for c in win_decode) and win_decode[-1][5] == w, win_decode
    assert not conv._opsadv_state.fallbacks


@pytest.mark.parametrize("cache", ["sliding", "full"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_few_queries_after_the_window(padding, cache, calls):
    """A chunk of 3 queries over a cache past the window: causal + window sparse_attention over the window's keys."""
    orig, windowed = build("mistral", 5)
    conv = convert(orig)
    ids, am, _ = batch(5, s=13, pads=(0, 4, 9), left=True)
    if padding is None:
        am = torch.ones_like(am)
    nxt = torch.tensor([[5, 6, 7], [7, 8, 9], [11, 12, 13]])
    am2 = torch.cat([am, torch.ones(3, 3, dtype=am.dtype)], 1)
    out = []
    for m in (orig, conv):
        c = DynamicCache(config=m.config) if cache == "sliding" else DynamicCache()
        with torch.no_grad():
            m(input_ids=ids, attention_mask=am, cache=c, use_cache=True)
            calls.clear()
            out.append(m(input_ids=nxt, attention_mask=am2, cache=c).logits)
    assert rel_err(out[1], out[0]) < 1e-5
    assert [c[:3] + c[4:] for c in calls] == [("sparse", 4, False, 3, 7)] * 2, calls


@pytest.mark.parametrize("w", [13, 16])
def test_window_at_least_the_sequence_is_plain_causal(w, calls):
    orig, _ = build("mistral", w)
    conv = convert(orig)
    ids, am, labels = batch(6, s=13, pads=(0, 4, 7))
    for mask in (am, torch.ones_like(am)):
        calls.clear()
        with torch.no_grad():
            want, got = orig(input_ids=ids, attention_mask=mask).logits, conv(input_ids=ids, attention_mask=mask).logits
        keep = mask.bool()
        assert rel_err(got[keep], want[keep]) < 1e-5
        padded = not bool(mask.all())
        assert calls == [("sparse" if padded else "flash", None, False, padded, 13, 13)] * 2, calls


def test_static_cache_keeps_transformers_mask_and_says_so(monkeypatch):
    """A static cache's tensor offset: transformers' window mask and the dense masked kernel (correct), counted."""
    monkeypatch.setattr(H, "_warned", set())
    orig, _ = build("mistral", 5)
    conv = convert(orig)
    ids, am, _ = batch(8, s=11, pads=(0, 3, 6), left=True)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    want = orig.generate(**kw)
    with pytest.warns(RuntimeWarning, match="sliding window with transformers' mask"):
        got = conv.generate(**kw)
    assert torch.equal(got, want)
    assert conv._opsadv_state.fallbacks.get(H.WINDOW_MASK_NOTE, 0) > 0, conv._opsadv_state.fallbacks


def test_compiled_padded_training_step(monkeypatch):
    """torch.compile: the window layout is built from the mask tensors (no value read), the backward is the sparse
    op's own; loss and gradients as the unconverted model's."""
    import torch._dynamo
    orig, _ = build("mistral", 5)
    conv = convert(orig)
    orig.train()
    conv.train()
    ids, am, labels = batch(3, s=13)
    want = step(orig, ids, am, labels)

    def no_value_read(*a, **k):
        raise AssertionError("a layout was built from mask values while tracing")
    monkeypatch.setattr(SparseLayout, "key_padding", no_value_read)
    monkeypatch.setattr(SparseLayout, "sliding_window", no_value_read)
    try:
        run = torch.compile(conv, backend="aot_eager", fullgraph=True)
        with opsadv.trace() as t:
            conv.zero_grad(set_to_none=True)
            loss = run(input_ids=ids, attention_mask=am, labels=labels).loss
            loss.backward()
    finally:
        torch._dynamo.reset()
    got = (loss.detach(), {n: p.grad.detach().clone() for n, p in conv.named_parameters() if p.grad is not None})
    assert attention_impls(t) == {"reference.sparse_attention": 4}, str(t)
    assert_same_step(want, got)


def test_export_with_symbolic_lengths_keeps_transformers_mask(tmp_path, reference_backend):
    """An export with dynamic batch and sequence: a window layout takes int lengths, so the program keeps
    transformers' window mask (the masked dense kernel) and is right at every length."""
    m, _ = build("mistral", 5)
    orig = copy.deepcopy(m)
    opsadv.Optimizer(device="cpu", floor=False).export(m, tmp_path / "m.pt2")
    assert "input_ids dim 1" in m.opsadv_report.notes[-1]
    mod = opsadv.load(tmp_path / "m.pt2")
    for b, s in ((3, 7), (1, 37)):
        ids, am, _ = batch(s, b=b, s=s, pads=(0, 2, 3)[:b])
        with torch.no_grad():
            want = orig(input_ids=ids, attention_mask=am).logits
        with opsadv.trace() as t:
            got = mod(input_ids=ids, attention_mask=am)["logits"]
        keep = am.bool()
        assert rel_err(got[keep], want[keep]) < 1e-5
        assert attention_impls(t) == {"reference.flash_attention": 2}, str(t)


def test_cuda_backend_in_the_interpreter():
    """The cuda backend's Triton sparse kernel serves the windowed training step, forward and backward (the Triton
    interpreter on CPU; attention in fp16 from fp32 inputs)."""
    orig, _ = build("mistral", 5, layers=1, hidden=64, heads=4, kv=2)          # head_dim 16
    conv = convert(orig, backend="cuda", precision=PrecisionPolicy(attention="fp16"), opt_level=1, validate=False)
    orig.train()
    conv.train()
    ids, am, labels = batch(6, b=2, s=19, pads=(0, 7), left=True)
    want = step(orig, ids, am, labels)
    with opsadv.trace() as t:
        got = step(conv, ids, am, labels)
    assert attention_impls(t) == {"cuda.triton.sparse_attention": 2}, str(t)
    assert_same_step(want, got, tol=2e-2)
