"""CUDA-graph replay of decode steps over a transformers StaticCache (opsadv.runtime.graphs): the
cache is keyed by identity and updated in place by each replay; the warm-up's advances of its write
position are undone; a growing DynamicCache is refused with the reason.  The CUDA graph API is
emulated on CPU (tests/fake_cuda_graphs.py)."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError
from opsadv.runtime import graphs

from fake_cuda_graphs import install, recording

tf = pytest.importorskip("transformers")


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    install(monkeypatch)


def _llama():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(cfg).eval(), cfg


def _cache_kw(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _runner(monkeypatch, model):
    r = graphs.CudaGraphRunner(recording(model.forward), device="cuda", module=model)
    monkeypatch.setattr(r, "_check_devices", lambda tensors: None)
    return r


def test_decode_steps_replay_over_a_static_cache(fake_cuda_graphs, monkeypatch, reference_backend):
    base, cfg = _llama()
    conv = opsadv.convert_model(copy.deepcopy(base), validate=False)
    key = _cache_kw(base)
    caches = {n: tf.StaticCache(config=cfg, max_cache_len=24) for n in ("base", "conv")}
    prompt = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    r = _runner(monkeypatch, conv)
    with torch.no_grad():
        lb = base(input_ids=prompt, use_cache=True, **{key: caches["base"]}).logits[:, -1]
        lc = conv(input_ids=prompt, use_cache=True, **{key: caches["conv"]}).logits[:, -1]
        torch.testing.assert_close(lc, lb, rtol=1e-4, atol=1e-4)
        for step in range(5):
            tok = lb.argmax(-1, keepdim=True)                     # greedy: both follow the base model's tokens
            lb = base(input_ids=tok, use_cache=True, **{key: caches["base"]}).logits[:, -1]
            out = r(input_ids=tok, use_cache=True, **{key: caches["conv"]})
            torch.testing.assert_close(out.logits[:, -1], lb, rtol=1e-4, atol=1e-4, msg=f"step {step}")
            assert int(caches["conv"].get_seq_length()) == int(caches["base"].get_seq_length()) == 8 + step
    assert r.stats.captures == 1 and r.stats.replays == 5       # one graph for every decode step
    (g,) = r.graphs.values()
    assert g.states == [caches["conv"]]


def test_generate_with_a_static_cache_replays_two_graphs(fake_cuda_graphs, monkeypatch, reference_backend):
    """model.generate(..., cache_implementation="static") through the runner: the prefill (which also
    initializes the cache lazily inside the warm-up) and every decode step (transformers passes a fixed-shape
    4-D mask with a static cache) are two graphs; the tokens are the original model's.  A prompt + new
    tokens that exactly fill the cache fail if warm-ups advanced the write position."""
    base, cfg = _llama()
    conv = opsadv.convert_model(copy.deepcopy(base), validate=False)
    r = _runner(monkeypatch, conv)
    monkeypatch.setattr(conv, "forward", graphs.GraphedForward(r))
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", attention_mask=torch.ones_like(prompt),
              pad_token_id=0)
    with torch.no_grad():
        want = base.generate(prompt, **kw)
        got = conv.generate(prompt, **kw)
    assert torch.equal(got, want)
    assert r.stats.captures == 2 and r.stats.replays == 6


def test_warmup_advances_of_the_cache_position_are_undone(fake_cuda_graphs, monkeypatch, reference_backend):
    """Without the restore the first replay would write at position p + warm-ups + 1: the test fails
    if _capture stops putting the counters back."""
    base, cfg = _llama()
    key = _cache_kw(base)
    cache = tf.StaticCache(config=cfg, max_cache_len=16)
    with torch.no_grad():
        base(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=True, **{key: cache})
        r = _runner(monkeypatch, base)
        r(input_ids=torch.ones(1, 1, dtype=torch.long), use_cache=True, **{key: cache})
    assert int(cache.get_seq_length()) == 4
    counters = graphs.small_state(cache)
    assert counters and all(t.numel() <= graphs.SMALL_STATE_NUMEL for t in counters)


def test_growing_cache_is_refused_with_the_reason(fake_cuda_graphs, monkeypatch):
    base, cfg = _llama()
    key = _cache_kw(base)
    r = _runner(monkeypatch, base)
    with torch.no_grad():
        dyn = base(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=True).past_key_values
        with pytest.raises(InvalidArgumentError, match="StaticCache"):
            r(input_ids=torch.ones(1, 1, dtype=torch.long), use_cache=True, **{key: dyn})
    assert graphs.is_static_state(tf.StaticCache(config=cfg, max_cache_len=8)) and not graphs.is_static_state(dyn)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real graph capture)")
def test_graphed_decode_on_gpu_matches_eager():
    """Real capture and replay: convert_model(cuda_graphs=True), decode steps over a StaticCache vs the
    original model eager on its own StaticCache (greedy tokens of the original), poisoned-free check of
    every step's logits; one graph per signature (prefill, decode)."""
    base, cfg = _llama()
    base = base.to("cuda", torch.float16)
    conv = opsadv.convert_model(copy.deepcopy(base), cuda_graphs=True, validate=False)
    key = _cache_kw(base)
    caches = {n: tf.StaticCache(config=cfg, max_cache_len=40) for n in ("base", "conv")}
    prompt = torch.randint(0, cfg.vocab_size, (3, 9), device="cuda")
    with torch.no_grad():
        lb = base(input_ids=prompt, use_cache=True, **{key: caches["base"]}).logits[:, -1].float()
        lc = conv(input_ids=prompt, use_cache=True, **{key: caches["conv"]}).logits[:, -1].float()
        assert torch.isfinite(lc).all() and (lc - lb).norm() / lb.norm() < 2e-2
        for step in range(6):
            tok = lb.argmax(-1, keepdim=True)
            lb = base(input_ids=tok, use_cache=True, **{key: caches["base"]}).logits[:, -1].float()
            lc = conv(input_ids=tok, use_cache=True, **{key: caches["conv"]}).logits[:, -1].float()
            assert torch.isfinite(lc).all() and (lc - lb).norm() / lb.norm() < 2e-2, step
    stats = conv.opsadv_graphs.stats
    assert stats.captures == 2 and stats.replays == 7


def test_e2e_static_case_compares_at_one_cache_position(monkeypatch, reference_backend):
    """The e2e case "decode ... static graphs": its contenders have run different numbers of steps when the
    runner compares them, so the case compares one step of each at the same (rewound) position. On the
    H200 at 5a4f399 the runner's own compare gave rel err 1.1 (positions differed). Tiny Llama on CPU,
    converted without cuda_graphs (the runner is covered above); fails without the case's compare."""
    from opsadv.bench import runner, suite_e2e as E
    monkeypatch.setattr(E, "LLAMA", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, vocab_size=101,
                                          max_position_embeddings=64))
    monkeypatch.setattr(E, "DECODE", (2, 9))
    monkeypatch.setattr(E, "STATIC_SLOTS", 6)
    real_convert = E._convert
    monkeypatch.setattr(E, "_convert", lambda base, extra, tune_kw, **o: real_convert(base, extra, tune_kw))
    case = E._llama_decode_static(True, "cpu")
    case.setup()
    for _ in range(3):                 # the contenders drift apart, as in timing
        case.opsadv()
    case.peers["hf_sdpa"]()
    assert runner.rel_err(case.opsadv(), case.peers["hf_sdpa"]()) > 0.05     # different positions
    assert case.compare(None, None) < 2e-2
    E._free()
