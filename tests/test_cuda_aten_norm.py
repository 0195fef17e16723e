"""The aten-backed norm impls follow the op contract (checked on CPU, where the same aten ops run)."""
import pytest
import torch

from opsadv.backends.cuda import aten_norm as A
from opsadv.backends.reference import kernels as R

from conftest import rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])   # (CPU aten keeps bf16 stats in bf16)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 100), (127, 257)])
def test_layer_norm_matches_reference(dtype, residual, shape):
    g = torch.Generator().manual_seed(hash((str(dtype), residual, shape)) % 2**31)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    n = shape[-1]
    x, w, b = r(*shape), r(n), r(n)
    res = r(*shape) if residual else None
    got, want = A.ln_fwd(None, x, w, b, 1e-5, res), R.layer_norm_fwd(None, x, w, b, 1e-5, res)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for a, e in zip(got, want):
        assert a.shape == e.shape and a.dtype == e.dtype
        if a.numel():
            assert rel_err(a, e) < tol
    dy = r(*shape)
    dsum = r(*shape) if residual else x.new_empty((0,))
    xin = want[1] if residual else x
    gb = A.ln_bwd(None, dy, dsum, xin, w, b, want[2], want[3])
    rb = R.layer_norm_bwd(None, dy, dsum, xin, w, b, want[2], want[3])
    for a, e in zip(gb, rb):
        assert rel_err(a, e) < tol * 2


def test_declared_below_triton():
    import opsadv
    impls = {i.id: i for i in A.impls(opsadv.detect())}
    assert set(impls) == {"cuda.aten.layer_norm"} and impls["cuda.aten.layer_norm"].priority < 200
