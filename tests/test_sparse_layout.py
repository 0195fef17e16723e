"""SparseLayout constructors vs naive element-by-element masks written independently here;
tile index (what kernels visit) vs the dense mask; validation; unpad/pad; reference op."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opsadv
from opsadv import SparseLayout
from opsadv.errors import InvalidArgumentError

SETTINGS = settings(max_examples=25, deadline=None)


def naive(sq, sk, rule):
    """Element-by-element boolean mask from a python predicate rule(i, j)."""
    return torch.tensor([[bool(rule(i, j)) for j in range(sk)] for i in range(sq)], dtype=torch.bool)


def assert_mask(layout, expected):
    got = layout.dense_mask()
    expected = expected.expand_as(got) if expected.dim() == got.dim() else expected.expand(got.shape)
    assert torch.equal(got, expected), f"{layout}: {int((got != expected).sum())} mismatches"


lengths = st.integers(1, 40)
block_sizes = st.sampled_from([1, 3, 4, 8, 16])


@SETTINGS
@given(sq=lengths, sk=lengths, left=st.integers(0, 12), right=st.integers(0, 12), causal=st.booleans(),
       ng=st.integers(0, 5), bs=block_sizes)
def test_sliding_window(sq, sk, left, right, causal, ng, bs):
    lay = SparseLayout.sliding_window(sq, (left, right), seq_k=sk, causal=causal, num_global=ng, block_size=bs)
    off = sk - sq

    def rule(i, j):
        ip = i + off
        ok = (ip - left <= j <= ip + right) or i < ng or j < ng
        return ok and (not causal or j <= ip)
    assert_mask(lay, naive(sq, sk, rule))
    assert lay.window == (left, right) and lay.causal == causal


@SETTINGS
@given(s=lengths, w=st.integers(0, 12), causal=st.booleans())
def test_sliding_window_int(s, w, causal):
    lay = SparseLayout.sliding_window(s, w, causal=causal, block_size=8)
    rule = (lambda i, j: i - w <= j <= i) if causal else (lambda i, j: abs(i - j) <= w)
    assert_mask(lay, naive(s, s, rule))


@SETTINGS
@given(s=lengths, ng=st.integers(0, 40), causal=st.booleans(), bs=block_sizes)
def test_global_tokens(s, ng, causal, bs):
    ng = min(ng, s)
    lay = SparseLayout.global_tokens(s, ng, causal=causal, block_size=bs)
    assert_mask(lay, naive(s, s, lambda i, j: (i < ng or j < ng) and (not causal or j <= i)))


@SETTINGS
@given(s=lengths, bs=st.sampled_from([1, 2, 4, 8]), dil=st.integers(1, 4), nb=st.one_of(st.none(), st.integers(0, 3)),
       local=st.integers(0, 2), causal=st.booleans())
def test_dilated(s, bs, dil, nb, local, causal):
    lay = SparseLayout.dilated(s, block_size=bs, dilation=dil, num_blocks=nb, local_blocks=local, causal=causal)

    def rule(i, j):
        p, q = i // bs, j // bs
        ok = abs(p - q) < local or ((p - q) % dil == 0 and (nb is None or abs(p - q) <= nb * dil))
        return ok and (not causal or j <= i)
    assert_mask(lay, naive(s, s, rule))


@SETTINGS
@given(s=lengths, bs=st.sampled_from([2, 4, 8]), wb=st.integers(0, 4), gb=st.integers(0, 2), rb=st.integers(0, 3),
       heads=st.integers(1, 3), seed=st.integers(0, 5), causal=st.booleans())
def test_bigbird(s, bs, wb, gb, rb, heads, seed, causal):
    lay = SparseLayout.bigbird(s, block_size=bs, window_blocks=wb, global_blocks=gb, random_blocks=rb,
                               heads=heads, seed=seed, causal=causal)
    n = -(-s // bs)
    bm = lay.block_mask[0]
    half = wb // 2
    band = naive(n, n, lambda p, q: p - half <= q <= p + (wb - 1 - half))
    extra = bm & ~band
    assert bool((bm | ~band).all()), "the band must be set"
    assert bool((extra.sum(-1) <= min(rb, n)).all()), "at most random_blocks extra blocks per row"
    assert lay.num_global == min(gb * bs, s)
    G = lay.num_global
    for h in range(heads):
        rule = lambda i, j: (bool(bm[h, i // bs, j // bs]) or i < G or j < G) and (not causal or j <= i)  # noqa: E731
        assert torch.equal(lay.dense_mask()[0, h if lay.block_mask.shape[1] > 1 else 0], naive(s, s, rule))
    again = SparseLayout.bigbird(s, block_size=bs, window_blocks=wb, global_blocks=gb, random_blocks=rb,
                                 heads=heads, seed=seed, causal=causal)
    assert again is lay, "constructors are cached"


@SETTINGS
@given(nq=st.integers(1, 6), nk=st.integers(1, 6), bs=st.sampled_from([1, 3, 4]), b=st.integers(1, 2),
       h=st.integers(1, 3), causal=st.booleans(), data=st.data())
def test_from_block_mask(nq, nk, bs, b, h, causal, data):
    sq = data.draw(st.integers((nq - 1) * bs + 1, nq * bs))
    sk = data.draw(st.integers((nk - 1) * bs + 1, nk * bs))
    bm = torch.rand(b, h, nq, nk) < 0.5
    lay = SparseLayout.from_block_mask(bm, block_size=bs, seq_q=sq, seq_k=sk, causal=causal)
    got = lay.dense_mask()
    off = sk - sq
    for bi in range(b):
        for hi in range(h):
            exp = naive(sq, sk, lambda i, j: bool(bm[bi, hi, i // bs, j // bs]) and (not causal or j <= i + off))
            assert torch.equal(got[bi, hi], exp)


def test_from_padding_mask_cached_by_content():
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    a = SparseLayout.from_padding_mask(m, block_size=2)
    assert SparseLayout.from_padding_mask(m.clone().bool(), block_size=2) is a
    m[0, 2] = 1                                   # a changed mask is a new layout; the old one is unaffected
    b = SparseLayout.from_padding_mask(m, block_size=2)
    assert b is not a and bool(b.key_padding_mask[0, 2]) and not bool(a.key_padding_mask[0, 2])


@SETTINGS
@given(b=st.integers(1, 3), s=lengths, causal=st.booleans(), data=st.data())
def test_from_padding_mask(b, s, causal, data):
    am = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=s, max_size=s), min_size=b, max_size=b)))
    lay = SparseLayout.from_padding_mask(am, causal=causal, block_size=4)
    got = lay.dense_mask()
    for bi in range(b):
        assert torch.equal(got[bi, 0], naive(s, s, lambda i, j: am[bi, j] == 1 and (not causal or j <= i)))


def _segments(seqlens):
    seg, pos = [], []
    for n, L in enumerate(seqlens):
        seg += [n] * L
        pos += list(range(L))
    return seg, pos


@SETTINGS
@given(seqlens=st.lists(st.integers(0, 12), min_size=1, max_size=5).filter(lambda x: sum(x) > 0),
       causal=st.booleans(), window=st.one_of(st.none(), st.integers(0, 5)), ng=st.integers(0, 3),
       bs=block_sizes)
def test_varlen(seqlens, causal, window, ng, bs):
    lay = SparseLayout.varlen(seqlens, causal=causal, window=window, num_global=ng, block_size=bs)
    seg, pos = _segments(seqlens)
    t = sum(seqlens)

    def rule(i, j):
        if seg[i] != seg[j] or (causal and j > i):
            return False
        if window is None and ng == 0:
            return True
        in_win = window is not None and (i - window <= j <= (i if causal else i + window))
        return in_win or pos[i] < ng or pos[j] < ng
    assert_mask(lay, naive(t, t, rule))
    assert lay.seqlens == list(seqlens)


@SETTINGS
@given(b=st.integers(1, 2), s=st.integers(1, 30), w=st.integers(0, 8), causal=st.booleans(), data=st.data())
def test_combine_window_and_padding(b, s, w, causal, data):
    am = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=s, max_size=s), min_size=b, max_size=b)))
    lay = SparseLayout.sliding_window(s, w, causal=causal, block_size=8).combine(
        SparseLayout.from_padding_mask(am, block_size=4))
    got = lay.dense_mask()
    assert lay.window is not None and lay.key_padding_mask is not None
    for bi in range(b):
        exp = naive(s, s, lambda i, j: am[bi, j] == 1 and (i - w <= j <= (i if causal else i + w)))
        assert torch.equal(got[bi, 0], exp)


@SETTINGS
@given(s=st.integers(1, 30), w1=st.integers(0, 6), w2=st.integers(0, 6), g=st.integers(0, 4))
def test_combine_or(s, w1, w2, g):
    a = SparseLayout.sliding_window(s, (w1, 0), causal=False, block_size=4)
    c = SparseLayout.global_tokens(s, min(g, s), window=(0, w2), block_size=8)
    lay = a.combine(c, "or")
    assert_mask(lay, naive(s, s, lambda i, j: i - w1 <= j <= i + w2 or i < g or j < g))


# ---- the tile index (what kernels visit) ------------------------------------------------------------
def _reconstruct(ti, n_rows, n_cols, transposed=False):
    rows, cols = (ti.t_rows, ti.t_cols) if transposed else (ti.rows, ti.cols)
    B, H = rows.shape[:2]
    any_ = torch.zeros(B, H, n_rows, n_cols, dtype=torch.bool)
    full = torch.zeros_like(any_)
    for b in range(B):
        for h in range(H):
            for r in range(n_rows):
                p, n = rows[b, h, r].tolist()
                c = cols[b, h, r].tolist()
                assert len(set(c[:n])) == n
                any_[b, h, r, c[:n]] = True
                full[b, h, r, c[p:n]] = True
    return any_, full


LAYOUTS = {
    "window": lambda: SparseLayout.sliding_window(77, 13, causal=True, block_size=16),
    "window_cross": lambda: SparseLayout.sliding_window(45, (5, 9), causal=False, seq_k=71, block_size=8),
    "global_window": lambda: SparseLayout.global_tokens(90, 5, window=7, block_size=16),
    "dilated": lambda: SparseLayout.dilated(83, block_size=16, dilation=3, causal=True),
    "bigbird": lambda: SparseLayout.bigbird(70, block_size=8, heads=2, causal=True),
    "varlen": lambda: SparseLayout.varlen([30, 0, 45, 1, 9], causal=True, num_global=2, block_size=32),
    "varlen_window": lambda: SparseLayout.varlen([17, 33, 20], window=6, block_size=16),
    "padding": lambda: SparseLayout.from_padding_mask(
        torch.tensor([[1] * 40 + [0] * 25, [0] * 20 + [1] * 45]), causal=True, block_size=16),
    "block_mask_bs24": lambda: SparseLayout.from_block_mask(torch.rand(2, 1, 3, 4) < 0.5, block_size=24,
                                                            seq_q=60, seq_k=90),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("tile", [(16, 16), (32, 16), (16, 64)])
def test_tile_index_covers_dense_mask(name, tile):
    lay = LAYOUTS[name]()
    M, N = tile
    dm = lay.dense_mask()
    sq, sk = lay.seq_q, lay.seq_k
    nq, nk = -(-sq // M), -(-sk // N)
    padded = torch.zeros(*dm.shape[:2], nq * M, nk * N, dtype=torch.bool)
    padded[..., :sq, :sk] = dm
    t = padded.reshape(*dm.shape[:2], nq, M, nk, N)
    need, all_set = t.any(3).any(-1), t.all(3).all(-1)     # tiles with any / every pair allowed
    ti = lay.tile_index(M, N)
    any_, full = _reconstruct(ti, nq, nk)
    need, all_set = need.expand_as(any_), all_set.expand_as(any_)
    assert bool((need <= any_).all()), "a tile with allowed pairs is missing"
    assert bool((full <= all_set).all()), "a tile marked full has masked pairs"
    t_any, t_full = _reconstruct(ti, nk, nq, transposed=True)
    assert torch.equal(t_any, any_.transpose(-1, -2)) and torch.equal(t_full, full.transpose(-1, -2))
    assert ti is lay.tile_index(M, N), "tile index is cached"
    if name in ("window", "varlen_window"):   # sparse patterns visit only a fraction
        assert ti.tiles < ti.total_tiles



@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("tile", [(16, 16), (32, 16), (16, 64)])
@pytest.mark.parametrize("transposed", [False, True])
def test_full_run_flag_matches_the_lists(name, tile, transposed):
    """full_run (kernels may walk full tiles as a column range) holds exactly when every row's full
    tiles are consecutive columns; t_full_run the same for the transposed lists (dK/dV)."""
    lay = LAYOUTS[name]()
    ti = lay.tile_index(*tile)
    rows, cols = (ti.t_rows, ti.t_cols) if transposed else (ti.rows, ti.cols)
    rows, cols = rows.reshape(-1, 2), cols.reshape(-1, cols.shape[-1])
    expect = True
    for (n_part, n_all), c in zip(rows.tolist(), cols.tolist()):
        full = c[n_part:n_all]
        if full and full != list(range(full[0], full[0] + len(full))):
            expect = False
    assert (ti.t_full_run if transposed else ti.full_run) == expect


def test_full_run_flag_examples():
    assert SparseLayout.sliding_window(300, 70, causal=True, block_size=16).tile_index(32, 16).full_run
    assert SparseLayout.varlen([50, 3, 90], causal=True, block_size=16).tile_index(16, 16).full_run
    # global key columns plus a window band far from them: two runs in later rows
    assert not SparseLayout.global_tokens(300, 16, window=20, block_size=16).tile_index(16, 16).full_run
    assert SparseLayout.sliding_window(300, 70, causal=True, block_size=16).tile_index(32, 16).t_full_run
    # by key tile: the global query rows and the band are two runs too
    assert not SparseLayout.global_tokens(300, 16, window=20, block_size=16).tile_index(16, 16).t_full_run

def test_varlen_work_is_proportional_to_tokens():
    lay = SparseLayout.varlen([64] * 8, block_size=64)
    ti = lay.tile_index(64, 64)
    assert ti.tiles == 8 and ti.total_tiles == 64     # only the diagonal blocks


# ---- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, arg", [
    (lambda: SparseLayout.sliding_window(10, -1), "window"),
    (lambda: SparseLayout.sliding_window(10, (1, 2, 3)), "window"),
    (lambda: SparseLayout.sliding_window(10, 3, block_size=0), "block_size"),
    (lambda: SparseLayout.global_tokens(10, 11), "num_global"),
    (lambda: SparseLayout.dilated(10, block_size=2, dilation=0), "dilation"),
    (lambda: SparseLayout.varlen([]), "seqlens"),
    (lambda: SparseLayout.varlen([3, -1]), "seqlens[i]"),
    (lambda: SparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), block_size=4, seq_q=20), "layout.block_mask"),
    (lambda: SparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.int8), block_size=4), "block_mask"),
    (lambda: SparseLayout(4, 4, 2, torch.ones(1, 1, 2, 2, dtype=torch.bool), cu_seqlens=torch.tensor([0, 3])),
     "layout.cu_seqlens"),
    (lambda: SparseLayout(4, 4, 2, torch.ones(1, 1, 2, 2, dtype=torch.bool),
                          key_padding_mask=torch.ones(1, 5, dtype=torch.bool)), "layout.key_padding_mask"),
    (lambda: SparseLayout.sliding_window(8, 2).combine(SparseLayout.global_tokens(8, 1)), "combine(other, how='and')"),
    (lambda: SparseLayout.sliding_window(8, 2).combine(SparseLayout.dense(9)), "combine(other)"),
    (lambda: SparseLayout.dense(8).with_(nonsense=1), "with_"),
])
def test_validation_errors(make, arg):
    with pytest.raises(InvalidArgumentError) as e:
        make()
    assert e.value.arg == arg and "sparse_attention" in str(e.value)


def test_op_validation_errors(reference_backend):
    q = torch.randn(2, 2, 8, 16)
    with pytest.raises(InvalidArgumentError, match="layout"):
        opsadv.ops.sparse_attention(q, q, q, SparseLayout.dense(9))
    with pytest.raises(InvalidArgumentError, match="batch 1"):
        opsadv.ops.sparse_attention(q, q, q, SparseLayout.varlen([3, 5]))


# ---- unpad / pad ------------------------------------------------------------------------------------
def test_unpad_pad_roundtrip_and_varlen_matches_padded(reference_backend, seed):
    am = torch.tensor([[1] * 7 + [0] * 3, [0] * 2 + [1] * 8, [1] * 10])   # right, left and no padding
    b, h, s, d = 3, 2, 10, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    (qp, info), (kp, _), (vp, _) = (SparseLayout.unpad(t, am) for t in (q, k, v))
    assert qp.shape == (1, h, 25, d) and info.seqlens == (7, 8, 10)
    keep = am.bool()[:, None, :, None].expand_as(q)
    assert torch.equal(SparseLayout.pad(qp, info), torch.where(keep, q, torch.zeros_like(q)))
    out_packed = opsadv.ops.sparse_attention(qp, kp, vp, info.layout(causal=True, block_size=4))
    out_padded = opsadv.ops.sparse_attention(q, k, v, SparseLayout.from_padding_mask(am, causal=True, block_size=4))
    out = SparseLayout.pad(out_packed, info)
    real = am.bool()
    # real query rows agree; left-padded rows differ only where the padded layout sees no key
    torch.testing.assert_close(out.transpose(1, 2)[real], out_padded.transpose(1, 2)[real])
    x = torch.randn(b, s, 5)                                  # (b, s, hidden) with seq_dim=1
    xp, info2 = SparseLayout.unpad(x, am, seq_dim=1)
    assert xp.shape == (1, 25, 5) and torch.equal(SparseLayout.pad(xp, info2, seq_dim=1)[real], x[real])


def test_reference_fully_masked_rows_are_zero(reference_backend):
    lay = SparseLayout.from_padding_mask(torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0]]), block_size=2)
    q = torch.randn(2, 1, 4, 8)
    out, lse = opsadv.ops.sparse_attention(q, q, q, lay, return_lse=True)
    assert not torch.isnan(out).any() and torch.equal(out[0], torch.zeros_like(out[0]))
    assert bool(torch.isneginf(lse[0]).all()) and bool(torch.isfinite(lse[1]).all())
    assert math.isclose(lay.density(), 4 * 2 / (2 * 16))


def test_tile_index_cache_follows_values_not_tensor_objects():
    """A compiled graph hands each layer's call a fresh view of one mask: the tile index is built once for those
    (it read the mask back on the host for every layer, fwd and bwd), and rebuilt when the values may differ: the
    mask written in place, or another tensor of the same shape."""
    from opsadv.core import sparse_tiles as ST
    kpm = torch.ones(2, 100, dtype=torch.bool)
    kpm[1, 70:] = False
    bm = torch.ones(1, 1, 7, 7, dtype=torch.bool)
    args = (16, True, -1, -1, 0, 100, 100, 16, 32)

    def build(m, k):
        return ST.tile_index(m, k, None, *args)

    ti = build(bm, kpm)
    assert build(bm.view(bm.shape), kpm.view(kpm.shape)) is ti
    assert build(bm[:], kpm.as_strided(kpm.shape, kpm.stride())) is ti
    other = kpm.clone()
    other[0, 50:] = False
    t2 = build(bm, other)
    assert t2 is not ti and t2.tiles < ti.tiles
    kpm[0, 40:] = False                               # in place: the version moves, the old lists are stale
    t3 = build(bm, kpm)
    assert t3 is not ti and t3.tiles < ti.tiles
    # a later tensor is never mistaken for a freed one, even where its storage lands at the freed address
    gone = torch.zeros(2, 100, dtype=torch.bool)
    gone[:, :10] = True
    t4 = build(bm, gone)
    del gone
    fresh = torch.ones(2, 100, dtype=torch.bool)
    assert build(bm, fresh) is not t4


def test_live_segments_read_once_per_values():
    """cu_seqlens of a compiled packed batch reach each layer as a fresh view: one host read serves them all, and
    values written in place are read again."""
    from opsadv.core import sparse_tiles as ST
    cu = torch.tensor([0, 5, 9, 9, 9], dtype=torch.int32)
    assert ST.live_segments(cu).tolist() == [0, 5, 9]
    assert ST._live_cache.get((cu.view(cu.shape),), ()) == 2
    assert ST.live_segments(cu[:]).tolist() == [0, 5, 9]
    cu[3:] = torch.tensor([11, 12], dtype=torch.int32)
    assert ST._live_cache.get((cu,), ()) is None
    assert ST.live_segments(cu).tolist() == [0, 5, 9, 11, 12]
