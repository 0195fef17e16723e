"""opsadv.PagedKVCache: a converted model's generate over the paged KV cache (paged_attention appends and attends)
gives transformers' own greedy tokens (DynamicCache, unconverted model) at float32, with per-step scores close;
batch 1 and a left-padded batch, pages of 8 and 16 tokens crossed by prompts and decode; crop / reset; refusals.  Beam search and batch expansion: test_paged_cache_beams.py."""
import copy
import inspect
import warnings

import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError

transformers = pytest.importorskip("transformers")
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig,  # noqa: E402
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

VOCAB = 97
NEW = 10
# transformers renamed generate's / forward's past_key_values to cache (newer than 5.17): pass what it takes
KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def build(arch, layers=2, **extra):
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, vocab_size=VOCAB,
                  max_position_embeddings=128, **extra)
    if arch == "llama":              # MHA
        model = LlamaForCausalLM(LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4))
    else:                            # qwen2: GQA 4 / 2, no sliding window
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2,
                                             use_sliding_window=False))
    return model.eval()


_models = {}


def models(arch):
    """(original, converted), built once per arch (the cache never changes the model)."""
    if arch not in _models:
        orig = build(arch)
        _models[arch] = orig, opsadv.convert_model(copy.deepcopy(orig), backend="reference", floor=False)
    return _models[arch]


def prompts(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "b1":
        ids = torch.randint(2, VOCAB, (1, 13), generator=g)
        return ids, torch.ones_like(ids)
    ids = torch.randint(2, VOCAB, (3, 13), generator=g)      # real lengths 13, 9, 6: left padded
    am = torch.ones_like(ids)
    am[1, :4] = 0
    am[2, :7] = 0
    return ids.masked_fill(am == 0, 0), am


def generate(model, ids, am, cache=None, new=NEW, **kw):
    extra = {} if cache is None else {KW: cache}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True, **extra, **kw)


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("kind", ["b1", "b3-left-padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_matches_transformers(arch, kind, page_size):
    orig, conv = models(arch)
    ids, am = prompts(kind)
    ref = generate(orig, ids, am, DynamicCache())
    cache = opsadv.PagedKVCache(conv, page_size=page_size, max_cache_len=64)
    out = generate(conv, ids, am, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == NEW
    for step, (a, b) in enumerate(zip(out.scores, ref.scores)):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item(), step
    layers = conv.config.num_hidden_layers
    # every layer's prefill and each decode step went through paged_attention (no other path served them)
    assert cache.calls == {"prefill": layers, "decode": layers * (NEW - 1)}
    real = am.sum(1) + NEW - 1                 # the last generated token is not fed back
    assert cache.lengths == real.tolist()
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1
    assert all(len(p) == -(-n // page_size) for p, n in zip(cache._pages, cache.lengths))   # pages as needed


def test_triton_kernel_serves_decode():
    """The Triton paged kernel (interpreted on CPU) under backend auto: the same tokens, and explain names it."""
    orig, _ = models("qwen2")
    conv = opsadv.convert_model(copy.deepcopy(orig), floor=False)
    ids, am = prompts("b3-left-padded")
    ref = generate(orig, ids, am, DynamicCache(), new=4)
    cache = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32)
    with opsadv.trace() as t:
        out = generate(conv, ids, am, cache, new=4)
    assert torch.equal(out.sequences, ref.sequences)
    served = {k: v for k, v in t.counts.items() if "paged_attention" in k}
    assert served and all("triton" in k for k in served), t.counts
    assert "triton" in cache.explain().chosen


def test_crop_and_reset():
    orig, conv = models("llama")
    ids, am = prompts("b3-left-padded")
    cache = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=64)
    ref = generate(conv, ids, am, cache)
    lens, seen = cache.lengths, cache.get_seq_length()
    cache.crop(0)                               # transformers calls crop(0) between steps: nothing removed
    assert cache.lengths == lens and cache.get_seq_length() == seen and cache.is_croppable
    cache.crop(-5)                              # the last 5 positions (all real): each sequence loses 5 tokens
    assert cache.lengths == [n - 5 for n in lens] and cache.get_seq_length() == seen - 5
    assert all(len(p) == -(-n // 8) for p, n in zip(cache._pages, cache.lengths))   # freed pages back in the pool
    # the cropped cache continues exactly like an uncropped one: feed the 5 dropped tokens again
    seq = ref.sequences
    full_am = torch.cat([am, torch.ones(3, seq.shape[1] - ids.shape[1], dtype=am.dtype)], 1)
    n0 = seen - 5
    pos = (full_am.cumsum(1) - 1)[:, n0:seen]
    with torch.no_grad():
        got = conv(input_ids=seq[:, n0:seen], attention_mask=full_am[:, :seen], position_ids=pos,
                   **{KW: cache}).logits[:, -1]
        want = orig(input_ids=seq[:, :seen], attention_mask=full_am[:, :seen]).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cache.crop(4)                               # transformers' older meaning: keep 4 positions
    assert cache.get_seq_length() == 4 and cache.lengths == full_am[:, :4].sum(1).tolist()
    with pytest.raises(InvalidArgumentError, match="crop"):
        cache.crop(-100)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.batch_size == -1 and len(cache._free) == cache.num_pages
    again = generate(conv, ids[:1], am[:1], cache)     # another batch size after a reset
    assert torch.equal(again.sequences, generate(orig, ids[:1], am[:1], DynamicCache()).sequences)


def test_static_pages():
    """static=True: fixed pages per sequence, decode lengths kept on the device (no host allocation)."""
    orig, conv = models("qwen2")
    ids, am = prompts("b3-left-padded")
    cache = opsadv.PagedKVCache(conv, page_size=16, max_cache_len=32, max_batch_size=3, static=True)
    assert cache.num_pages == 3 * 2 and not cache.is_compileable
    out = generate(conv, ids, am, cache)
    assert torch.equal(out.sequences, generate(orig, ids, am, DynamicCache()).sequences)
    assert cache._lens_dev.tolist() == cache.lengths == (am.sum(1) + NEW - 1).tolist()
    assert cache._table.tolist() == [[0, 1], [2, 3], [4, 5]]


# ---- refusals ------------------------------------------------------------------------------------------------------
def test_refuses_unconverted_and_other_attention():
    orig, conv = models("llama")
    with pytest.raises(InvalidArgumentError, match="converted with opsadv.convert_model"):
        opsadv.PagedKVCache(orig)
    other = copy.deepcopy(conv)
    other.set_attn_implementation("sdpa")
    with pytest.raises(InvalidArgumentError, match="'sdpa'"):
        opsadv.PagedKVCache(other)
    with pytest.raises(InvalidArgumentError, match="PreTrainedModel"):
        opsadv.PagedKVCache(torch.nn.Linear(2, 2))


def test_switched_attention_raises_instead_of_wrong_tokens():
    """A cache built for the converted model, the model then switched to sdpa: the first update refuses."""
    _, conv = models("llama")
    other = copy.deepcopy(conv)
    cache = opsadv.PagedKVCache(other, max_cache_len=64)
    other.set_attn_implementation("sdpa")
    ids, am = prompts("b1")
    with pytest.raises(RuntimeError, match="not 'opsadv'"):
        generate(other, ids, am, cache)
    with pytest.raises(RuntimeError, match="reset"):    # the partial step is not silently continued
        cache.get_mask_sizes(1, 0)
    cache.reset()
    cache.get_mask_sizes(1, 0)


def test_unconsumed_update_raises():
    """An update no opsadv attention consumed (another attention saw only the new tokens) raises at the next one."""
    _, conv = models("llama")
    cache = opsadv.PagedKVCache(conv, max_cache_len=64)
    k = torch.zeros(1, 4, 3, 16)
    cache.update(k, k, 0)
    with pytest.raises(RuntimeError, match="not consumed by opsadv's attention"):
        cache.update(k, k, 1)
    with pytest.raises(RuntimeError, match="reset"):
        cache.get_seq_length() or cache.get_mask_sizes(1, 0)


def test_refuses_sliding_window_and_softcap():
    torch.manual_seed(0)
    m = MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                         sliding_window=8)).eval()
    m = opsadv.convert_model(m, backend="reference", floor=False)
    with pytest.raises(InvalidArgumentError, match="sliding window"):
        opsadv.PagedKVCache(m)


def test_refuses_latent_attention():
    """DeepSeek-V2 / V3 (multi-head latent attention) update the cache with compressed latents, not keys and values:
    refused at construction; an update whose keys and values differ in head dim is refused before it is stored."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=VOCAB, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        kv_lora_rank=16, q_lora_rank=None, n_routed_experts=4, n_group=1, topk_group=1)).eval()
    m = opsadv.convert_model(m, backend="reference", floor=False)
    with pytest.raises(InvalidArgumentError, match="latent"):
        opsadv.PagedKVCache(m)
    orig, conv = models("llama")
    cache = opsadv.PagedKVCache(conv, max_cache_len=32)
    k = torch.randn(1, 4, 3, 16)
    with pytest.raises(InvalidArgumentError, match="one head dim"):
        cache.update(k, k[..., :8], 0)
    with pytest.raises(RuntimeError, match="reset"):
        cache.update(k, k, 0)


def test_refuses_pool_and_length():
    """(Beam search is served: tests/test_paged_cache_beams.py.)"""
    orig, conv = models("llama")
    ids, am = prompts("b1")
    with pytest.raises(InvalidArgumentError, match="num_pages"):
        generate(conv, ids, am, opsadv.PagedKVCache(conv, max_cache_len=64, page_size=8, num_pages=2))
    with pytest.raises(InvalidArgumentError, match="max_cache_len"):
        generate(conv, ids, am, opsadv.PagedKVCache(conv, max_cache_len=16))
    with pytest.raises(InvalidArgumentError, match="page_size"):
        opsadv.PagedKVCache(conv, page_size=12)


def test_refuses_dropout():
    orig = build("llama", attention_dropout=0.5)
    conv = opsadv.convert_model(orig, backend="reference", floor=False)
    cache = opsadv.PagedKVCache(conv, max_cache_len=64)
    conv.train()
    ids, _ = prompts("b1")
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match="dropout"):
        conv(input_ids=ids, **{KW: cache})
    conv.eval()
    with pytest.raises(InvalidArgumentError, match="does not require grad"):    # paged_attention is inference only
        conv(input_ids=ids, **{KW: opsadv.PagedKVCache(conv, max_cache_len=64)})


def test_static_decode_step_compiles_fullgraph():
    """A static cache's decode step traces as one graph (torch.compile fullgraph=True, eager backend) and gives the
    DynamicCache's logits over 6 positions with 2 compilations: transformers' mask sizing reads the cache's position
    count, dynamo specializes the first step on it and the second compiles it symbolic (automatic dynamic), after
    which no position recompiles."""
    orig, conv = models("qwen2")
    ids, _ = prompts("b3-left-padded")
    cache = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32, max_batch_size=3, static=True)
    dc = DynamicCache()
    torch._dynamo.reset()
    step = torch.compile(lambda tok, pos: conv(input_ids=tok, position_ids=pos, **{KW: cache}).logits[:, -1],
                         fullgraph=True, backend="eager")
    with torch.no_grad():
        got = conv(input_ids=ids, **{KW: cache}).logits[:, -1]
        want = orig(input_ids=ids, **{KW: dc}).logits[:, -1]
        from torch._dynamo.utils import counters
        counters.clear()
        for i in range(6):
            tok = want.argmax(-1, keepdim=True)
            pos = torch.full((3, 1), ids.shape[1] + i)
            got = step(tok, pos)
            want = orig(input_ids=tok, position_ids=pos, **{KW: dc}).logits[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert cache.lengths == [ids.shape[1] + 6] * 3 and cache.calls["decode"] == 0   # compiled calls are not counted


def test_compiled_forward_generates_with_a_static_cache_in_two_graphs():
    """torch.compile(model.forward) (fullgraph, eager backend) + PagedKVCache(static=True): generate's greedy tokens
    equal transformers' own, and 12 new tokens compile 2 graphs (prefill, decode): no position recompiles past the
    second step's symbolic one."""
    orig, conv = models("llama")
    ids = torch.randint(1, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    want = orig.generate(ids, max_new_tokens=12, do_sample=False)
    cache = opsadv.PagedKVCache(conv, max_cache_len=64, static=True, max_batch_size=1)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    try:
        conv.forward = torch.compile(conv.forward, backend="eager", fullgraph=True)    # (transformers' recipe)
        got = conv.generate(ids, max_new_tokens=12, do_sample=False, **{KW: cache})
    finally:
        del conv.forward                  # the class's forward again
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
