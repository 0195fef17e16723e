"""CUDA-graph replay of decode steps over a static opsadv.PagedKVCache (runtime/graphs.py's graph-state protocol,
convert/paged_cache.py's graph_step): prefill eager, one graph for every decode step, tokens and step scores equal to
the eager paged path and to transformers' DynamicCache at float32 (b1, a left-padded b3, pages crossed by decode);
lengths advance once per step; refusals.  The CUDA graph API is emulated on CPU and the emulation is strict about
what a replay does: it re-runs the captured call with the Python state of the capture (the cache's host counters as
they were then; only device tensors are live), and the forward takes its capture-time paths (no host reads) at
capture and replay, so a position baked into the graph or a host counter a replay skips gives wrong tokens here."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import opsadv
from opsadv.convert import hf_attention
from opsadv.core.errors import InvalidArgumentError
from opsadv.runtime import graphs

from fake_cuda_graphs import FakeGraph, install, recording

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from test_paged_cache import KW, VOCAB, build, models, prompts  # noqa: E402  (the same tiny models and prompts)

NEW = 10


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    install(monkeypatch)
    # capture (and so replay) takes the forward's no-host-read paths, as on a GPU
    monkeypatch.setattr(hf_attention, "capturing",
                        lambda t: t is not None and (FakeGraph.active is not None or FakeGraph.replaying))


def graphed(monkeypatch, model):
    """model.forward replaced by a CudaGraphRunner over the eager forward (what convert_model(cuda_graphs=True)
    installs on a GPU)."""
    r = graphs.CudaGraphRunner(recording(model.forward), device="cuda", module=model)
    monkeypatch.setattr(r, "_check_devices", lambda tensors: None)
    monkeypatch.setattr(model, "forward", graphs.GraphedForward(r))
    return r


def generate(model, ids, am, cache, new=NEW):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True, **{KW: cache})


def static_cache(conv, batch):
    # pages of 8: 13-token prompts and 10 new tokens cross a page boundary in decode
    return opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32, max_batch_size=batch, static=True)


def close(a, b):
    return (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


# ---- tests ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["b1", "b3-left-padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_graphed_generate_matches_eager_and_transformers(fake_cuda_graphs, monkeypatch, arch, kind):
    orig, conv = models(arch)
    ids, am = prompts(kind)
    ref = generate(orig, ids, am, DynamicCache())
    eager_cache = static_cache(conv, ids.shape[0])
    eager = generate(conv, ids, am, eager_cache)
    g = copy.copy(conv)                       # the same modules; its own forward attribute
    r = graphed(monkeypatch, g)
    cache = static_cache(g, ids.shape[0])
    out = generate(g, ids, am, cache)
    assert torch.equal(out.sequences, eager.sequences) and torch.equal(out.sequences, ref.sequences)
    for step, (a, b, c) in enumerate(zip(out.scores, eager.scores, ref.scores)):
        assert close(a, b) and close(a, c), step
    # prefill eager, the first decode step captured, every decode step (the first included) a replay
    assert (r.stats.eager, r.stats.captures, r.stats.replays) == (1, 1, NEW - 1)
    assert cache.calls == eager_cache.calls == {"prefill": 2, "decode": 2 * (NEW - 1)}
    assert cache.lengths == eager_cache.lengths == (am.sum(1) + NEW - 1).tolist()
    assert cache.get_seq_length() == eager_cache.get_seq_length() == ids.shape[1] + NEW - 1
    # generate again after reset: the same buffers, so the same graph replays (nothing captured)
    cache.reset()
    again = generate(g, ids, am, cache)
    assert torch.equal(again.sequences, ref.sequences)
    assert (r.stats.eager, r.stats.captures, r.stats.replays) == (2, 1, 2 * (NEW - 1))


def test_manual_steps_advance_lengths_once(fake_cuda_graphs, monkeypatch):
    """Decode steps called by hand (a padded batch, explicit positions): each graphed step advances every
    sequence's length exactly once (warm-ups and the capture are undone) and gives the DynamicCache's logits."""
    orig, conv = models("qwen2")
    g = copy.copy(conv)
    r = graphed(monkeypatch, g)
    ids, am = prompts("b3-left-padded")
    cache = static_cache(g, 3)
    dc = DynamicCache()
    pos = (am.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        got = g(input_ids=ids, attention_mask=am, position_ids=pos, **{KW: cache}).logits[:, -1]
        want = orig(input_ids=ids, attention_mask=am, position_ids=pos, **{KW: dc}).logits[:, -1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        lens = am.sum(1)
        for i in range(4):
            tok = want.argmax(-1, keepdim=True)
            am = torch.cat([am, torch.ones(3, 1, dtype=am.dtype)], 1)
            p = pos[:, -1:] + 1 + i
            got = g(input_ids=tok, attention_mask=am, position_ids=p, **{KW: cache}).logits[:, -1]
            want = orig(input_ids=tok, attention_mask=am, position_ids=p, **{KW: dc}).logits[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"step {i}")
            assert cache.lengths == (lens + i + 1).tolist() and cache.get_seq_length() == ids.shape[1] + i + 1
    assert (r.stats.captures, r.stats.replays) == (1, 4)
    assert cache.calls["decode"] == 2 * 4


def test_crop_after_graphed_padded_decode(fake_cuda_graphs, monkeypatch):
    """The replays' host record of the padding (crop's) equals the eager path's: crop gives the same lengths."""
    _, conv = models("llama")
    ids, am = prompts("b3-left-padded")
    eager_cache = static_cache(conv, 3)
    generate(conv, ids, am, eager_cache)
    g = copy.copy(conv)
    graphed(monkeypatch, g)
    cache = static_cache(g, 3)
    generate(g, ids, am, cache)
    for c in (cache, eager_cache):
        c.crop(-12)                             # back into the prompt: the padding record decides the lengths
    assert cache.lengths == eager_cache.lengths == am[:, :ids.shape[1] + NEW - 1 - 12].sum(1).tolist()


@pytest.mark.parametrize("graphed_steps", [False, True])
def test_padding_token_in_a_static_decode_step(fake_cuda_graphs, monkeypatch, graphed_steps):
    """A decode step whose new token is padding for one row (device-side path of a static cache, eager or
    replayed: that row appends nothing and its attention output is 0) equals the paged (non-static) cache's
    host-side packed path on every row, and transformers' DynamicCache on the real rows; the next step and crop's
    lengths after it too."""
    orig, conv = models("llama")
    ids, am = prompts("b3-left-padded")
    g = copy.copy(conv)
    if graphed_steps:
        graphed(monkeypatch, g)
    cache = static_cache(g, 3)
    paged = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32)
    dc = DynamicCache()
    pos = (am.cumsum(1) - 1).clamp(min=0)

    def step(tok, mask, p):
        got = g(input_ids=tok, attention_mask=mask, position_ids=p, **{KW: cache}).logits[:, -1]
        host = conv(input_ids=tok, attention_mask=mask, position_ids=p, **{KW: paged}).logits[:, -1]
        want = orig(input_ids=tok, attention_mask=mask, position_ids=p, **{KW: dc}).logits[:, -1]
        return got, host, want
    with torch.no_grad():
        step(ids, am, pos)
        tok = torch.tensor([[5], [6], [7]])
        am2 = torch.cat([am, torch.tensor([[1], [0], [1]])], 1)
        got, host, want = step(tok, am2, pos[:, -1:] + 1)
        torch.testing.assert_close(got, host, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[[0, 2]], want[[0, 2]], rtol=1e-4, atol=1e-5)
        assert cache.lengths == paged.lengths == (am.sum(1) + torch.tensor([1, 0, 1])).tolist()
        am3 = torch.cat([am2, torch.ones(3, 1, dtype=am.dtype)], 1)
        got, host, want = step(tok, am3, pos[:, -1:] + 2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, host, rtol=1e-4, atol=1e-5)
    for c in (cache, paged):
        c.crop(-1)                              # back past the last step: the padding step's record decides
    assert cache.lengths == paged.lengths == (am.sum(1) + torch.tensor([1, 0, 1])).tolist()


def test_refusals(fake_cuda_graphs, monkeypatch):
    _, conv = models("llama")
    g = copy.copy(conv)
    graphed(monkeypatch, g)
    ids, am = prompts("b1")
    with pytest.raises(InvalidArgumentError, match="static=True") as e:
        generate(g, ids, am, opsadv.PagedKVCache(g, page_size=8, max_cache_len=32))
    assert "cuda_graphs" in str(e.value) and "cache" in str(e.value)
    cache = static_cache(g, 1)
    with torch.no_grad():
        g(input_ids=ids, **{KW: cache})        # prefill (eager)
        with pytest.raises(InvalidArgumentError, match="position_ids"):
            g(input_ids=ids[:, :1], **{KW: cache})
        with pytest.raises(InvalidArgumentError, match="attention_mask"):
            g(input_ids=ids[:, :1], attention_mask=torch.ones(1, 3, dtype=torch.long),
              position_ids=torch.tensor([[13]]), **{KW: cache})
        assert cache.lengths == [13]            # nothing ran
    full = static_cache(g, 1)
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match="max_cache_len"):
        g(input_ids=torch.randint(2, VOCAB, (1, 32)), **{KW: full})
        g(input_ids=ids[:, :1], position_ids=torch.tensor([[32]]), **{KW: full})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real graph capture)")
@pytest.mark.parametrize("kind", ["b1", "b3-left-padded"])
def test_graphed_paged_generate_on_gpu_matches_eager(kind):
    """Real capture and replay: convert_model(cuda_graphs=True) + PagedKVCache(static=True) generate against the
    same converted model's eager forward over its own static cache (the runner removed): equal tokens, and equal to
    the unconverted model's DynamicCache tokens at float32; prefill eager, one graph for every decode step."""
    orig = build("qwen2").to("cuda")
    conv = opsadv.convert_model(copy.deepcopy(orig), cuda_graphs=True, validate=False)
    ids, am = (t.to("cuda") for t in prompts(kind))
    cache = opsadv.PagedKVCache(conv, page_size=16, max_cache_len=64, max_batch_size=ids.shape[0], static=True)
    out = generate(conv, ids, am, cache, new=24)           # 13 + 24 crosses the 16-token pages in decode
    stats = conv.opsadv_graphs.stats
    assert (stats.eager, stats.captures, stats.replays) == (1, 1, 23)
    eager_model = copy.copy(conv)
    eager_model.__dict__.pop("forward")                    # the eager forward of the same modules
    eager_cache = opsadv.PagedKVCache(eager_model, page_size=16, max_cache_len=64, max_batch_size=ids.shape[0],
                                      static=True)
    eager = generate(eager_model, ids, am, eager_cache, new=24)
    assert torch.equal(out.sequences, eager.sequences)
    assert torch.equal(out.sequences, generate(orig, ids, am, DynamicCache(), new=24).sequences)
    for a, b in zip(out.scores, eager.scores):
        assert torch.isfinite(a).all() and close(a, b)
    assert cache.lengths == eager_cache.lengths and cache.calls == eager_cache.calls
