"""cuda backend layer_norm / rms_norm: the Triton kernels under the interpreter (fp32, fp16) against
the reference backend in float64, forward and backward, with residual, offset, missing weight/bias,
non-contiguous inputs and leading dims; bf16 on a real GPU with requires_gpu."""
import pytest
import torch

import opsadv
from opsadv.backends.triton_common.norm.norm import MAX_HIDDEN

from conftest import HAS_CUDA, rel_err, requires_gpu

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _run(op, x, w, b, res, offset, go, gs):
    """Forward, then grads of sum(y*go) (+ sum(xsum*gs)) w.r.t. every tensor input."""
    if op == "layer_norm":
        out = opsadv.ops.layer_norm(x, w, b, 1e-5, residual=res)
    else:
        out = opsadv.ops.rms_norm(x, w, 1e-6, residual=res, offset=offset)
    y, s = out if res is not None else (out, None)
    loss = (y * go).sum() + ((s * gs).sum() if s is not None else 0)
    ins = [t for t in (x, w, b, res) if t is not None and t.requires_grad]
    return y, s, torch.autograd.grad(loss, ins)


def _check(op, shape, dtype, *, residual, weight=True, bias=True, offset=0.0, noncontig=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    if noncontig:                       # a strided view (inner stride 2, rows permuted) is the op's input
        base = (r(*shape[:-1], 2 * n) if len(shape) > 2 else r(n, shape[0])).requires_grad_()
        x = base[..., ::2].transpose(0, -2) if len(shape) > 2 else base.t()
        assert not x.is_contiguous()
    else:
        x = r(*shape).requires_grad_()
    w = r(n).requires_grad_() if weight else None
    b = r(n).requires_grad_() if (bias and op == "layer_norm") else None
    res = r(*x.shape).requires_grad_() if residual else None
    go, gs = r(*x.shape), r(*x.shape)
    leaves = [x, w, b, res]
    # pinned: on a GPU, few-row RMSNorm calls rank PyTorch's kernel first (cuda.aten.rms_norm_small_rows)
    with opsadv.use_backend("cuda", impls={op: f"cuda.triton.{op}"}):
        y, s, grads = _run(op, *leaves, offset, go, gs)
        chosen = opsadv.explain(op, leaves[0], leaves[1], *( [leaves[2]] if op == "layer_norm" else []),
                                residual=leaves[3], **({"offset": offset} if op == "rms_norm" else {})).chosen
    assert chosen == f"cuda.triton.{op}"
    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    with opsadv.use_backend("reference"):
        yr, sr, ref_grads = _run(op, *ref_leaves, offset, go.double(), gs.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, yr) < TOL[dtype]
    if residual:
        assert rel_err(s, sr) < TOL[dtype]
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and rel_err(got, want) < 2 * TOL[dtype]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [64, 100, 257])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_fwd_bwd(op, dtype, n, residual):
    _check(op, (3, 17, n), dtype, residual=residual, offset=1.0 if op == "rms_norm" and n == 100 else 0.0, seed=n)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_without_weight_or_bias(op):
    _check(op, (5, 130), torch.float32, residual=True, weight=False, bias=False)
    if op == "layer_norm":
        _check(op, (5, 130), torch.float32, residual=False, weight=True, bias=False, seed=1)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_noncontiguous_input(op):
    _check(op, (4, 3, 96), torch.float32, residual=True, noncontig=True, offset=1.0 if op == "rms_norm" else 0.0)
    _check(op, (7, 64), torch.float16, residual=False, noncontig=True, seed=2)


def test_norm_rows_and_stats_layout():
    x = torch.randn(2, 3, 257, device=DEV)
    with opsadv.use_backend("cuda"):
        y, s, mean, rstd = torch.ops.opsadv.layer_norm(x, None, None, 1e-5, None)
        y2, s2, rstd2 = torch.ops.opsadv.rms_norm(x, None, 1e-6, None, 0.0)
    assert s.numel() == 0 and s2.numel() == 0
    assert mean.shape == (2, 3) and rstd.dtype == torch.float32 and rstd2.shape == (2, 3)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x.var(-1, unbiased=False) + 1e-5))


def test_norm_rejects_huge_hidden():
    x = torch.randn(1, MAX_HIDDEN + 1)
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain("rms_norm", x, None)
    c = next(c for c in exp.candidates if c.impl.id == "cuda.triton.rms_norm")
    assert not c.accepted and any("hidden size" in r for r in c.reasons)


def test_norm_wide_row_single_program():
    _check("rms_norm", (2, 3000), torch.float32, residual=True, offset=1.0)


@pytest.mark.parametrize("op,n", [("layer_norm", 65536), ("rms_norm", 50001)])
def test_norm_widest_rows(op, n):
    """The top of the issue's hidden-size range: MAX_HIDDEN, and an odd size that leaves ~24% of its block masked;
    forward and backward with the residual: ~10 s each in the interpreter."""
    assert n <= MAX_HIDDEN
    _check(op, (2, n), torch.float32, residual=True, offset=1.0 if op == "rms_norm" else 0.0, seed=n)


@requires_gpu
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n", [64, 1000, 4096, 12288, 50001, 65536])
def test_gpu_norm_bf16(op, n):
    _check(op, (3, 129, n), torch.bfloat16, residual=True, offset=1.0 if op == "rms_norm" else 0.0)
    _check(op, (257, n), torch.bfloat16, residual=False, noncontig=True, seed=1)


def test_backward_config_fits_register_file():
    from opsadv.backends.triton_common.norm.norm import bwd_config
    for n in (1, 64, 1000, 1024, 4096, 8192, 16384, 65536):
        block, rows, warps, per_sm = bwd_config(n)
        assert block >= n and block & (block - 1) == 0 and rows >= 1 and 4 <= warps <= 16
        assert per_sm * warps <= 16                          # resident at up to 128 registers per thread
        if n <= 8192:
            assert rows * block // (32 * warps) <= 32       # elements per thread: no spills


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n", [48, 1000])
def test_every_forward_candidate_matches_reference(rms, n):
    """Each (ROWS, num_warps, EVICT) the forward's config tuner may pick (fwd_candidates) computes the same
    normalization: 37 rows (not a multiple of any ROWS), a residual, NaN-poisoned outputs."""
    from types import SimpleNamespace

    from opsadv.backends.triton_common.norm.norm import _forward, fwd_candidates
    g = torch.Generator().manual_seed(n + rms)
    x, res = (torch.randn(37, n, generator=g).to(DEV) for _ in range(2))
    w, b = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    s64 = (x + res).double()
    if rms:
        want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.double() + 1.0)
    else:
        want = torch.nn.functional.layer_norm(s64, (n,), w.double(), b.double(), 1e-5)
    cands = fwd_candidates(n)
    assert len(cands) > 1 and len(set(cands)) == len(cands)
    for cfg in cands:
        y, s, _, rstd = _forward(SimpleNamespace(profile=None), rms, x, w, None if rms else b,
                                 1e-6 if rms else 1e-5, res, 1.0 if rms else 0.0, cfg=cfg)
        assert rel_err(y, want) < 1e-5, cfg
        assert torch.equal(s, x + res) and torch.isfinite(rstd).all(), cfg


@requires_gpu
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n", [8192])      # (ragged chunks are covered in the interpreter: each n compiles 16 tiles)
def test_gpu_every_forward_candidate_bf16(rms, n, monkeypatch):
    """On the GPU, bf16: every tile the forward's tuner may pick for a long row (whole-row and looped ones), with
    a residual, 37 rows, NaN-poisoned outputs, against float64."""
    from types import SimpleNamespace

    from opsadv.backends.triton_common.norm import norm as N
    from opsadv.backends.triton_common.norm.norm import _forward, fwd_candidates
    # NaN outputs on the GPU too (the library poisons only in the interpreter: this buffer is on every call's path)
    monkeypatch.setattr(N, "_poisoned", lambda shape, dtype, dev: torch.full(shape, float("nan"), dtype=dtype,
                                                                               device=dev))
    g = torch.Generator().manual_seed(n + rms)
    x, res = (torch.randn(37, n, generator=g).add(2.0).to("cuda", torch.bfloat16) for _ in range(2))
    w, b = (torch.randn(n, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    s64 = x.double() + res.double()
    if rms:
        want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.double() + 1.0)
    else:
        want = torch.nn.functional.layer_norm(s64, (n,), w.double(), b.double(), 1e-5)
    cands = fwd_candidates(n)
    assert any(c[3] for c in cands)
    for cfg in cands:
        y, s, _, rstd = _forward(SimpleNamespace(profile=None), rms, x, w, None if rms else b,
                                 1e-6 if rms else 1e-5, res, 1.0 if rms else 0.0, cfg=cfg)
        assert rel_err(y, want) < 1e-2, cfg
        assert torch.equal(s, x + res) and torch.isfinite(rstd).all(), cfg


def test_forward_candidates_fit():
    from opsadv.backends.triton_common.norm.norm import LOOP_MIN_BLOCK, fwd_candidates, fwd_config
    for n in (1, 64, 1000, 1024, 4096, 8192, 65536):
        block, rows, warps = fwd_config(n)
        cands = fwd_candidates(n)
        assert cands[0] == (rows, warps, False, 0)           # the untuned pick comes first
        whole = [c for c in cands if c[3] == 0]
        for r, w, _, _ in whole:                             # the tuner's extras: >= 1 element per thread
            assert (r, w) == (rows, warps) or (r >= 1 and 2 <= w <= 16 and r * block >= 32 * w)
        # every whole-row tile with and without the eviction hints
        assert [c[:2] for c in whole if c[2]] == [c[:2] for c in whole if not c[2]]
        looped = [c for c in cands if c[3]]
        assert bool(looped) == (block >= LOOP_MIN_BLOCK)      # long rows also get looped tiles, shorter ones never
        for r, w, evict, chunk, *fixed in looped:            # one row, a chunk narrower than the row, hints on
            assert r == 1 and evict and chunk < block and chunk >= 32 * w and fixed in ([], [True])
        run_time_n = [c for c in looped if len(c) == 4]      # each also with the hidden size compiled in
        assert [c for c in looped if len(c) == 5] == [(*c, True) for c in run_time_n]


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n,chunk,rows", [(48, 16, 1), (1000, 128, 2), (300, 512, 1)])
def test_looped_forward_matches_reference(rms, n, chunk, rows, fixed):
    """The looped forward (the row in CHUNK-column steps, re-read for the output pass): a ragged last chunk
    (1000 = 7 * 128 + 104), one chunk wider than the row, 37 rows (not a multiple of ROWS), a residual, the mean /
    rstd statistics, NaN-poisoned outputs; against float64.  fixed: the hidden size compiled in (N_FIXED)."""
    from types import SimpleNamespace

    from opsadv.backends.triton_common.norm.norm import _forward
    g = torch.Generator().manual_seed(n + 7 * rms)
    x, res = (torch.randn(37, n, generator=g).to(DEV) + 3.0 for _ in range(2))   # a mean far from 0 for LayerNorm
    w, b = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    s64 = (x + res).double()
    var = s64.pow(2).mean(-1) if rms else s64.var(-1, unbiased=False)
    if rms:
        want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.double() + 1.0)
    else:
        want = torch.nn.functional.layer_norm(s64, (n,), w.double(), b.double(), 1e-5)
    for residual in (res, None):
        y, s, mean, rstd = _forward(SimpleNamespace(profile=None), rms, x, w, None if rms else b,
                                    1e-6 if rms else 1e-5, residual, 1.0 if rms else 0.0,
                                    cfg=(rows, 4, True, chunk, True) if fixed else (rows, 4, True, chunk))
        if residual is None:
            x64 = x.double()
            var = x64.pow(2).mean(-1) if rms else x64.var(-1, unbiased=False)
            if rms:
                want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.double() + 1.0)
            else:
                want = torch.nn.functional.layer_norm(x64, (n,), w.double(), b.double(), 1e-5)
        else:
            assert torch.equal(s, x + res)
        assert rel_err(y, want) < 1e-5, (residual is None, chunk)
        assert rel_err(rstd, torch.rsqrt(var + (1e-6 if rms else 1e-5))) < 1e-5
        if not rms:
            assert rel_err(mean, (s64 if residual is not None else x.double()).mean(-1)) < 1e-6


def test_forward_tile_is_picked_once_per_key(monkeypatch):
    """With autotuning on, the tuner decides a key's tile once; later calls of that key take it from one dict
    lookup (the per-call path of host-bound decode calls) and never ask the tuner again."""
    from types import SimpleNamespace

    from opsadv.backends.triton_common.norm import norm as N
    N._kernels()
    asked = []

    class Tuner:
        def pick(self, key, configs, launch, autotune):
            asked.append(key)
            return configs[-1]
    monkeypatch.setitem(N._K, "tuner", Tuner())
    monkeypatch.setattr(N, "_FWD_PICKED", {})
    monkeypatch.setattr(N, "_autotunes", lambda ctx, x: True)
    monkeypatch.setattr(N.torch.cuda, "is_current_stream_capturing", lambda: False)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(19, 48, generator=g).to(DEV), torch.randn(48, generator=g).to(DEV)
    want = torch.nn.functional.rms_norm(x.double(), (48,), w.double(), 1e-6)
    for _ in range(3):
        y, _, _, _ = N._forward(SimpleNamespace(profile=None), True, x, w, None, 1e-6, None, 0.0)
        assert rel_err(y, want) < 1e-5
    assert len(asked) == 1 and list(N._FWD_PICKED.values()) == [N.fwd_candidates(48)[-1]]
