"""Contract tests of the ascend varlen_attention mapping (opsadv/backends/ascend/varlen_attention.py) without an NPU:
torch_npu is the in-process double (tests/fake_torch_npu), whose npu_fusion_attention in layout TND computes the
documented varlen semantics in float64 (cumulative actual_seq_qlen / kvlen, sparse_mode 3 bottom-right per sequence,
NaN on rows the docs leave unspecified) and checks the documented varlen limits.  Results are compared with opsadv's
reference backend in float64.  Nothing here says the numbers hold on Ascend hardware."""
from __future__ import annotations

import math
import sys

import pytest
import torch

import opsadv
from opsadv.backends.ascend.attention import COMPRESSED
from opsadv.backends.ascend.varlen_attention import IMPL_ID
from opsadv.errors import NoKernelError
from opsadv.ops.varlen_attention.cases import varlen_inputs

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_ascend_contract import TOL, assert_out_lse_match, npu  # noqa: E402,F401  (npu: the fixture)


def _run(args, causal, backend="ascend"):
    with torch.no_grad(), opsadv.use_backend(backend):
        return opsadv.ops.varlen_attention(*args, causal=causal, return_lse=True)


def _compare(args, causal, dtype):
    out, lse = _run(args, causal)
    ro, rl = _run(tuple(t.double() if t.is_floating_point() else t for t in args), causal, backend="reference")
    assert out.dtype == dtype
    assert_out_lse_match(out, lse, ro, rl, TOL[dtype])


def _sent(npu):
    return npu.named("npu_fusion_attention")[-1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_chunked_prefill_gqa(npu, dtype, hq, hkv):
    """Query chunks against longer contexts (causal, bottom-right per sequence): every row sees a key, so q goes in
    as is with the cumulative lengths."""
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    args, _ = varlen_inputs(dtype, "cpu", g, hq=hq, hkv=hkv, d=32, q_lens=[3, 1, 6], k_lens=[37, 5, 6])
    _compare(args, True, dtype)
    c = _sent(npu)
    q, k = c.args[0], c.args[1]
    assert c.kwargs["input_layout"] == "TND" and c.kwargs["head_num"] == hq
    assert q.data_ptr() == args[0].data_ptr() and tuple(k.shape) == (48, hkv, 32)
    assert c.kwargs["actual_seq_qlen"] == [3, 4, 10] and c.kwargs["actual_seq_kvlen"] == [37, 42, 48]
    assert c.kwargs["sparse_mode"] == 3 and tuple(c.kwargs["atten_mask"].shape) == (COMPRESSED, COMPRESSED)
    assert c.kwargs["scale"] == pytest.approx(1 / math.sqrt(32)) and c.kwargs["keep_prob"] == 1.0


@pytest.mark.parametrize("causal", [True, False])
def test_rows_without_keys_are_not_sent(npu, causal):
    """A sequence with no keys is dropped; causal queries past their keys (7 queries, 3 keys) are left out (out 0,
    lse -inf), so no fully masked row reaches the op; a sequence with keys and no queries stays; strided views of a
    packed qkv projection."""
    g = torch.Generator().manual_seed(3)
    args, _ = varlen_inputs(torch.float16, "cpu", g, hq=4, hkv=2, d=40, q_lens=[7, 2, 0, 4], k_lens=[3, 0, 5, 9],
                            packed=True)
    _compare(args, causal, torch.float16)
    c = _sent(npu)
    if causal:
        assert c.kwargs["actual_seq_qlen"] == [3, 3, 7] and tuple(c.args[0].shape) == (7, 4, 40)
    else:
        assert c.kwargs["actual_seq_qlen"] == [7, 7, 11] and c.kwargs["sparse_mode"] == 0
        assert c.kwargs["atten_mask"] is None
    assert c.kwargs["actual_seq_kvlen"] == [3, 8, 17]


def test_nothing_to_send(npu):
    """Every sequence without keys: zeros / -inf without calling the op."""
    g = torch.Generator().manual_seed(4)
    args, _ = varlen_inputs(torch.bfloat16, "cpu", g, hq=2, hkv=1, d=16, q_lens=[2, 3], k_lens=[0, 0])
    out, lse = _run(args, True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse)) and not npu.named("npu_fusion_attention")


def test_explain_and_refusals(npu):
    g = torch.Generator().manual_seed(5)
    args, _ = varlen_inputs(torch.float16, "cpu", g, hq=4, hkv=2, d=32, q_lens=[3, 1], k_lens=[9, 4])
    with opsadv.use_backend("ascend"):
        assert opsadv.explain("varlen_attention", *args, causal=True).chosen == IMPL_ID
    many, _ = varlen_inputs(torch.float16, "cpu", g, hq=2, hkv=2, d=16, q_lens=[1] * 1025, k_lens=[1] * 1025)
    with pytest.raises(NoKernelError, match="1025 sequences > 1024"):
        _run(many, True)
    with pytest.raises(NoKernelError, match="float32"):     # the op takes float16 / bfloat16 here
        _run(tuple(t.float() if t.is_floating_point() else t for t in args), True)
