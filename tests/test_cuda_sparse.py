"""Conformance of the cuda backend's Triton sparse attention kernels (run by the Triton
interpreter on CPU here) against the reference backend: every layout pattern, odd lengths,
GQA, forward and backward, poisoned output buffers, fully masked rows."""
from types import SimpleNamespace

import pytest
import torch

import opsadv
from opsadv import SparseLayout
from opsadv.backends.triton_common.profiles import interpreter_profile
from opsadv.core import dispatch

from conftest import rel_err, requires_gpu

sparse_mod = pytest.importorskip("opsadv.backends.triton_common.sparse_attention.sparse")
triton = pytest.importorskip("triton")
tl = triton.language

PAD = torch.tensor([[1] * 50 + [0] * 17, [0] * 20 + [1] * 47])
PATTERNS = {   # name -> (layout factory, batch[, query heads])
    "window_causal": (lambda: SparseLayout.sliding_window(97, 21, causal=True, block_size=16), 1),
    "window_cross": (lambda: SparseLayout.sliding_window(45, (7, 11), causal=False, seq_k=83, block_size=32), 1),
    "global_window": (lambda: SparseLayout.global_tokens(83, 5, window=9, block_size=16), 1),
    "dilated": (lambda: SparseLayout.dilated(71, block_size=16, dilation=2, causal=True), 1),
    "bigbird_heads": (lambda: SparseLayout.bigbird(77, block_size=16, heads=4, random_blocks=1, causal=False), 1, 4),
    "block_mask_batch": (lambda: SparseLayout.from_block_mask(torch.rand(2, 1, 3, 5, generator=torch.Generator()
                                                                         .manual_seed(3)) < 0.5,
                                                              block_size=24, seq_q=65, seq_k=103), 2),
    "padding_causal": (lambda: SparseLayout.from_padding_mask(PAD, causal=True, block_size=16), 2),
    "window_padding": (lambda: SparseLayout.sliding_window(67, 9, causal=False, block_size=16).combine(
        SparseLayout.from_padding_mask(PAD, block_size=16)), 2),
    "varlen": (lambda: SparseLayout.varlen([31, 0, 45, 1, 20], block_size=16), 1),
    "varlen_causal_global": (lambda: SparseLayout.varlen([30, 47, 3, 17], causal=True, num_global=2, block_size=32), 1),
    "varlen_window": (lambda: SparseLayout.varlen([40, 57], window=(5, 3), block_size=16), 1),
}


@pytest.fixture
def poison(monkeypatch):
    """Every output buffer starts as NaN: the kernels must write each element."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")


def _run(backend, layout, q, k, v, dout, forward_only=False, **policy):
    with opsadv.use_backend(backend, **policy):
        qq, kk, vv = (t.detach().clone().requires_grad_(not forward_only) for t in (q, k, v))
        with opsadv.trace() as tr:
            out, lse = opsadv.ops.sparse_attention(qq, kk, vv, layout, return_lse=True)
            if forward_only:
                return (out, lse), tr.counts
            out.backward(dout)
    return (out, lse, qq.grad, kk.grad, vv.grad), tr.counts


def _check(layout, b, hq, hk, d, dtype=torch.float16, tol=2e-2, device="cpu", forward_only=False, **policy):
    """The cuda backend's out, lse and (unless forward_only) dq / dk / dv against the reference's in float32.
    forward_only: for forward kernel variants -- the backward reads only the saved out and lse, which are checked."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, hq, layout.seq_q, d, generator=g).to(device, dtype)
    k = torch.randn(b, hk, layout.seq_k, d, generator=g).to(device, dtype)
    v = torch.randn(b, hk, layout.seq_k, d, generator=g).to(device, dtype)
    dout = torch.randn(b, hq, layout.seq_q, d, generator=g).to(device, dtype)
    got, counts = _run("cuda", layout, q, k, v, dout, forward_only, **policy)
    assert any("cuda.triton.sparse_attention" in c for c in counts), counts
    # the oracle in float32 on the same (half-rounded) inputs
    ref, _ = _run("reference", layout, q.float(), k.float(), v.float(), dout.float(), forward_only)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, x, y in zip(names, got, ref):
        assert x.shape == y.shape and not torch.isnan(x).any(), f"{name}: NaN"
        if name == "lse":
            assert torch.equal(torch.isneginf(x), torch.isneginf(y)), "lse = -inf exactly on fully masked rows"
            x, y = x[torch.isfinite(y)], y[torch.isfinite(y)]
        small = x.numel() == 0 or (x.double() - y.double()).abs().max() < 1e-3   # e.g. dq of a one-key row is 0
        assert rel_err(x, y) < tol or small, f"{name}: rel err {rel_err(x, y):.2e}"
    return got, ref


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_patterns_fwd_bwd(name, poison):
    make, b, *heads = PATTERNS[name]
    hq = heads[0] if heads else 2
    _check(make(), b, hq=hq, hk=hq // 2, d=32)          # GQA 2:1 throughout


@pytest.mark.parametrize("hq, hk, d", [(4, 1, 64), (3, 3, 16), (1, 1, 256)])
def test_head_dims_and_groups(hq, hk, d, poison):
    _check(SparseLayout.sliding_window(49, 13, causal=True, block_size=16), 1, hq, hk, d)


def test_head_dim_96_padded(poison):
    _check(SparseLayout.varlen([19, 22], causal=True, block_size=16), 1, 1, 1, 96)


def test_single_token_and_fully_masked_rows(poison):
    lay = SparseLayout.from_padding_mask(torch.tensor([[0, 0, 0], [1, 0, 1]]), block_size=16)
    got, _ = _check(lay, 2, 2, 2, 16)
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0])) and bool(torch.isneginf(got[1][0]).all())
    assert torch.equal(got[2][0], torch.zeros_like(got[2][0]))
    _check(SparseLayout.dense(1, causal=True, block_size=16), 1, 1, 1, 16)


def test_fp32_via_precision_policy(poison):
    lay = SparseLayout.sliding_window(33, 7, causal=True, block_size=16)
    q = torch.randn(1, 2, 33, 32)
    with opsadv.use_backend("cuda"):
        with pytest.raises(opsadv.errors.NoKernelError, match="precision policy"):
            opsadv.ops.sparse_attention(q, q, q, lay)
    with opsadv.use_backend("cuda", precision="fp16"):
        out = opsadv.ops.sparse_attention(q, q, q, lay)
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.sparse_attention(q, q, q, lay)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 2e-2


def test_noncontiguous_inputs(poison):
    lay = SparseLayout.sliding_window(40, 9, causal=True, block_size=16)
    x = torch.randn(1, 40, 6, 32, dtype=torch.float16)           # (b, s, 3 * h, d) -> views
    q, k, v = (t.transpose(1, 2) for t in x.split(2, dim=2))
    with opsadv.use_backend("cuda"):
        out = opsadv.ops.sparse_attention(q, k, v, lay)
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.sparse_attention(q.float(), k.float(), v.float(), lay)
    assert rel_err(out, ref) < 2e-2


def test_explain_names_the_kernel():
    lay = SparseLayout.varlen([10, 20], block_size=16)
    q = torch.randn(1, 2, 30, 32, dtype=torch.float16)
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain("sparse_attention", q, q, q, lay)
    assert exp.chosen == "cuda.triton.sparse_attention", str(exp)
    dispatch.clear_cache()


def test_odd_block_size_rejected_with_reason():
    from opsadv.core.kernel import CallSpec
    spec = CallSpec("sparse_attention", "cpu", torch.float16, frozenset(), (7, 16384, 16384), head_dim=64,
                    shapes=((1, 1, 16384, 64), (1, 1, 16384, 64)))
    why = sparse_mod._check(spec, None)
    assert why and "multiple of 16" in why[0]


def test_backward_keeps_the_forward_policy_on_another_thread(poison):
    """Autograd runs CUDA backward on a worker thread that does not see `with use_backend` scopes:
    the op must carry the forward's policy into its backward."""
    import threading
    lay = SparseLayout.sliding_window(20, 5, causal=True, block_size=16)
    q = torch.randn(1, 1, 20, 16, requires_grad=True)
    opsadv.use_backend("cuda")               # process default: fp32 has no kernel there (no precision policy)
    with opsadv.use_backend("reference"):
        out = opsadv.ops.sparse_attention(q, q, q, lay)
        errors = []
        t = threading.Thread(target=lambda: _try(lambda: out.sum().backward(), errors))
        t.start()
        t.join()
    assert not errors, errors
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _try(fn, errors):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        errors.append(e)


@pytest.mark.parametrize("threshold", [8.0, 0.5])
@pytest.mark.parametrize("name", ["window_causal", "padding_causal", "varlen_causal_global", "bigbird_heads"])
def test_conditional_rescale_variant(name, threshold, poison, monkeypatch):
    """A profile's forward tile may carry a rescale threshold (5th element): same function."""
    base = sparse_mod.tiles_for

    def with_flag(profile, head_dim):
        fwd, dq, dkdv = base(profile, head_dim)
        return (*fwd[:4], threshold), dq, dkdv
    monkeypatch.setattr(sparse_mod, "tiles_for", with_flag)
    make, b, *heads = PATTERNS[name]
    hq = heads[0] if heads else 2
    _check(make(), b, hq=hq, hk=hq // 2, d=32, forward_only=True)


LOOP_PATTERNS = {   # PATTERNS plus ones with several full tiles per row at the interpreter's 32x16 tile
    **PATTERNS,
    "window_wide": (lambda: SparseLayout.sliding_window(150, 70, causal=True, block_size=16), 1),
    "dense_causal_cross": (lambda: SparseLayout.dense(70, causal=True, seq_k=101, block_size=16), 1),
}


LOOP_VARIANT_PATTERNS = ["window_causal", "window_wide", "dense_causal_cross", "global_window", "bigbird_heads",
                         "block_mask_batch", "padding_causal", "varlen", "varlen_causal_global"]


@pytest.mark.parametrize("loop", ["list", "prefetch", "run", "fused", "fused_run"])
@pytest.mark.parametrize("name, reverse", [(n, False) for n in LOOP_VARIANT_PATTERNS]
                         + [(n, True) for n in ("window_causal", "dense_causal_cross", "varlen_causal_global")])
def test_forward_loop_variants(name, loop, reverse, poison, monkeypatch):
    """Every forward loop variant (sparse.LOOP_IDS; "run" falls back to "prefetch" when full tiles are
    not one run per row) computes the same function (out and lse through the op); the reversed program order
    (last row tiles first) on a window, a cross-length causal and a packed varlen layout (suite time: the order
    only changes which q tile a program id takes)."""
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": loop, "reverse": reverse})
    make, b, *heads = LOOP_PATTERNS[name]
    hq = heads[0] if heads else 2
    _check(make(), b, hq=hq, hk=hq // 2, d=32, forward_only=True)


@pytest.mark.parametrize("loop", ["list", "run", "fused_run", "band"])
@pytest.mark.parametrize("name", ["window_causal", "dense_causal_cross", "block_mask_batch", "padding_causal",
                                  "varlen_causal_global"])
def test_forward_tma_loads(name, loop, poison, monkeypatch):
    """K/V tiles through (b, h_kv, s_k, d) descriptors (variant "tma"; the interpreter runs descriptor loads): the
    same function as the pointer loads, key tails past s_k included (zero rows, masked in partial tiles)."""
    made = []
    real = sparse_mod.desc_bhsd
    monkeypatch.setattr(sparse_mod, "desc_bhsd", lambda t, rows: made.append(rows) or real(t, rows))
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": loop, "reverse": False, "tma": True})
    make, b, *heads = LOOP_PATTERNS[name]
    hq = heads[0] if heads else 2
    _check(make(), b, hq=hq, hk=hq // 2, d=32, forward_only=True)
    assert made, "the forward did not take the descriptor path"


def test_forward_tma_loads_not_taken_for_a_padded_head_dim(poison, monkeypatch):
    """d=96 pads to 128 in registers: no descriptor (its box would read past the row), pointer loads instead."""
    monkeypatch.setattr(sparse_mod, "desc_bhsd", lambda t, rows: pytest.fail("descriptor for a padded head dim"))
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": "run", "reverse": False, "tma": True})
    _check(SparseLayout.sliding_window(45, (7, 11), causal=False, seq_k=83, block_size=32), 1, 2, 1, 96)


@pytest.mark.parametrize("loop", ["run", "fused", "fused_run", "band_fused"])
def test_forward_loop_variants_odd_head_dim_and_tail(loop, poison, monkeypatch):
    """A key tail past s_k inside a partial tile (fused: clamped K/V rows) and a padded head dim."""
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": loop, "reverse": False})
    _check(SparseLayout.sliding_window(45, (7, 11), causal=False, seq_k=83, block_size=32), 1, 2, 1, 96,
           forward_only=True)
    _check(SparseLayout.dense(37, causal=True, block_size=16), 1, 3, 3, 16, forward_only=True)


BAND_LAYOUTS = {   # band layouts at the interpreter's 32x16 forward tile: edges inside tiles, several masked
    # tiles above and below the full run, rows that see nothing (s_q > s_k, causal), one query row, no full tile
    "diagonal": lambda: SparseLayout.sliding_window(53, (0, 0), causal=False, block_size=16),
    "narrow_causal": lambda: SparseLayout.sliding_window(77, 3, causal=True, block_size=16),
    "wide_two_sided": lambda: SparseLayout.sliding_window(70, (37, 29), causal=False, seq_k=131, block_size=16),
    "window_sq_gt_sk": lambda: SparseLayout.sliding_window(90, 20, causal=True, seq_k=41, block_size=16),
    "causal_sq_gt_sk": lambda: SparseLayout.dense(75, causal=True, seq_k=33, block_size=16),
    "dense_noncausal": lambda: SparseLayout.dense(61, seq_k=99, block_size=16),
    "decode_row": lambda: SparseLayout.sliding_window(1, 40, causal=True, seq_k=87, block_size=16),
    "window_causal_right": lambda: SparseLayout.sliding_window(66, (17, 9), causal=True, block_size=16),
    # a window over an all-True block mask: the band is the whole causal triangle (band_persist must not take the
    # window's width for it)
    "window_over_dense": lambda: SparseLayout.dense(70, causal=True, block_size=16).with_(window=(5, 0)),
}


@triton.jit
def _band_probe_kernel(out_ptr, SQ, SK, OFF, WL, WR, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, BM_MODE: tl.constexpr):
    pid = tl.program_id(0)
    r = sparse_mod._band_tiles(pid, SQ, SK, OFF, WL, WR, BLOCK_M, BLOCK_N, CAUSAL, BM_MODE)
    for i in tl.static_range(6):
        tl.store(out_ptr + pid * 6 + i, r[i])


@pytest.mark.parametrize("name", sorted(BAND_LAYOUTS))
def test_band_tiles_match_the_dense_mask(name):
    """_band_tiles (LOOP "band") visits exactly the tiles holding an allowed pair, and calls full only tiles whose
    every in-bounds (row, key) pair is allowed: checked against the layout's dense boolean mask."""
    lay = BAND_LAYOUTS[name]()
    bm, bn = 32, 16
    ti = lay.tile_index(bm, bn)
    assert sparse_mod._is_band(ti, lay.cu_seqlens, lay.key_padding_mask, lay.window_left, lay.num_global)
    n_m = -(-lay.seq_q // bm)
    out = torch.full((n_m, 6), -99, dtype=torch.int32)
    _band_probe_kernel[(n_m,)](out, lay.seq_q, lay.seq_k, lay.seq_k - lay.seq_q, lay.window_left, lay.window_right,
                               BLOCK_M=bm, BLOCK_N=bn, CAUSAL=lay.causal, BM_MODE=ti.bm_mode)
    mask = lay.dense_mask()[0, 0]
    for m in range(n_m):
        kt_lo, n_low, full_lo, n_full, hi_lo, n_high = out[m].tolist()
        rows = mask[m * bm:(m + 1) * bm]
        want = {kt for kt in range(-(-lay.seq_k // bn)) if rows[:, kt * bn:(kt + 1) * bn].any()}
        masked = set(range(kt_lo, kt_lo + n_low)) | set(range(hi_lo, hi_lo + n_high))
        full = set(range(full_lo, full_lo + n_full))
        assert not masked & full and masked | full == want, (m, out[m].tolist(), sorted(want))
        for kt in full:
            assert kt * bn + bn <= lay.seq_k and rows[:, kt * bn:(kt + 1) * bn].all(), (m, kt)


@pytest.mark.parametrize("loop", ["band", "band_fused", "band_persist"])
@pytest.mark.parametrize("name", sorted(BAND_LAYOUTS))
def test_forward_band_loop(name, loop, poison, monkeypatch):
    """LOOP "band" / "band_fused" / "band_persist" (tiles derived in the kernel, no index loads) on band layouts with
    odd edges: the reference's function, out and lse through the op (GQA 2:1, a padded head dim too)."""
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": loop, "reverse": False})
    _check(BAND_LAYOUTS[name](), 1, hq=2, hk=1, d=32, forward_only=True)
    if name == "wide_two_sided":
        _check(BAND_LAYOUTS[name](), 2, hq=3, hk=3, d=96, forward_only=True)
    if name == "window_causal_right":            # the last row tiles first (REVERSE) takes the same band tiles
        monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": loop, "reverse": True})
        _check(BAND_LAYOUTS[name](), 1, hq=2, hk=1, d=32, forward_only=True)


@pytest.mark.parametrize("name", sorted(BAND_LAYOUTS))
def test_band_width_tiles_is_the_widest_row_tile(name):
    """The persistent band kernel runs band_width_tiles() tiles per item: exactly the most any row tile visits
    (fewer would drop keys, more costs dummy tiles), from host arithmetic alone."""
    from opsadv.backends.triton_common.sparse_attention.band_persist import band_width_tiles
    lay = BAND_LAYOUTS[name]()
    bm, bn = 32, 16
    ti = lay.tile_index(bm, bn)
    n_m = -(-lay.seq_q // bm)
    out = torch.full((n_m, 6), -99, dtype=torch.int32)
    _band_probe_kernel[(n_m,)](out, lay.seq_q, lay.seq_k, lay.seq_k - lay.seq_q, lay.window_left, lay.window_right,
                               BLOCK_M=bm, BLOCK_N=bn, CAUSAL=lay.causal, BM_MODE=ti.bm_mode)
    widest = int((out[:, 1] + out[:, 3] + out[:, 5]).max())
    if lay.window_left >= 0 and ti.bm_mode == 0:     # the layouts band_persist takes
        assert band_width_tiles(lay.seq_q, lay.seq_k, lay.window_left, lay.window_right, lay.causal, bm, bn) == widest
    assert widest == int(ti.rows[..., 1].max())


def _fwd_loops(monkeypatch) -> list:
    """The LOOP of each _sparse_fwd launch from now on (the kernel still runs)."""
    seen = []
    real = sparse_mod._sparse_fwd

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw["LOOP"])
                return real[grid](*a, **kw)
            return launch
    monkeypatch.setattr(sparse_mod, "_sparse_fwd", Spy())
    return seen


def _persist_grids(monkeypatch) -> list:
    """The grids the persistent band kernel is launched with from now on (it still runs)."""
    from opsadv.backends.triton_common.sparse_attention import band_persist as P
    ran = []
    real = P._sparse_fwd_band_persist

    class Spy:
        def __getitem__(self, grid):
            ran.append(grid)
            return real[grid]
    monkeypatch.setattr(P, "_sparse_fwd_band_persist", Spy())
    return ran


@pytest.mark.parametrize("tma", [False, "contiguous"])
@pytest.mark.parametrize("name", ["window_causal", "window_wide", "window_cross"])
def test_forward_band_persist(name, tma, poison, monkeypatch):
    """The persistent band forward (3 programs under the interpreter, so each walks several (head, q tile) items,
    with leading dummy tiles where a row tile is narrower than the widest): the reference's function, with K/V
    through descriptors or pointers; the kernel is the one that ran."""
    from opsadv.backends.triton_common.sparse_attention import band_persist as P
    ran = _persist_grids(monkeypatch)
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": "band_persist", "reverse": False, "tma": tma})
    make, b, *heads = LOOP_PATTERNS[name]
    _check(make(), b, hq=4, hk=2, d=32, forward_only=True)
    assert ran and ran[0] == (P.INTERPRETER_PROGRAMS,)


def test_default_takes_the_persistent_kernel_for_narrow_bands(monkeypatch):
    """FWD_DEFAULT: a band of <= PERSIST_MAX_TILES key tiles runs the persistent kernel, a wider one LOOP "band"
    (the interpreter's 32x16 tile); the reference's function either way."""
    from opsadv.backends.triton_common.sparse_attention import band_persist as P
    persist, loops = _persist_grids(monkeypatch), _fwd_loops(monkeypatch)
    narrow = SparseLayout.sliding_window(150, 20, causal=True, block_size=16)
    assert P.band_width_tiles(150, 150, 20, 0, True, 32, 16) <= sparse_mod.PERSIST_MAX_TILES
    _check(narrow, 1, hq=4, hk=2, d=32)
    assert persist and not loops
    persist.clear()
    wide, _ = LOOP_PATTERNS["window_wide"]
    assert P.band_width_tiles(150, 150, 70, 0, True, 32, 16) > sparse_mod.PERSIST_MAX_TILES
    _check(wide(), 1, hq=4, hk=2, d=32)
    assert not persist and loops == [5]


def test_band_persist_grid_follows_the_compiled_kernel():
    """The persistent grid's programs per SM come from the compiled kernel's shared memory and registers (sm_90
    compiles of 64x64 d128 kernels: 155,672 B / 219 registers -> 1, 106,512 / 163 and 114,712 / 179 -> 2; registers
    bind at 8 warps x 255)."""
    from opsadv.backends.triton_common.sparse_attention.band_persist import resident_per_sm
    assert resident_per_sm(155672, 219, 4) == 1
    assert resident_per_sm(106512, 163, 4) == 2 and resident_per_sm(114712, 179, 4) == 2
    assert resident_per_sm(40000, 255, 8) == 1 and resident_per_sm(300000, 32, 4) == 1


def test_band_loop_only_for_band_layouts(monkeypatch):
    """Globals, key padding, packed segments or a mixed block mask are not bands: the kernel gets LOOP "run" (or the
    prefetched list where full tiles are not one run) instead of 5."""
    seen = _fwd_loops(monkeypatch)
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": "band", "reverse": False})
    for name, band in (("window_causal", True), ("global_window", False), ("padding_causal", False),
                       ("varlen", False), ("block_mask_batch", False)):
        make, b, *heads = LOOP_PATTERNS[name]
        hq = heads[0] if heads else 2
        seen.clear()
        _check(make(), b, hq=hq, hk=hq // 2, d=32)
        assert seen and (seen[0] == 5) == band and seen[0] in (1, 2, 5), (name, seen)


def test_long_row_tile_selection(monkeypatch):
    """The profile's long-row tile applies only to long, contiguous rows without segments / padding / mixed block
    masks, and never when the profile pins bare sparse tiles or under the seed's tile_size."""
    prof = SimpleNamespace(name="p", tiles={"sparse_attention": dict(sparse_mod.DEFAULT_TILES,
                                                                     long_row=((32, 32, 4, 1), 90))}, extra={})
    win = SparseLayout.sliding_window(300, 80, causal=True, block_size=16)
    ti = win.tile_index(32, 16)

    def pick(lay, ti_, p=prof):
        return sparse_mod._long_row_tile(p, 32, ti_, 16, lay.cu_seqlens, lay.key_padding_mask)
    assert pick(win, ti) == (32, 32, 4, 1)
    short = SparseLayout.sliding_window(300, 20, causal=True, block_size=16)
    assert pick(short, short.tile_index(32, 16)) is None
    vl = SparseLayout.varlen([150, 150], causal=True, block_size=16)
    assert pick(vl, vl.tile_index(32, 16)) is None
    glob = SparseLayout.global_tokens(300, 16, window=80, block_size=16)        # full tiles not one run
    assert pick(glob, glob.tile_index(32, 16)) is None
    pinned = SimpleNamespace(name="p", tiles={"sparse_attention": ((32, 16, 4, 1),) * 3})
    assert pick(win, ti, pinned) is None
    assert pick(win, ti, SimpleNamespace(name="p", tiles={}, extra={})) is None        # no long-row tile declared
    assert pick(win, ti, SimpleNamespace(name="p[tile<=64]", tiles=prof.tiles, extra={"tile_size": 64})) is None


_LONG_ROW_TILE = sparse_mod._long_row_tile


def _long_row_tile_on(monkeypatch, tile):
    """The active profile's long-row tile is `tile` (from one mean key per row on; None: no long-row tile)."""
    rows = SimpleNamespace(name="long_row", tiles={"sparse_attention": {"long_row": (tile, 1)} if tile else {}},
                           extra={})
    monkeypatch.setattr(sparse_mod, "_long_row_tile", lambda profile, *args: _LONG_ROW_TILE(rows, *args))


@pytest.mark.parametrize("name", ["window_wide", "dense_causal_cross", "window_cross"])
def test_long_row_tile_path(name, poison, monkeypatch):
    """The forward with the long-row tile switched on (a tile index rebuilt at another shape): same function."""
    _long_row_tile_on(monkeypatch, (16, 32, 4, 1))
    make, b, *heads = LOOP_PATTERNS[name]
    lay = make()
    ti = lay.tile_index(32, 16)
    if name != "window_cross":
        assert sparse_mod._long_row_tile(SimpleNamespace(name="interpreter", tiles={}), 32, ti, 16, None, None)
    _check(lay, b, hq=2, hk=1, d=32)


class _LoopSpy:
    """Stands in for a backward kernel: records the LOOP each launch got, then launches it."""
    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(kw["LOOP"])
            return self.kernel[grid](*args, **kw)
        return launch


BWD_PATTERNS = {   # LOOP_PATTERNS plus full-tile runs of 3-10 tiles at the interpreter's dQ / dK/dV tiles
    **LOOP_PATTERNS,
    "window_long": (lambda: SparseLayout.sliding_window(201, 120, causal=True, block_size=16), 1),
    "window_long_bidir": (lambda: SparseLayout.sliding_window(151, (60, 50), causal=False, block_size=16), 1),
    # global columns and the window band: full tiles in two runs, "run" falls back to "prefetch"
    "global_wide": (lambda: SparseLayout.global_tokens(160, 32, window=40, block_size=16), 1),
}
BWD_CASES = {   # name -> (BWD_PATTERNS entry, query heads, kv heads, head dim)
    **{name: (name, None, None, 32) for name in BWD_PATTERNS},
    "window_causal_gqa4_d96": ("window_causal", 4, 1, 96),          # padded head dim, 4 heads per kv head
}


@pytest.mark.parametrize("case", sorted(BWD_CASES))
def test_backward_loop_variants(case, poison, monkeypatch):
    """Every backward loop variant (sparse.BWD_LOOP_IDS, for dQ and dK/dV together) gives the reference
    backend's gradients (float64 oracle on the same fp16 inputs); "run" takes the range path exactly
    where the tile index says full tiles are one run (dK/dV: by key tile)."""
    name, hq, hk, d = BWD_CASES[case]
    make, b, *heads = BWD_PATTERNS[name]
    hq = hq or (heads[0] if heads else 2)
    hk = hk or hq // 2
    lay = make()
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g).half()
                     for h, s in ((hq, lay.seq_q), (hk, lay.seq_k), (hk, lay.seq_k), (hq, lay.seq_q)))
    with opsadv.use_backend("reference"):
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(opsadv.ops.sparse_attention(q64, k64, v64, lay), (q64, k64, v64), dout.double())
    with opsadv.use_backend("cuda"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = opsadv.ops.sparse_attention(qq, kk, vv, lay)
    seen = []
    monkeypatch.setattr(sparse_mod, "_sparse_dq", _LoopSpy(sparse_mod._sparse_dq, seen))
    monkeypatch.setattr(sparse_mod, "_sparse_dkdv", _LoopSpy(sparse_mod._sparse_dkdv, seen))
    for loop in sparse_mod.BWD_LOOP_IDS:
        monkeypatch.setattr(sparse_mod, "BWD_DEFAULT", {"dq": loop, "dkdv": loop})
        seen.clear()
        grads = torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)
        for gname, x, y in zip(("dq", "dk", "dv"), grads, ref):
            assert not torch.isnan(x).any(), f"{loop} {gname}: NaN"
            small = (x.double() - y).abs().max() < 1e-3
            assert rel_err(x, y) < 2e-2 or small, f"{loop} {gname}: rel err {rel_err(x, y):.2e}"
        tiles = sparse_mod.tiles_for(interpreter_profile("cuda"), d)
        ti_kv, ti_q = (lay.tile_index(*tiles[i][:2]) for i in (2, 1))
        want = {"list": [0, 0], "prefetch": [1, 1],
                "run": [2 if ti_kv.t_full_run else 1, 2 if ti_q.full_run else 1]}[loop]
        assert seen == want, (loop, seen)           # launch order: dK/dV, then dQ


@pytest.mark.parametrize("loop", ["list", "run"])
@pytest.mark.parametrize("case", ["window_causal", "window_long", "global_wide", "varlen_window"])
def test_backward_tma_loads(case, loop, poison, monkeypatch):
    """The backward's descriptor loads (q / dO in dK/dV, k / v in dQ; variant "tma"): the reference backend's
    gradients (float64 oracle), query / key tails past the sequence included; descriptors were made."""
    pats = {**BWD_PATTERNS, "varlen_window": (lambda: SparseLayout.varlen([40, 57], window=(5, 3), block_size=16), 1)}
    make, b, *heads = pats[case]
    hq = heads[0] if heads else 2
    lay = make()
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(b, h, s, 32, generator=g).half()
                     for h, s in ((hq, lay.seq_q), (hq // 2, lay.seq_k), (hq // 2, lay.seq_k), (hq, lay.seq_q)))
    with opsadv.use_backend("reference"):
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(opsadv.ops.sparse_attention(q64, k64, v64, lay), (q64, k64, v64), dout.double())
    made = []
    real = sparse_mod.desc_bhsd
    monkeypatch.setattr(sparse_mod, "desc_bhsd", lambda t, rows: made.append(rows) or real(t, rows))
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": "run", "reverse": False, "tma": False})
    monkeypatch.setattr(sparse_mod, "BWD_DEFAULT", {"dq": loop, "dkdv": loop, "tma": True, "streams": False})
    with opsadv.use_backend("cuda"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        grads = torch.autograd.grad(opsadv.ops.sparse_attention(qq, kk, vv, lay), (qq, kk, vv), dout)
    assert len(made) == 4, made                       # q, dO for dK/dV; k, v for dQ
    for gname, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), f"{gname}: NaN"
        small = (x.double() - y).abs().max() < 1e-3
        assert rel_err(x, y) < 2e-2 or small, f"{gname}: rel err {rel_err(x, y):.2e}"


@pytest.mark.parametrize("name,descriptors", [("varlen", 4), ("block_mask_batch", 0), ("window_causal", 6)])
def test_default_tma_rules(name, descriptors, poison, monkeypatch):
    """The defaults as measured: forward descriptors only without segments / padding / mixed block mask
    ("contiguous"), backward descriptors for all but mixed block masks ("no_mixed_mask"); gradients still
    match the reference."""
    made = []
    real = sparse_mod.desc_bhsd
    monkeypatch.setattr(sparse_mod, "desc_bhsd", lambda t, rows: made.append(rows) or real(t, rows))
    make, b, *heads = PATTERNS[name]
    hq = heads[0] if heads else 2
    _check(make(), b, hq=hq, hk=max(1, hq // 2), d=32)
    assert len(made) == descriptors, made             # forward: k, v; backward: q, dO, k, v


def test_training_calls_tune_each_impl_forward_with_its_own_backward(tmp_path, monkeypatch):
    """A grad-recording sparse call resolves in the train bucket: autotune times every impl's forward with
    its own backward, stores it under "train"; explain() names that bucket; grads match float64."""
    import json
    from opsadv.core import tuning
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    try:
        lay = SparseLayout.sliding_window(41, 9, causal=True, block_size=16)
        q, k, v = (torch.randn(1, 2, 41, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn(1, 2, 41, 32, dtype=torch.float16)
        assert "train (grad-recording" in str(opsadv.explain("sparse_attention", q, k, v, lay))
        with opsadv.use_backend("auto", autotune=True), opsadv.trace() as t:
            out = opsadv.ops.sparse_attention(q, k, v, lay)
            grads = torch.autograd.grad(out, (q, k, v), do)
        entries = {key: e["value"] for dev in json.loads((tmp_path / "tuning.json").read_text())["sections"].values()
                   for key, e in dev.items()}
        train = [e for key, e in entries.items() if key.startswith("sparse_attention|train|")]
        assert len(train) == 1 and len(train[0]["times_ms"]) >= 2, entries
        assert train[0]["winner"] in t.counts
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        with opsadv.use_backend("reference"):
            ref = opsadv.ops.sparse_attention(q64, k64, v64, lay)
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        assert rel_err(out, ref) < 3e-3
        for got, want in zip(grads, ref_grads):
            assert rel_err(got, want) < 3e-3
    finally:
        monkeypatch.undo()
        tuning.reload()


@requires_gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("layout", ["window", "varlen", "block_mask"])
def test_gpu_forward_tma_loads(layout, tma, seed, poison, monkeypatch):
    """On the GPU (bf16, d128, ragged lengths): the forward with and without K/V descriptor loads vs float32."""
    if tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90+")
    made = []
    real = sparse_mod.desc_bhsd
    monkeypatch.setattr(sparse_mod, "desc_bhsd", lambda t, rows: made.append(rows) or real(t, rows))
    monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": "run", "reverse": False, "tma": tma})
    # the backward's own descriptors (BWD_DEFAULT "tma" is on) must not count as the forward's
    monkeypatch.setattr(sparse_mod, "BWD_DEFAULT", {**sparse_mod.BWD_DEFAULT, "tma": False})
    lay = {"window": lambda: SparseLayout.sliding_window(1000, 300, causal=True, block_size=128, device="cuda"),
           "varlen": lambda: SparseLayout.varlen([300, 1, 517, 182], causal=True, block_size=128, device="cuda"),
           "block_mask": lambda: SparseLayout.from_block_mask(
               torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(1)) < 0.5, block_size=128,
               seq_q=1000, seq_k=1000).to("cuda")}[layout]()
    _check(lay, 2 if layout == "block_mask" else 1, hq=4, hk=2, d=128, dtype=torch.bfloat16, device="cuda",
           impls={"sparse_attention": "cuda.triton.sparse_attention"})
    assert bool(made) == tma


@requires_gpu
@pytest.mark.parametrize("loop", ["band", "band_fused", "band_persist"])
@pytest.mark.parametrize("layout", ["window", "two_sided_cross", "causal_sq_gt_sk", "decode_row"])
def test_gpu_forward_band_loop(layout, loop, seed, poison, monkeypatch):
    """On the GPU (bf16, d128, GQA, ragged lengths, K/V descriptors where sm_90): LOOP "band" / "band_fused" /
    "band_persist" vs float32, at the default 64x64 tile and the long-row 128x128 one (where "band_persist" runs
    "band")."""
    lay = {"window": lambda: SparseLayout.sliding_window(1000, 300, causal=True, block_size=128, device="cuda"),
           "two_sided_cross": lambda: SparseLayout.sliding_window(700, (200, 131), seq_k=1333, block_size=128,
                                                                  device="cuda"),
           "causal_sq_gt_sk": lambda: SparseLayout.dense(901, causal=True, seq_k=517, block_size=128, device="cuda"),
           "decode_row": lambda: SparseLayout.sliding_window(1, 257, causal=True, seq_k=1029, block_size=128,
                                                             device="cuda")}[layout]()
    pin = {"sparse_attention": "cuda.triton.sparse_attention"}
    for tile in (None, (128, 128, 8, 3)):
        _long_row_tile_on(monkeypatch, tile)
        monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": loop, "reverse": False, "tma": "contiguous"})
        _check(lay, 1, hq=4, hk=2, d=128, dtype=torch.bfloat16, device="cuda", impls=pin)


@requires_gpu
@pytest.mark.parametrize("window,loop", [(128, None), (1000, None), (1000, "band_persist")])
def test_gpu_forward_many_items_per_program(window, loop, seed, poison, monkeypatch):
    """On the GPU (bf16, d128, GQA 16:4, s4096: 1024 (head, q tile) items, several per persistent program --
    guards against wrong outputs like those of Triton's fused item / tile loops, which every smaller check passed):
    the default forward at a narrow window (the persistent kernel) and a wider one ("band"), and "band_persist"
    forced there, vs float32 (at the narrow window the persistent kernel is the one that ran)."""
    ran = _persist_grids(monkeypatch)
    lay = SparseLayout.sliding_window(4096, window, causal=True, block_size=128, device="cuda")
    if loop is not None:
        monkeypatch.setattr(sparse_mod, "FWD_DEFAULT", {"loop": loop, "reverse": False, "tma": "contiguous"})
    _check(lay, 1, hq=16, hk=4, d=128, dtype=torch.bfloat16, device="cuda",
           impls={"sparse_attention": "cuda.triton.sparse_attention"})
    if window == 128:
        assert ran


@requires_gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("streams", [False, True])
def test_gpu_backward_tma_and_streams(tma, streams, seed, poison, monkeypatch):
    """On the GPU (bf16, d128, ragged causal window, GQA): the backward with descriptor loads and / or its two
    kernels on two streams vs float32; with streams the gradients equal the one-stream ones bit for bit."""
    if tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90+")
    lay = SparseLayout.sliding_window(1000, 300, causal=True, block_size=128, device="cuda")
    pin = {"sparse_attention": "cuda.triton.sparse_attention"}
    monkeypatch.setattr(sparse_mod, "BWD_DEFAULT", {"dq": "run", "dkdv": "run", "tma": tma, "streams": streams})
    got, _ = _check(lay, 1, hq=4, hk=2, d=128, dtype=torch.bfloat16, device="cuda", impls=pin)
    if streams:
        monkeypatch.setattr(sparse_mod, "BWD_DEFAULT", {"dq": "run", "dkdv": "run", "tma": tma, "streams": False})
        one, _ = _check(lay, 1, hq=4, hk=2, d=128, dtype=torch.bfloat16, device="cuda", impls=pin)
        assert all(torch.equal(a, b) for a, b in zip(got[2:], one[2:]))


_TMA_COMPILE = r"""
import json, os
from types import SimpleNamespace
os.environ.pop("TRITON_INTERPRET", None)
import torch
from opsadv import SparseLayout
from opsadv.backends.triton_common.sparse_attention import sparse as SP
from opsadv.backends.cuda.profiles import PROFILES
from opsadv.testing.sm90 import compile_sm90
captured = {}


class Capture:   # stands in for a kernel: records the launch's arguments instead of running it
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        return lambda *args, **kw: captured.__setitem__(self.name, (self.fn, args, kw))


def stats(fn, args, kw):
    kw = dict(kw)
    warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
    r = compile_sm90(fn, {**dict(zip(fn.arg_names, args)), **kw}, warps, stages)
    return {k: r[k] for k in ("tma_loads", "spill_stores", "registers")}


for name in ("_sparse_fwd", "_sparse_dkdv", "_sparse_dq", "_bwd_delta"):
    setattr(SP, name, Capture(name, getattr(SP, name)))
h100 = next(p for p in PROFILES if p.name == "h100")
ctx = SimpleNamespace(profile=h100, env=SimpleNamespace(triton_interpret=True), options={})
s, d = 4096, 128
lay = SparseLayout.sliding_window(s, 1024, causal=True, block_size=128)
q, k, v = (torch.randn(1, 4, s, d, dtype=torch.bfloat16) for _ in range(3))
args = (lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal, lay.window_left,
        lay.window_right, lay.num_global, d ** -0.5)
out = {}
for tma in (False, True):
    captured.clear()
    SP.sparse_fwd(ctx, q, k, v, *args, variant={"tma": tma})
    SP.sparse_bwd(ctx, q, q, k, v, q, torch.zeros(1, 4, s), *args, variant={"tma": tma, "streams": False})
    out[str(tma)] = {n: stats(*captured[n]) for n in ("_sparse_fwd", "_sparse_dkdv", "_sparse_dq")}
print(json.dumps(out))
"""


def test_tma_variants_compile_for_sm90():
    """The three kernels at the h100 tiles (w1024 causal, d128 bf16), compiled for sm_90 on CPU with and without
    descriptor loads: TMA loads only in the TMA build; it uses fewer registers and spills no more (forward
    174 -> 164 registers, dK/dV spills 48 -> 36 B, dQ 193 -> 178 registers; H200 timing in
    the sparse suite's rows)."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _TMA_COMPILE]).strip().splitlines()[-1])
    for kernel in ("_sparse_fwd", "_sparse_dkdv", "_sparse_dq"):
        off, on = r["False"][kernel], r["True"][kernel]
        assert off["tma_loads"] == 0 and on["tma_loads"] > 0, kernel
        assert on["spill_stores"] <= off["spill_stores"] and on["registers"] <= off["registers"], (kernel, off, on)
    assert r["True"]["_sparse_fwd"]["spill_stores"] == 0 and r["True"]["_sparse_dq"]["spill_stores"] == 0


# ---- the forward's interval mask == the predicate (interpreter) ------------------------------------------
import triton.language as tl  # noqa: E402


@triton.jit
def _mask_probe(out_ptr, SQ, SK, OFF, WL, WR, CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr, BM_MODE: tl.constexpr,
                INTERVAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """_allowed over one (BM, BN) tile of rows / columns starting at (program 0 * BM, program 1 * BN), as int8."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = sparse_mod._allowed(offs_m, offs_n, out_ptr, 0, 0, out_ptr, out_ptr, out_ptr, SQ, SK, OFF, WL, WR, 0, 1,
                             CAUSAL, HAS_WIN, False, BM_MODE, False, False, INTERVAL)
    n_cols = tl.num_programs(1) * BN
    tl.store(out_ptr + offs_m[:, None] * n_cols + offs_n[None, :], ok.to(tl.int8))


@pytest.mark.parametrize("sq,sk,wl,wr,causal,has_win,bm_mode", [
    (37, 37, 5, 0, True, True, 0), (37, 53, 7, 3, False, True, 0), (53, 29, 0, 0, True, True, 0),
    (40, 40, 100, 100, False, True, 0), (33, 47, 4, 9, True, True, 1), (45, 30, -1, -1, True, False, 1),
    (45, 30, -1, -1, False, False, 0), (1, 3, 0, 2, False, True, 0), (31, 31, 31, 0, True, True, 0)])
def test_interval_mask_equals_predicate(sq, sk, wl, wr, causal, has_win, bm_mode):
    """The forward kernels' interval form of the band mask (INTERVAL) equals the element predicate everywhere:
    windows either side, bottom-right alignment (s_q != s_k), all-True / all-False block masks, and rows / columns
    past s_q / s_k (the tile grid overhangs both), against a dense mask built in torch as the layout defines it."""
    bm, bn = 16, 16
    grid = (triton.cdiv(sq + 5, bm), triton.cdiv(sk + 5, bn))
    outs = {}
    for interval in (False, True):
        out = torch.full((grid[0] * bm, grid[1] * bn), 7, dtype=torch.int8)     # poisoned
        _mask_probe[grid](out, sq, sk, sk - sq, wl, wr, causal, has_win, bm_mode, interval, bm, bn)
        outs[interval] = out
    assert torch.equal(outs[True], outs[False])
    i = torch.arange(grid[0] * bm)[:, None]
    j = torch.arange(grid[1] * bn)[None, :]
    ip = i + sk - sq
    want = torch.full_like(i * j, bm_mode == 1, dtype=torch.bool)
    if has_win:
        want = want | ((j >= ip - wl) & (j <= ip + wr))
    if causal:
        want = want & (j <= ip)
    want = want & (i < sq) & (j < sk)
    assert torch.equal(outs[True].bool(), want)


def test_no_grad_calls_without_lse_take_the_inference_bucket(dispatch_calls):
    """An eager no-grad sparse call that does not ask for lse resolves in its own bucket and runs the impl's
    `inference` forward (the Gluon kernel's no-lse build); one that returns lse, or records grads, does not."""
    seen = dispatch_calls
    lay = SparseLayout.sliding_window(40, 9, causal=True, block_size=16)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with torch.no_grad():
        out = opsadv.ops.sparse_attention(q, k, v, lay)
        assert seen[-1][1] and seen[-1][0].inference and not seen[-1][0].train
        out2, lse = opsadv.ops.sparse_attention(q, k, v, lay, return_lse=True)
        assert not seen[-1][1] and not seen[-1][0].inference
    assert torch.equal(out, out2) and lse.shape == (1, 2, 40)
    qg = q.clone().requires_grad_()
    opsadv.ops.sparse_attention(qg, k, v, lay)
    assert not seen[-1][0].inference
