"""The aten-backed norm impls follow the op contract (checked on CPU, where the same aten ops run)."""
import zlib

import pytest
import torch

from opsadv.backends.cuda.norm import aten as A
from opsadv.ops.norm import reference as R

from conftest import rel_err


def _seed(*parts) -> int:
    # stable across processes (hash() of a str is salted per process: the draw changed from run to run)
    return zlib.crc32(repr(parts).encode())


def _close(a, e, tol) -> bool:
    """Relative-norm error under tol, or elementwise within tol: a one-row mean can sit near 0, where
    float32 rounding alone gives a large relative error (seen at shape (1, 64))."""
    return rel_err(a, e) < tol or torch.allclose(a.double(), e.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])   # (CPU aten keeps bf16 stats in bf16)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 100), (127, 257)])
def test_layer_norm_matches_reference(dtype, residual, shape):
    g = torch.Generator().manual_seed(_seed(dtype, residual, shape))
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    n = shape[-1]
    x, w, b = r(*shape), r(n), r(n)
    res = r(*shape) if residual else None
    got, want = A.ln_fwd(None, x, w, b, 1e-5, res), R.layer_norm_fwd(None, x, w, b, 1e-5, res)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for a, e in zip(got, want):
        assert a.shape == e.shape and a.dtype == e.dtype
        if a.numel():
            assert _close(a, e, tol)
    dy = r(*shape)
    dsum = r(*shape) if residual else x.new_empty((0,))
    xin = want[1] if residual else x
    gb = A.ln_bwd(None, dy, dsum, xin, w, b, want[2], want[3])
    rb = R.layer_norm_bwd(None, dy, dsum, xin, w, b, want[2], want[3])
    for a, e in zip(gb, rb):
        assert _close(a, e, tol * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 100), (127, 257)])
def test_rms_norm_matches_reference(dtype, residual, shape):
    g = torch.Generator().manual_seed(_seed(dtype, residual, shape, "rms"))
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    n = shape[-1]
    x, w = r(*shape), r(n)
    res = r(*shape) if residual else None
    got, want = A.rms_fwd(None, x, w, 1e-6, res, 0.0), R.rms_norm_fwd(None, x, w, 1e-6, res, 0.0)
    for a, e in zip(got, want):                       # rstd: x.shape[:-1], float32 (float64 for float64)
        assert a.shape == e.shape and a.dtype == e.dtype
        if a.numel():
            assert rel_err(a, e) < 1e-5
    y, s, rstd = A.rms_infer(None, x, w, 1e-6, res, 0.0)
    assert rstd is None and torch.equal(y, got[0]) and (s is None if not residual else torch.equal(s, got[1]))
    yl, sl, *stats = A.ln_infer(None, x, w, w, 1e-5, res)
    assert stats == [None, None] and torch.equal(yl, A.ln_fwd(None, x, w, w, 1e-5, res)[0])


FUSED_RMS = hasattr(torch.ops.aten, "_fused_rms_norm")
needs_fused_rms = pytest.mark.skipif(not FUSED_RMS, reason="aten._fused_rms_norm missing (torch < 2.12)")


@needs_fused_rms
@pytest.mark.parametrize("residual", [False, True])
def test_rms_forward_stats_feed_the_triton_backward(residual):
    """aten's RMSNorm forward has no backward impl: its rstd must be what the Triton backward reads."""
    import types
    from opsadv.backends.triton_common.norm.norm import _backward
    g = torch.Generator().manual_seed(3)
    x, w, dy = torch.randn(7, 33, generator=g), torch.randn(33, generator=g), torch.randn(7, 33, generator=g)
    res = torch.randn(7, 33, generator=g) if residual else None
    y, s, rstd = A.rms_fwd(None, x, w, 1e-6, res, 0.0)
    xin = s if residual else x
    ctx = types.SimpleNamespace(env=types.SimpleNamespace(sm_count=None))
    dx, dw, _ = _backward(ctx, True, dy, torch.empty(0), xin, w, False, None, rstd, 0.0)
    want = R.rms_norm_bwd(None, dy.double(), torch.empty(0), xin.double(), w.double(), rstd.double(), 0.0)
    assert rel_err(dx, want[0]) < 1e-5 and rel_err(dw, want[1]) < 1e-5


def test_declared_priorities():
    import opsadv
    from opsadv.core.kernel import CallSpec
    impls = {i.id: i for i in A.impls(opsadv.detect())}
    assert set(impls) == {"cuda.aten.layer_norm", "cuda.aten.layer_norm_autograd", "cuda.aten.rms_norm",
                          "cuda.aten.rms_norm_small_rows", "cuda.aten.rms_norm_autograd"}
    assert impls["cuda.aten.rms_norm"].fn is (A.rms_fwd if FUSED_RMS else A.rms_fwd_unfused)
    assert impls["cuda.aten.layer_norm"].priority < 200 and impls["cuda.aten.rms_norm"].priority < 200
    small = impls["cuda.aten.rms_norm_small_rows"]
    assert small.priority > 200 and small.backward is None and "offset" not in small.features
    spec = lambda rows: CallSpec("rms_norm", "cuda", torch.bfloat16, frozenset(), (2048, rows))  # noqa: E731
    assert small.check(spec(16), None) == [] and small.check(spec(32), None)


def test_autograd_impls_serve_small_hidden_grad_calls_only():
    """cuda.aten.*_autograd rank above the Triton norms only for eager grad-recording calls
    (CallSpec.train) without residual at hidden <= 2048; their `train` forward records torch's own
    autograd (checked numerically on CPU: the same functions serve eager no-grad calls)."""
    import opsadv
    from opsadv.core.kernel import CallSpec
    impls = {i.id: i for i in A.impls(opsadv.detect())}
    for op, iid in (("layer_norm", "cuda.aten.layer_norm_autograd"), ("rms_norm", "cuda.aten.rms_norm_autograd")):
        impl = impls[iid]
        assert impl.priority > 200 and impl.train is not None and "residual" not in impl.features
        spec = lambda h, train: CallSpec(op, "cuda", torch.bfloat16, frozenset({"weight"}), (h, 65536),  # noqa: E731
                                         train=train)
        assert impl.check(spec(1024, True), None) == [] and impl.check(spec(2048, True), None) == []
        assert "hidden 4096" in impl.check(spec(4096, True), None)[0]
        assert "grad-recording" in impl.check(spec(1024, False), None)[0]
    x = torch.randn(5, 33, dtype=torch.float64, requires_grad=True)
    w = torch.randn(33, dtype=torch.float64, requires_grad=True)
    y, s, _ = impls["cuda.aten.rms_norm_autograd"].train(None, x, w, 1e-6, None, 0.0)
    assert s is None and y.grad_fn is not None
    gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = torch.nn.functional.rms_norm(xr, (33,), wr, 1e-6)
    torch.testing.assert_close((gx, gw), torch.autograd.grad(ref, (xr, wr), torch.ones_like(ref)))


@pytest.mark.parametrize("residual", [False, True])
def test_unfused_rms_forward_matches_the_fused_contract(residual):
    """Without aten._fused_rms_norm (torch < 2.12) rms_norm_autograd's fn computes rstd itself: same
    outputs as the fused op (checked where it exists) and as float64 math."""
    g = torch.Generator().manual_seed(21 + residual)
    x, w = torch.randn(7, 127, generator=g), torch.randn(127, generator=g)
    res = torch.randn(7, 127, generator=g) if residual else None
    y, s, rstd = A.rms_fwd_unfused(None, x, w, 1e-6, res, 0.0)
    xs = (x + res if residual else x).double()
    want_rstd = torch.rsqrt(xs.pow(2).mean(-1) + 1e-6)
    assert rel_err(rstd, want_rstd) < 1e-6 and rel_err(y, xs * want_rstd[:, None] * w.double()) < 1e-5
    assert (s.numel() == 0) != residual
    if FUSED_RMS:
        yf, sf, rf = A.rms_fwd(None, x, w, 1e-6, res, 0.0)
        assert rel_err(y, yf) < 1e-6 and rel_err(rstd, rf) < 1e-6
