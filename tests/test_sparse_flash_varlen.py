"""cuda.sdpa.flash_varlen (PyTorch's FlashAttention-2 varlen kernel for sparse_attention) and what it
relies on: the layout facts dense_blocks / max_seqlen (every constructor, with_, combine, validation),
the hint features and the impl's rejection reasons, the packed encoder's filler segments (<= s rows),
and the wrapper's layout plumbing against an emulated FA2 on CPU.  The real kernel runs only on a GPU
(the last tests skip without CUDA)."""
from __future__ import annotations

import importlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv import SparseLayout
from opsadv.core import dispatch
from opsadv.core.env import EnvInfo
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec, KernelImpl
sparse_op = importlib.import_module("opsadv.ops.sparse_attention")

from conftest import rel_err

sdpa = pytest.importorskip("opsadv.backends.cuda.flash_attention.sdpa")
IMPL = "cuda.sdpa.flash_varlen"
H200 = EnvInfo(device_type="cuda", compute_capability=(9, 0))


# ---- layout facts ------------------------------------------------------------------------------------
def test_constructors_set_the_facts():
    assert SparseLayout.dense(37, block_size=16).dense_blocks
    assert SparseLayout.dense(37, block_size=16).max_seqlen is None
    assert not SparseLayout.sliding_window(40, 5, block_size=16).dense_blocks
    assert not SparseLayout.global_tokens(40, 3, block_size=16).dense_blocks
    assert not SparseLayout.dilated(64, block_size=16, dilation=2).dense_blocks
    assert not SparseLayout.bigbird(64, block_size=16).dense_blocks
    assert SparseLayout.from_block_mask(torch.ones(3, 2, dtype=torch.bool), block_size=8).dense_blocks
    assert not SparseLayout.from_block_mask(torch.tensor([[True, False]]), block_size=8).dense_blocks
    kp = SparseLayout.from_padding_mask(torch.tensor([[1, 1, 0], [1, 0, 0]]), block_size=4)
    assert kp.dense_blocks and kp.max_seqlen is None
    v = SparseLayout.varlen([5, 0, 17, 1], block_size=8)
    assert v.dense_blocks and v.max_seqlen == 17
    assert SparseLayout.varlen([5, 9], causal=True).dense_blocks
    assert not SparseLayout.varlen([5, 9], window=2, block_size=4).dense_blocks
    assert not SparseLayout.varlen([5, 9], num_global=1, block_size=4).dense_blocks
    assert SparseLayout.varlen([5, 9], window=2, block_size=4).max_seqlen == 9
    # built by hand: the facts are off unless stated
    hand = SparseLayout(10, 10, 4, torch.ones(1, 1, 3, 3, dtype=torch.bool),
                        cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    assert not hand.dense_blocks and hand.max_seqlen is None
    assert v.to("cpu").dense_blocks and v.to("cpu").max_seqlen == 17
    assert "<= 17 tokens" in repr(v)


def test_with_and_combine_never_keep_a_stale_fact():
    v = SparseLayout.varlen([6, 10], block_size=4)
    sparse_bm = v.block_mask.clone()
    sparse_bm[..., 0, 1] = False
    assert not v.with_(block_mask=sparse_bm).dense_blocks
    assert v.with_(block_mask=torch.ones_like(sparse_bm)).dense_blocks
    assert v.with_(cu_seqlens=torch.tensor([0, 15, 16], dtype=torch.int32)).max_seqlen == 15
    assert v.with_(causal=True).dense_blocks and v.with_(causal=True).max_seqlen == 10
    # a window over the packed batch: the window's (all False) blocks are the result's
    w = SparseLayout.sliding_window(16, 3, block_size=4).combine(v)
    assert not w.dense_blocks and w.max_seqlen == 10
    # dense "and" packed keeps both facts; "or" with a dense side is dense
    d = SparseLayout.dense(16, block_size=8).combine(v)
    assert d.dense_blocks and d.max_seqlen == 10 and d.block_size == 4
    assert SparseLayout.sliding_window(16, 3, block_size=4).combine(v, "or").dense_blocks
    assert not SparseLayout.sliding_window(16, 3, block_size=4).combine(
        SparseLayout.global_tokens(16, 2, block_size=4), "or").dense_blocks
    # the facts agree with the tensors on every result
    for lay in (w, d):
        assert lay.dense_blocks == bool(lay.block_mask.all())


@pytest.mark.parametrize("make, arg", [
    (lambda: SparseLayout(8, 8, 4, torch.tensor([[[[True, False], [True, True]]]]), dense_blocks=True),
     "dense_blocks"),
    (lambda: SparseLayout(8, 8, 4, torch.ones(1, 1, 2, 2, dtype=torch.bool),
                          cu_seqlens=torch.tensor([0, 6, 8], dtype=torch.int32), max_seqlen=5), "max_seqlen"),
    (lambda: SparseLayout(8, 8, 4, torch.ones(1, 1, 2, 2, dtype=torch.bool), max_seqlen=8), "max_seqlen"),
    (lambda: SparseLayout(8, 8, 4, torch.ones(1, 1, 2, 2, dtype=torch.bool),
                          cu_seqlens=torch.tensor([0, 6, 8], dtype=torch.int32), max_seqlen=-1), "max_seqlen"),
    (lambda: SparseLayout(8, 8, 4, torch.ones(1, 1, 2, 2, dtype=torch.bool), dense_blocks=1), "dense_blocks"),
])
def test_wrong_facts_are_refused(make, arg):
    with pytest.raises(InvalidArgumentError, match=arg):
        make()


# ---- features, buckets, rejection reasons ------------------------------------------------------------
def _qkv(n, hq=4, hk=4, d=64, dtype=torch.bfloat16):
    return (torch.empty(1, hq, n, d, dtype=dtype), torch.empty(1, hk, n, d, dtype=dtype),
            torch.empty(1, hk, n, d, dtype=dtype))


def _impl() -> KernelImpl:
    return next(i for i in sdpa.impls(H200) if i.id == IMPL)


def _reasons(lay, hq=4, hk=4, d=64, dtype=torch.bfloat16, env=H200, backward=False):
    q, k, _ = _qkv(lay.seq_q, hq, hk, d, dtype)
    spec = dataclasses.replace(sparse_op.layout_spec(q, k, lay, backward), device_type="cuda")
    return _impl().rejection_reasons(spec, env, experimental_ok=False, deterministic=False)


def test_features_carry_the_facts():
    q, k, _ = _qkv(23)
    f = sparse_op.layout_spec(q, k, SparseLayout.varlen([20, 3], block_size=16), False).features
    assert {"varlen", "dense_blocks", "max_seqlen_known"} <= f
    hand = SparseLayout(23, 23, 16, torch.ones(1, 1, 2, 2, dtype=torch.bool),
                        cu_seqlens=torch.tensor([0, 20, 23], dtype=torch.int32))
    f = sparse_op.layout_spec(q, k, hand, False).features
    assert "varlen" in f and not f & {"dense_blocks", "max_seqlen_known"}
    assert "max_seqlen_known" not in sparse_op.layout_spec(q, k, SparseLayout.dense(23), False).features
    # the facts split the resolution bucket: one key never serves both
    keys = {sparse_op._key(q, k, None, lay.cu_seqlens, 16, False, -1, -1, 0, lay.dense_blocks,
                           -1 if lay.max_seqlen is None else lay.max_seqlen, False)
            for lay in (hand, SparseLayout.varlen([20, 3], block_size=16))}
    assert len(keys) == 2


def test_hint_features_do_not_reject_impls_that_do_not_list_them():
    impl = KernelImpl(id="x.sparse", op="sparse_attention", backend="x", fn=lambda *a: None,
                      device_types=("cpu",), dtypes=(torch.float32,), features=frozenset({"varlen"}))
    spec = CallSpec("sparse_attention", "cpu", torch.float32, frozenset({"varlen", "dense_blocks", "max_seqlen_known"}),
                    (16, 32, 32), head_dim=8)
    assert impl.rejection_reasons(spec, H200, experimental_ok=False, deterministic=False) == []
    spec = dataclasses.replace(spec, features=spec.features | {"window"})
    assert impl.rejection_reasons(spec, H200, experimental_ok=False, deterministic=False) == \
        ["does not support window"]


def test_flash_varlen_serves_plain_packed_layouts():
    assert _reasons(SparseLayout.varlen([20, 0, 1, 44], block_size=16)) == []
    assert _reasons(SparseLayout.varlen([20, 0, 1, 44], causal=True, block_size=16), hq=8, hk=2, d=128) == []
    assert _reasons(SparseLayout.varlen([7, 9]), d=256, dtype=torch.float16, backward=True) == []


@pytest.mark.parametrize("kw, expect", [
    (dict(lay=lambda: SparseLayout.varlen([20, 12], window=3, block_size=16)), "does not support window"),
    (dict(lay=lambda: SparseLayout.varlen([20, 12], num_global=2, block_size=16)), "does not support global"),
    (dict(lay=lambda: SparseLayout.from_padding_mask(torch.tensor([[1] * 30 + [0] * 2]), block_size=16)),
     "does not support key_padding"),
    (dict(lay=lambda: SparseLayout.dense(32, block_size=16)), "needs a packed layout"),
    (dict(lay=lambda: SparseLayout(32, 32, 16, torch.tensor([[[[True, False], [True, True]]]]),
                                   cu_seqlens=torch.tensor([0, 20, 32], dtype=torch.int32))), "not known to be all True"),
    (dict(lay=lambda: SparseLayout(32, 32, 16, torch.ones(1, 1, 2, 2, dtype=torch.bool), dense_blocks=True,
                                   cu_seqlens=torch.tensor([0, 20, 32], dtype=torch.int32))), "no max_seqlen"),
    (dict(d=60), "not a multiple of 8"),
    (dict(d=264), "head_dim 264 > 256"),
    (dict(dtype=torch.float32), "dtype float32"),
    (dict(env=EnvInfo(device_type="cuda", compute_capability=(7, 5))), "compute capability >= 8.0"),
])
def test_flash_varlen_rejections_say_why(kw, expect):
    kw = dict(kw)
    lay = kw.pop("lay", lambda: SparseLayout.varlen([20, 12], block_size=16))()
    why = _reasons(lay, **kw)
    assert any(expect in r for r in why), why


def test_explain_lists_flash_varlen():
    """On CPU (interpreter mode) explain() lists the impl with its refusal; the Triton impl serves."""
    q, k, v = (torch.randn(1, 2, 30, 32, dtype=torch.float16) for _ in range(3))
    lay = SparseLayout.varlen([10, 20], block_size=16)
    try:
        ctx = opsadv.use_backend("cuda")
    except Exception:
        pytest.skip("cuda backend not available (needs TRITON_INTERPRET=1 or a GPU)")
    with ctx:
        text = str(opsadv.explain("sparse_attention", q, k, v, lay))
    assert IMPL in text and "device 'cpu'" in text


# ---- packing: filler rows in segments of <= s --------------------------------------------------------
def test_filler_offsets():
    from opsadv.convert.packing import filler_offsets
    for n_real, rows, s in [(51, 70, 16), (0, 256, 100), (256, 256, 64), (200, 256, 512), (3, 40, 7)]:
        ends = filler_offsets(torch.tensor(n_real), rows, s).tolist()
        assert len(ends) == -(-rows // s) and ends[-1] == rows
        lens = [b - a for a, b in zip([n_real] + ends, ends)]
        assert all(0 <= x <= s for x in lens) and sum(lens) == rows - n_real


@pytest.mark.parametrize("rows", [None, 128])
def test_build_pack_bounds_every_segment(rows):
    from opsadv.convert import packing
    g = torch.Generator().manual_seed(2)
    b, s = 5, 40
    lens = torch.randint(0, s + 1, (b,), generator=g)
    lens[1] = s
    kpm = torch.arange(s)[None] < lens[:, None]
    n = int(lens.sum())
    token = packing.static_rows.set(max(rows, n) if rows else None)
    try:
        pack = packing.build_pack(kpm)
    finally:
        packing.static_rows.reset(token)
    lay = pack.layout
    seg = lay.seqlens
    assert lay.dense_blocks and lay.max_seqlen is not None and max(seg) <= lay.max_seqlen <= s
    assert seg[:b] == lens.tolist() and sum(seg) == lay.seq_q
    if rows:
        assert lay.max_seqlen == s and len(seg) == b + -(-lay.seq_q // s)


def test_split_filler_layout_triton_kernel_matches_reference(monkeypatch):
    """The Triton sparse kernel (interpreter) over a graph-path packed layout (filler split into
    <= s segments, some empty, tile index built as under capture) equals the reference."""
    pytest.importorskip("opsadv.backends.triton_common.sparse_attention.sparse")
    from opsadv.convert import packing
    from opsadv.core import sparse_tiles as layout_mod
    torch.manual_seed(0)
    b, s = 3, 24
    kpm = torch.arange(s)[None] < torch.tensor([[20], [0], [9]])
    token = packing.static_rows.set(64)
    try:
        lay = packing.build_pack(kpm).layout
    finally:
        packing.static_rows.reset(token)
    assert lay.cu_seqlens.tolist() == [0, 20, 20, 29, 53, 64, 64]
    q, k, v = (torch.randn(1, 2, 64, 32, dtype=torch.float16) for _ in range(3))
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.sparse_attention(q.float(), k.float(), v.float(), lay)
    monkeypatch.setattr(layout_mod, "capturing", lambda t: True)
    try:
        ctx = opsadv.use_backend("cuda")
    except Exception:
        pytest.skip("cuda backend not available")
    with ctx, opsadv.trace() as tr:
        out = opsadv.ops.sparse_attention(q, k, v, lay)
    assert dict(tr.counts) == {"cuda.triton.sparse_attention": 1}
    assert rel_err(out, ref) < 5e-3


# ---- the op boundary: new arguments, fake kernel ----------------------------------------------------
def test_fake_kernel_and_op_arguments():
    from torch._subclasses.fake_tensor import FakeTensorMode
    lay = SparseLayout.varlen([5, 0, 11], causal=True, block_size=8)
    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.empty(1, 4, 16, 32, dtype=torch.float16))
        kv = mode.from_tensor(torch.empty(1, 2, 16, 32, dtype=torch.float16))
        out, lse = torch.ops.opsadv.sparse_attention(q, kv, kv, *(mode.from_tensor(t) for t in (
            lay.block_mask,)), None, mode.from_tensor(lay.cu_seqlens), 8, True, -1, -1, 0, None, True, 11)
        dq, dk, dv = torch.ops.opsadv.sparse_attention_backward(
            q, q, kv, kv, out, lse, mode.from_tensor(lay.block_mask), None, mode.from_tensor(lay.cu_seqlens), 8,
            True, -1, -1, 0, None, True, 11)
    assert out.shape == q.shape and lse.shape == (1, 4, 16) and lse.dtype == torch.float32
    assert dk.shape == kv.shape and dq.shape == q.shape


def test_opcheck_with_the_facts(reference_backend):
    from torch.library import opcheck
    lay = SparseLayout.varlen([5, 0, 11], causal=True, block_size=8)
    g = lambda *s: torch.randn(*s, requires_grad=True)   # noqa: E731
    opcheck(torch.ops.opsadv.sparse_attention.default,
            (g(1, 4, 16, 8), g(1, 2, 16, 8), g(1, 2, 16, 8), lay.block_mask, None, lay.cu_seqlens, 8, True, -1, -1, 0,
             None, True, 11))


# ---- the wrapper against an emulated FA2 (CPU) --------------------------------------------------------
def _emulated_attention(q, k, v, cu, max_s, causal, scale):
    """FA2 varlen semantics in float32: q (N, h, d), k/v (N, hk, d) -> out (N, h, d), lse (h, N)."""
    n, h, d = q.shape
    rep = h // k.shape[1]
    out = torch.zeros(n, h, d)
    lse = torch.full((h, n), float("inf"))      # FA2 leaves +inf nowhere here: every row has its diagonal
    cu = cu.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        assert b - a <= max_s, "max_seqlen must bound every segment"
        if a == b:
            continue
        qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        sc = qs @ ks.transpose(1, 2) * scale
        if causal:
            sc = sc.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        lse[:, a:b] = torch.logsumexp(sc, -1)
        out[a:b] = (torch.softmax(sc, -1) @ vs).transpose(0, 1)
    return out, lse


class FakeFA2:
    """Stands in for aten._flash_attention_forward / _backward, checking what the wrapper hands over."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, *, scale):
        assert q.dim() == 3 and q.stride(-1) == 1 and cu_q.dtype == torch.int32 and cu_q is cu_k
        assert isinstance(max_q, int) and max_q == max_k and p == 0.0 and not debug
        self.calls.append(("fwd", q.data_ptr()))
        out, lse = _emulated_attention(q, k, v, cu_q, max_q, causal, scale)
        return out.to(q.dtype), lse, torch.empty(2), torch.empty(0), torch.empty(0)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, p, causal, seed, offset, *, scale):
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (dout, q, k, v, out))
        self.calls.append(("bwd",))
        qq, kk, vv = (t.detach().float().requires_grad_() for t in (q, k, v))
        o, _ = _emulated_attention(qq, kk, vv, cu_q, max_q, causal, scale)
        dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), dout.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.mark.parametrize("causal, hq, hk", [(False, 4, 4), (True, 6, 2)])
def test_wrapper_plumbing_against_emulated_fa2(monkeypatch, causal, hq, hk):
    fa2 = FakeFA2()
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fa2.forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fa2.backward)
    lay = SparseLayout.varlen([13, 0, 1, 30], causal=causal, block_size=16)
    n, d = lay.seq_q, 16
    g = torch.Generator().manual_seed(5)
    # (1, h, N, d) views over (1, N, h, d) memory, as a projection hands them over
    q, k, v = (torch.randn(1, n, h, d, generator=g).transpose(1, 2) for h in (hq, hk, hk))
    args = (lay.block_mask, None, lay.cu_seqlens, lay.block_size, causal, -1, -1, 0, 0.3, True, lay.max_seqlen)
    out, lse = sdpa.flash_varlen_fwd(None, q, k, v, *args)
    assert fa2.calls[0] == ("fwd", q.data_ptr())            # q handed over without a copy
    assert out.shape == q.shape and lse.shape == (1, hq, n) and lse.is_contiguous()
    with opsadv.use_backend("reference"):
        qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = opsadv.ops.sparse_attention(qq, kk, vv, lay, scale=0.3, return_lse=True)
        dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        ref.backward(dout)
    assert rel_err(out, ref) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    dq, dk, dv = sdpa.flash_varlen_bwd(None, dout.float(), q, k, v, out, lse, *args)
    for x, y in ((dq, qq.grad), (dk, kk.grad), (dv, vv.grad)):
        assert x.shape == y.shape and rel_err(x, y) < 1e-5


def test_trailing_empty_segments_are_not_launched(monkeypatch):
    """A compiled packed batch's cu_seqlens has b * s + 1 entries, most of them empty trailing segments (built
    without a host read); FA2's grid spans the segments, so the wrapper hands it only the live ones (one read per
    cu tensor), with the same outputs and gradients as the exact layout."""
    fa2, seen = FakeFA2(), []
    fwd, bwd = fa2.forward, fa2.backward
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward",
                        lambda q, k, v, cu_q, *a, **kw: seen.append(cu_q.tolist()) or fwd(q, k, v, cu_q, *a, **kw))
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward",
                        lambda *a, **kw: seen.append(a[6].tolist()) or bwd(*a, **kw))
    lens = [13, 0, 1, 30]
    exact = SparseLayout.varlen(lens, causal=True, block_size=16)
    n, d, g = exact.seq_q, 16, torch.Generator().manual_seed(7)
    padded = torch.cat([exact.cu_seqlens, torch.full((n - len(lens),), n, dtype=torch.int32)])
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for _ in range(3))
    dout = torch.randn(1, 2, n, d, generator=g)
    outs = []
    for cu in (exact.cu_seqlens, padded):
        args = (exact.block_mask, None, cu, 16, True, -1, -1, 0, 0.25, True, 44)
        out, lse = sdpa.flash_varlen_fwd(None, q, k, v, *args)
        outs.append((out, lse, *sdpa.flash_varlen_bwd(None, dout, q, k, v, out, lse, *args)))
    assert seen == [[0, 13, 13, 14, 44]] * 4
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert sdpa.live_segments(torch.tensor([0, 0, 0], dtype=torch.int32)).tolist() == [0, 0]


def test_wrapper_refuses_a_missing_bound():
    q = torch.empty(1, 2, 8, 16)
    with pytest.raises(ValueError, match="max_seqlen"):
        sdpa.flash_varlen_fwd(None, q, q, q, None, None, torch.tensor([0, 8], dtype=torch.int32), 8, False, -1, -1,
                              0, 0.25, True, -1)


# ---- on a GPU: the real FA2 kernel ------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="FA2 varlen needs a CUDA device")


def _gpu_case(lens, hq, hk, d, dtype, causal, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = SparseLayout.varlen(lens, causal=causal, block_size=128, device="cuda")
    n = lay.seq_q
    q, k, v = (torch.randn(1, n, h, d, generator=g).to("cuda", dtype).transpose(1, 2) for h in (hq, hk, hk))
    dout = torch.randn(1, hq, n, d, generator=g).to("cuda", dtype)
    return lay, q, k, v, dout


def _fwd_bwd(backend, lay, q, k, v, dout, **kw):
    with opsadv.use_backend(backend, **kw), opsadv.trace() as tr:
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = opsadv.ops.sparse_attention(qq, kk, vv, lay, return_lse=True)
        out.backward(dout)
    return (out, lse, qq.grad, kk.grad, vv.grad), tr.counts


@cuda
@pytest.mark.parametrize("lens, hq, hk, d, dtype, causal", [
    ([45, 0, 1, 127, 300], 4, 4, 64, torch.bfloat16, False),
    ([45, 0, 1, 127, 300], 8, 2, 128, torch.float16, True),
    ([1, 2, 3], 2, 1, 32, torch.float16, True),
    ([513, 77], 3, 3, 256, torch.bfloat16, False),
    ([64, 0, 0], 2, 2, 40, torch.float16, False),
])
def test_gpu_fwd_bwd_matches_reference(lens, hq, hk, d, dtype, causal):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FA2 needs sm80+")
    lay, q, k, v, dout = _gpu_case(lens, hq, hk, d, dtype, causal)
    got, counts = _fwd_bwd("cuda", lay, q, k, v, dout, impls={"sparse_attention": IMPL})
    assert set(counts) == {IMPL}, counts
    ref, _ = _fwd_bwd("reference", lay, *(t.float() for t in (q, k, v, dout)))
    tol = 2e-2 if dtype == torch.float16 else 5e-2
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert x.shape == y.shape and not torch.isnan(x).any(), name
        assert rel_err(x, y) < tol, f"{name}: {rel_err(x, y):.2e}"


@cuda
def test_gpu_is_chosen_by_auto_and_captures_in_a_cuda_graph():
    """Priority: FA2 varlen serves a plain packed layout under "cuda"; the op records into a CUDA
    graph (no host read: max_seqlen is a host int) and replays with new inputs."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FA2 needs sm80+")
    from opsadv.convert import packing
    b, s, h, d = 6, 96, 4, 64
    kpm = (torch.arange(s)[None] < torch.tensor([[96], [0], [50], [1], [96], [77]])).cuda()
    token = packing.static_rows.set(384)
    try:
        lay = packing.build_pack(kpm).layout        # the graph path: filler split into <= s segments
    finally:
        packing.static_rows.reset(token)
    assert lay.max_seqlen == s and lay.dense_blocks
    q, k, v = (torch.randn(1, 384, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    with opsadv.use_backend("cuda"), opsadv.trace() as tr:
        opsadv.ops.sparse_attention(q, k, v, lay)       # resolves (eager) before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = opsadv.ops.sparse_attention(q, k, v, lay)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
    assert set(tr.counts) == {IMPL}, tr.counts
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.sparse_attention(q.float(), k.float(), v.float(), lay)
    n_real = int(kpm.sum())
    assert rel_err(out[:, :, :n_real], ref[:, :, :n_real]) < 5e-2
    # per real sequence against plain SDPA too (the layout itself is under test here)
    a = 0
    for L in kpm.sum(1).tolist():
        if L:
            r = F.scaled_dot_product_attention(*(t[:, :, a:a + L].float() for t in (q, k, v)))
            assert rel_err(out[:, :, a:a + L], r) < 5e-2
        a += L


def test_windows_of_different_spans_resolve_apart():
    """The window's span is part of the bucket (and so of the tuning key): a measured choice at window 1024
    must not serve window 2048 (on the H200 the fastest kernel differs between them)."""
    q = torch.randn(1, 2, 4096, 64)
    k = torch.randn(1, 2, 4096, 64)
    specs = {w: sparse_op.layout_spec(q, k, SparseLayout.sliding_window(4096, w, causal=True), False)
             for w in (600, 1000, 2000)}
    assert specs[600].bucket == specs[1000].bucket           # spans 601 and 1001: one power-of-two bucket
    assert specs[1000].bucket != specs[2000].bucket
    bidir = sparse_op.layout_spec(q, k, SparseLayout.sliding_window(4096, 1000, causal=False), False)
    assert bidir.bucket != specs[1000].bucket                 # 2001 keys per row vs 1001
    assert sparse_op.layout_spec(q, k, SparseLayout.dense(4096), False).bucket[-1] == 0


def _sparse_cross_pairs(lay, q, k, v, dout, tol):
    """Every accepted sparse impl's forward with every accepted impl's backward (the dispatcher resolves the
    two separately, so FA2 varlen's (out, lse) may meet the Triton backward and the other way round),
    against the reference backend in float32.  Returns the impl ids paired."""
    from opsadv.registry import get_registry
    args = (lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal, lay.window_left,
            lay.window_right, lay.num_global)
    extra = (lay.dense_blocks, -1 if lay.max_seqlen is None else lay.max_seqlen)
    scale = q.shape[-1] ** -0.5
    with opsadv.use_backend("cuda"):
        exp, r = dispatch.explain_spec(sparse_op.layout_spec(q, k, lay, True))
    accepted = [c.impl for c in exp.candidates if c.accepted and c.impl.backend == "cuda"]
    ref, _ = _fwd_bwd("reference", lay, *(t.float() for t in (q, k, v, dout)))
    for fwd in accepted:
        out, lse = fwd.fn(r.ctx, q, k, v, *args, scale, *extra)
        for bwd in accepted:
            grads = bwd.backward(r.ctx, dout, q, k, v, out, lse, *args, scale, *extra)
            for name, x, y in zip(("dq", "dk", "dv"), grads, ref[2:]):
                assert not torch.isnan(x).any(), (fwd.id, bwd.id, name)
                assert rel_err(x, y) < tol, (fwd.id, bwd.id, name, rel_err(x, y))
    return [i.id for i in accepted]


@cuda
def test_gpu_every_sparse_forward_with_every_backward():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FA2 needs sm80+")
    lay, q, k, v, dout = _gpu_case([45, 0, 1, 127, 300], 8, 2, 128, torch.bfloat16, True)
    assert {IMPL, "cuda.triton.sparse_attention"} <= set(_sparse_cross_pairs(lay, q, k, v, dout, 5e-2))
    win = SparseLayout.sliding_window(700, 200, causal=True, block_size=128, device="cuda")
    q, k, v, dout = (torch.randn(1, h, 700, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2, 8))
    assert "cuda.triton.sparse_attention" in _sparse_cross_pairs(win, q, k, v, dout, 5e-2)


def test_sparse_forward_backward_pairs_interpreter():
    """The pairing helper on CPU under the interpreter (the Triton sparse impl with itself, varlen and window)."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the cuda backend's Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(0)
    lay = SparseLayout.varlen([20, 0, 1, 33], causal=True, block_size=16)
    q, k, v, dout = (torch.randn(1, h, lay.seq_q, 32, generator=g).half() for h in (4, 2, 2, 4))
    assert "cuda.triton.sparse_attention" in _sparse_cross_pairs(lay, q, k, v, dout, 2e-2)
    win = SparseLayout.sliding_window(50, 7, causal=True, block_size=16)
    q, k, v, dout = (torch.randn(1, h, 50, 32, generator=g).half() for h in (4, 2, 2, 4))
    assert "cuda.triton.sparse_attention" in _sparse_cross_pairs(win, q, k, v, dout, 2e-2)


def test_sparse_explain_names_the_bucket_the_call_resolves_in():
    """explain() builds the spec the sparse call itself uses (sparse.sparse_attention): inference for a no-grad
    call without lse, train for a grad-recording one, the plain forward bucket when lse is returned."""
    q = torch.randn(1, 2, 40, 16)
    lay = SparseLayout.sliding_window(40, 7, causal=True, block_size=16)
    with torch.no_grad():
        assert "inference (no-grad" in str(opsadv.explain("sparse_attention", q, q, q, lay))
        plain = opsadv.explain("sparse_attention", q, q, q, lay, return_lse=True)
        assert not plain.spec.inference and not plain.spec.train
    qg = q.clone().requires_grad_()
    assert "train (grad-recording" in str(opsadv.explain("sparse_attention", qg, q, q, lay))
