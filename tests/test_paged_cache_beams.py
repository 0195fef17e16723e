"""opsadv.PagedKVCache under beam search and batch expansion: generate(num_beams=k) (also num_return_sequences) and
sampling with num_return_sequences give transformers' own tokens (DynamicCache, unconverted model) at float32; beams
share pages (refcounted, copy-on-write of a shared partly filled last page) and the pool never leaks: during
generation the pages held are exactly those the live beams need, after generate + reset every page is free."""
import copy
import warnings

import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError

pytest.importorskip("transformers")
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList  # noqa: E402

from test_paged_cache import KW, models, prompts  # noqa: E402

NEW = 10


def generate(model, ids, am, cache, new=NEW, **kw):
    kw.setdefault("do_sample", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, pad_token_id=0,
                              return_dict_in_generate=True, **{KW: cache}, **kw)


def pool_state(cache) -> int:
    """Asserts the pool's bookkeeping: the pages held are exactly the live sequences' pages (each sequence holding
    ceil(length / page_size)), the rest free, refcounts the sharing counts, table rows the pages.  Returns how many
    page holdings sharing saved (sum of per-sequence pages - distinct pages held)."""
    held = {}
    for b, (row, n) in enumerate(zip(cache._pages, cache.lengths)):
        assert len(row) == -(-n // cache.page_size), (b, row, n)
        assert cache._table[b, :len(row)].tolist() == row
        for p in row:
            held[p] = held.get(p, 0) + 1
    assert sorted(list(held) + cache._free) == list(range(cache.num_pages))     # no page lost, none twice
    assert cache._refs == {p: n for p, n in held.items() if n > 1}
    return sum(held.values()) - len(held)


class PoolCheck(LogitsProcessor):
    """Checks the pool after every forward of generate (the beams' appends done, before the reorder)."""

    def __init__(self, cache):
        self.cache, self.saved = cache, []

    def __call__(self, input_ids, scores):
        self.saved.append(pool_state(self.cache))
        return scores


@pytest.mark.parametrize("arch,kind,num_beams,num_return,page_size", [
    ("llama", "b1", 2, 1, 8),
    ("llama", "b3-left-padded", 3, 2, 16),
    ("qwen2", "b1", 3, 2, 16),
    ("qwen2", "b3-left-padded", 2, 1, 8),
    ("qwen2", "b3-left-padded", 3, 1, 8),
])
def test_beam_search_matches_transformers(arch, kind, num_beams, num_return, page_size):
    orig, conv = models(arch)
    ids, am = prompts(kind)
    beams = dict(num_beams=num_beams, num_return_sequences=num_return, output_scores=True)
    ref = generate(orig, ids, am, DynamicCache(), **beams)
    cache = opsadv.PagedKVCache(conv, page_size=page_size, max_cache_len=64)
    check = PoolCheck(cache)
    out = generate(conv, ids, am, cache, logits_processor=LogitsProcessorList([check]), **beams)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-5, atol=1e-5)
    assert len(check.saved) == NEW and max(check.saved) > 0            # beams shared pages
    pool_state(cache)
    assert cache.batch_size == ids.shape[0] * num_beams
    cache.reset()
    assert len(cache._free) == cache.num_pages and cache._refs == {}


def test_sampling_with_num_return_sequences():
    """do_sample with num_return_sequences > 1: generate expands the prompt before prefill; the same draws."""
    orig, conv = models("qwen2")
    ids, am = prompts("b3-left-padded")
    torch.manual_seed(0)
    ref = generate(orig, ids, am, DynamicCache(), do_sample=True, num_return_sequences=3)
    cache = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32)
    torch.manual_seed(0)
    out = generate(conv, ids, am, cache, do_sample=True, num_return_sequences=3)
    assert torch.equal(out.sequences, ref.sequences)
    assert cache.lengths == (am.sum(1).repeat_interleave(3) + NEW - 1).tolist()


def test_static_beam_search():
    """static=True: reorder copies the selected sequences' used pages into the fixed runs (no sharing)."""
    orig, conv = models("qwen2")
    ids, am = prompts("b3-left-padded")
    beams = dict(num_beams=3, num_return_sequences=2)
    ref = generate(orig, ids, am, DynamicCache(), **beams)
    cache = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32, max_batch_size=9, static=True)
    out = generate(conv, ids, am, cache, **beams)
    assert torch.equal(out.sequences, ref.sequences)
    assert cache._table.tolist() == [[4 * i + j for j in range(4)] for i in range(9)] and cache._free == []
    with pytest.raises(InvalidArgumentError, match="max_batch_size"):
        generate(conv, ids, am, opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32, max_batch_size=3,
                                                    static=True), **beams)


@pytest.mark.parametrize("static", [False, True])
def test_repeat_interleave_and_select_indices(static):
    """Expand after prefill (the prompt's pages shared, nothing copied), then select and reorder sequences; each
    step's logits equal a DynamicCache doing the same (transformers' own batch_repeat_interleave / select)."""
    orig, conv = models("llama")
    ids, am = prompts("b3-left-padded")
    ids, am = ids[1:], am[1:]                       # real lengths 9 and 6: the last pages partly filled
    cache = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32, max_batch_size=6 if static else None,
                                num_pages=None if static else 12, static=static)
    dc = DynamicCache()
    with torch.no_grad():
        got = conv(input_ids=ids, attention_mask=am, **{KW: cache}).logits[:, -1]
        want = orig(input_ids=ids, attention_mask=am, **{KW: dc}).logits[:, -1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        held = cache.num_pages - len(cache._free)
        cache.batch_repeat_interleave(3)
        dc.batch_repeat_interleave(3)
        am = am.repeat_interleave(3, 0)
        if not static:
            assert cache.num_pages - len(cache._free) == held and pool_state(cache) == 2 * held   # shared, not copied
        steps = [None, torch.tensor([5, 0, 3, 3]), torch.tensor([True, False, True, True]), torch.tensor([2, 0, 1])]
        for i, select in enumerate(steps):
            if select is not None:
                cache.batch_select_indices(select)
                dc.batch_select_indices(select)
                am = am[select]
            b = am.shape[0]
            tok = torch.arange(b).view(b, 1) + 2 + i  # each sequence its own token: copies diverge
            am = torch.cat([am, torch.ones(b, 1, dtype=am.dtype)], 1)
            pos = am.sum(1, keepdim=True) - 1
            got = conv(input_ids=tok, attention_mask=am, position_ids=pos, **{KW: cache}).logits[:, -1]
            want = orig(input_ids=tok, attention_mask=am, position_ids=pos, **{KW: dc}).logits[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            if not static:
                pool_state(cache)
    assert cache.lengths == (am.sum(1)).tolist()
    cache.crop(-2)                                  # crop releases shared pages through their refcounts
    if not static:
        pool_state(cache)
    with pytest.raises(InvalidArgumentError, match="indices"):
        cache.batch_select_indices(torch.tensor([3]))
    with pytest.raises(InvalidArgumentError, match="repeats"):
        cache.batch_repeat_interleave(0)
    cache.reset()
    assert len(cache._free) == cache.num_pages


def test_triton_kernel_serves_beam_search():
    """The Triton paged kernel (interpreted on CPU) under backend auto: the beams' tokens, and explain names it."""
    orig, _ = models("qwen2")
    conv = opsadv.convert_model(copy.deepcopy(orig), floor=False)
    ids, am = prompts("b1")
    ref = generate(orig, ids, am, DynamicCache(), new=4, num_beams=2)
    cache = opsadv.PagedKVCache(conv, page_size=8, max_cache_len=32)
    with opsadv.trace() as t:
        out = generate(conv, ids, am, cache, new=4, num_beams=2)
    assert torch.equal(out.sequences, ref.sequences)
    served = {k: v for k, v in t.counts.items() if "paged_attention" in k}
    assert served and all("triton" in k for k in served), t.counts
    pool_state(cache)
