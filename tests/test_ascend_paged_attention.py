"""Contract tests of the ascend paged_attention mapping (opsadv/backends/ascend/paged_attention.py) without an NPU:
torch_npu is the in-process double (tests/fake_torch_npu), whose npu_fused_infer_attention_score with block_table
re-implements the documented PageAttention semantics in float64 (its own page walk, lengths, causal alignment) and
checks the documented argument contracts.  Results are compared with opsadv's reference backend in float64.
Nothing here says the numbers hold on Ascend hardware."""
from __future__ import annotations

import math
import sys

import pytest
import torch

import opsadv
from opsadv.backends.ascend.attention import COMPRESSED
from opsadv.backends.ascend.paged_attention import IMPL_ID
from opsadv.errors import NoKernelError
from opsadv.ops.paged_attention.cases import paged_inputs

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_ascend_contract import TOL, activate_double, assert_out_lse_match, npu  # noqa: E402,F401  (npu: the fixture)


def _clone(args, kw):
    c = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(c(a) for a in args), {k: c(v) for k, v in kw.items()}


def _run(args, kw, causal=True, backend="ascend"):
    with torch.no_grad(), opsadv.use_backend(backend):
        return opsadv.ops.paged_attention(*args, causal=causal, return_lse=True, **kw)


def _compare(args, kw, causal=True, dtype=torch.float16):
    """ascend (double) vs the reference backend on float64 copies: out, lse (-inf exactly where the reference has
    it), and the caches after the append."""
    a64, k64 = _clone(args, kw)
    a64 = tuple(t.double() if t.is_floating_point() else t for t in a64)
    k64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in k64.items()}
    out, lse = _run(args, kw, causal)
    ro, rl = _run(a64, k64, causal, backend="reference")
    assert_out_lse_match(out, lse, ro, rl, TOL[dtype])
    for i in (1, 2):       # the caches, appended in place on both sides (NaN in unused slots on both)
        assert torch.allclose(args[i].double(), a64[i], equal_nan=True)
    return out, lse


def _sent(npu):
    return npu.named("npu_fused_infer_attention_score")[-1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_decode_gqa(npu, dtype, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    args, kw = paged_inputs(dtype, "cpu", g, hq=hq, hkv=hkv, d=32, page=16, lens=[1, 37, 64, 5])
    _compare(args, kw, dtype=dtype)
    c = _sent(npu)
    q, key = c.args[0], c.args[1]
    assert c.kwargs["input_layout"] == "BSND" and tuple(q.shape) == (4, 1, hq, 32)
    assert tuple(key.shape) == (args[1].shape[0], 16, hkv * 32)             # (blocknum, blocksize, H)
    assert key.data_ptr() == args[1].data_ptr()                              # a view of the cache, no copy
    assert c.kwargs["block_size"] == 16 and c.kwargs["block_table"] is args[3]
    assert c.kwargs["actual_seq_lengths_kv"] == [1, 37, 64, 5]
    assert (c.kwargs["num_heads"], c.kwargs["num_key_value_heads"]) == (hq, hkv) and c.kwargs["softmax_lse_flag"]
    assert c.kwargs["scale"] == pytest.approx(1 / math.sqrt(32))
    assert c.kwargs["sparse_mode"] == 0 and c.kwargs["atten_mask"] is None    # Q_S = 1: nothing to mask


def test_decode_append_across_pages(npu):
    """One new token per sequence, landing at the first slot of a new page for sequence 0 (length 17 with pages of
    16) and mid-page for the others: written by npu_scatter_nd_update_ before the attention reads it."""
    g = torch.Generator().manual_seed(1)
    args, kw = paged_inputs(torch.float16, "cpu", g, hq=4, hkv=2, d=64, page=16, lens=[17, 16, 40], append=True)
    _compare(args, kw)
    sc = npu.named("npu_scatter_nd_update_")
    assert len(sc) == 2 and sc[0].args[0] is args[1] and sc[1].args[0] is args[2]
    idx = sc[0].args[1]
    table = args[3]
    assert idx.dtype == torch.int32 and idx.tolist() == [[int(table[0, 1]), 0], [int(table[1, 0]), 15],
                                                         [int(table[2, 2]), 7]]
    names = [c.name for c in npu.calls if c.name.startswith("npu_")]
    assert names == ["npu_scatter_nd_update_", "npu_scatter_nd_update_", "npu_fused_infer_attention_score"]


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_prefill_packed(npu, causal):
    """Packed q (cu_seqlens_q) with different counts per sequence, one empty, appended across page boundaries:
    BSND padded to the longest count, actual_seq_lengths = the counts, sparse_mode 3 for causal."""
    g = torch.Generator().manual_seed(2)
    args, kw = paged_inputs(torch.float16, "cpu", g, hq=4, hkv=2, d=64, page=128, lens=[130, 9, 300, 5],
                            q_counts=[5, 0, 140, 5], append=True)
    out, lse = _compare(args, kw, causal=causal)
    c = _sent(npu)
    assert tuple(c.args[0].shape) == (4, 140, 4, 64) and c.kwargs["input_layout"] == "BSND"
    assert c.kwargs["actual_seq_lengths"] == [5, 0, 140, 5] and c.kwargs["actual_seq_lengths_kv"] == [130, 9, 300, 5]
    if causal:
        assert c.kwargs["sparse_mode"] == 3 and tuple(c.kwargs["atten_mask"].shape) == (COMPRESSED, COMPRESSED)
    else:
        assert c.kwargs["sparse_mode"] == 0 and c.kwargs["atten_mask"] is None
    assert len(npu.named("npu_scatter_nd_update_")[0].args[1]) == 150


def test_fixed_multi_query_speculative(npu):
    """(batch, s_q > 1) q: the PromptFlashAttention branch without padding, bottom-right causal per sequence."""
    g = torch.Generator().manual_seed(3)
    args, kw = paged_inputs(torch.bfloat16, "cpu", g, hq=8, hkv=2, d=128, page=256, lens=[300, 4, 257], s_q=4,
                            append=True)
    _compare(args, kw, dtype=torch.bfloat16)
    c = _sent(npu)
    assert tuple(c.args[0].shape) == (3, 4, 8, 128) and c.kwargs["actual_seq_lengths"] == [4, 4, 4]
    assert c.kwargs["sparse_mode"] == 3


def test_empty_sequences_and_more_queries_than_keys(npu):
    """seqlens_k 0 (no key), and causal rows before the first key (3 queries over 1 key): the docs leave such rows
    unspecified (the double returns NaN there); the mapping gives 0 / lse -inf, as the reference."""
    g = torch.Generator().manual_seed(4)
    for causal in (True, False):
        args, kw = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=1, d=32, page=16, lens=[0, 20, 0])
        out, lse = _compare(args, kw, causal=causal)
        assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
        assert _sent(npu).kwargs["actual_seq_lengths_kv"] == [0, 20, 0]
    g = torch.Generator().manual_seed(5)
    args, kw = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=32, page=128, lens=[1, 200], s_q=3)
    out, lse = _compare(args, kw)
    assert torch.isneginf(lse[0, :2]).all() and torch.isfinite(lse[0, 2]).all() and torch.isfinite(lse[1]).all()


def test_refusals_give_reasons(npu):
    g = torch.Generator().manual_seed(6)
    with opsadv.use_backend("ascend"):
        args, _ = paged_inputs(torch.float32, "cpu", g, hq=2, hkv=2, d=32, page=16, lens=[3])
        assert "dtype float32 not in" in str(opsadv.explain("paged_attention", *args))
        args, _ = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=32, page=8, lens=[3])
        why = str(opsadv.explain("paged_attention", *args))
        assert IMPL_ID in why and "page_size 8" in why and "multiple of 16" in why
        args, _ = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=32, page=16, lens=[3])
        assert opsadv.explain("paged_attention", *args).chosen == IMPL_ID
        # more than one query per sequence with pages of 16: the PromptFlashAttention branch needs 128..512
        args, kw = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=32, page=16, lens=[40, 9], s_q=2)
        with pytest.raises(NoKernelError, match="128..512") as e, torch.no_grad():
            opsadv.ops.paged_attention(*args, **kw)
        assert IMPL_ID in e.value.reasons
        # ... and D not a multiple of 16
        args, kw = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=40, page=128, lens=[40], s_q=2)
        with pytest.raises(NoKernelError, match="head_dim 40"), torch.no_grad():
            opsadv.ops.paged_attention(*args, **kw)
        # sequences sharing pages: fewer pages than the sum the op requires
        args, kw = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=32, page=16, lens=[64, 64],
                                shared_prefix=4, extra_pages=0)
        with pytest.raises(NoKernelError, match="blocknum"), torch.no_grad():
            opsadv.ops.paged_attention(*args, **kw)
    assert not npu.named("npu_fused_infer_attention_score")          # nothing reached the op


def test_refused_on_310p(monkeypatch):
    activate_double(monkeypatch, soc=202, name="Ascend310P3")
    try:
        g = torch.Generator().manual_seed(7)
        args, _ = paged_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=32, page=16, lens=[3])
        with opsadv.use_backend("ascend"):
            assert "needs Atlas A2/A3" in str(opsadv.explain("paged_attention", *args))
    finally:
        from opsadv.registry import reset_registry
        sys.modules.pop("torch_npu", None)
        reset_registry()


def test_the_double_catches_a_wrong_mapping(npu, monkeypatch):
    """The contract test can fail: lengths off by one, or causal without sparse_mode 3, change the double's
    result (or trip its argument checks)."""
    import opsadv.backends.ascend.paged_attention as pa
    g = torch.Generator().manual_seed(8)
    args, kw = paged_inputs(torch.float16, "cpu", g, hq=4, hkv=2, d=32, page=128, lens=[130, 60], s_q=3)
    real = pa._npu.torch_npu().npu_fused_infer_attention_score

    def shorter(*a, **k):
        k["actual_seq_lengths_kv"] = [x - 1 for x in k["actual_seq_lengths_kv"]]
        return real(*a, **k)

    def no_causal(*a, **k):
        k.update(sparse_mode=0, atten_mask=None)
        return real(*a, **k)

    for bad in (shorter, no_causal):
        monkeypatch.setattr(pa._npu.torch_npu(), "npu_fused_infer_attention_score", bad)
        with pytest.raises(AssertionError):
            _compare(*_clone(args, kw))
