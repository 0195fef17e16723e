"""The cuda backend's persistent norm backward kernel (opsadv.backends.triton_common.norm.norm._backward) under
the interpreter, against autograd of the float64 formula: odd hidden sizes, 1 / 3 / 127 rows,
tiles of several rows, few programs (each walks many tiles, the last one a ragged run), with and
without the residual gradient, weight, bias and offset; dx, dweight and dbias."""
import types

import pytest
import torch

from opsadv.backends.triton_common.norm.norm import _backward, _next_pow2

from conftest import rel_err

CTX = types.SimpleNamespace(env=types.SimpleNamespace(sm_count=None))     # CPU: 2 "SMs"


def _ref(rms, x, w, b, offset, dy, dsum):
    """(dx, dw, db) of sum(norm(x) * dy) + sum(x * dsum) in float64, and the saved statistics."""
    x, w64 = x.double().requires_grad_(), (w.double().requires_grad_() if w is not None else None)
    b64 = b.double().requires_grad_() if b is not None else None
    n = x.shape[-1]
    if rms:
        rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
        y, mean = x * rstd[..., None] * ((w64 + offset) if w64 is not None else 1), None
    else:
        mean = x.mean(-1)
        rstd = torch.rsqrt(x.var(-1, unbiased=False) + 1e-5)
        y = torch.nn.functional.layer_norm(x, (n,), w64, b64, 1e-5)
    loss = (y * dy.double()).sum() + ((x * dsum.double()).sum() if dsum.numel() else 0)
    grads = torch.autograd.grad(loss, [t for t in (x, w64, b64) if t is not None])
    return grads, (mean.detach().float() if mean is not None else None), rstd.detach().float()


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("n", [67, 1000, 4095])
@pytest.mark.parametrize("m", [1, 3, 127])
@pytest.mark.parametrize("cfg", ["default", "rows2_one_prog_per_sm"])
def test_backward_kernel(rms, n, m, cfg):
    g = torch.Generator().manual_seed(n * 1000 + m)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    residual = m != 3
    x, dy = r(m, n), r(m, n)
    dsum = r(m, n) if residual else torch.empty(0)
    w = 1 + 0.1 * r(n)
    b = r(n) if not rms else None
    offset = 1.0 if rms and n == 1000 else 0.0
    ref, mean, rstd = _ref(rms, x, w, b, offset, dy, dsum)
    c = None if cfg == "default" else (_next_pow2(n), 2, 4, 1)
    dx, dw, db = _backward(CTX, rms, dy, dsum, x, w, b is not None, mean, rstd, offset, c)
    assert rel_err(dx, ref[0]) < 1e-5 and rel_err(dw, ref[1]) < 1e-5
    if b is not None:
        assert rel_err(db, ref[2]) < 1e-5
    else:
        assert db is None                 # absent gradient: None from the impl (the op makes it 0-element)


def test_backward_kernel_without_weight_noncontiguous_fp16():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(129, 2 * 130, generator=g)
    x = base[:, ::2]                                          # inner stride 2: copied to rows
    dy = torch.randn(129, 130, generator=g).t().contiguous().t()   # column-major view
    ref, mean, rstd = _ref(False, x, None, None, 0.0, dy, torch.empty(0))
    dx, dw, db = _backward(CTX, False, dy.half(), torch.empty(0).half(), x.half(), None, False, mean, rstd, 0.0,
                           (256, 4, 4, 1))
    assert dw is None and db is None
    assert rel_err(dx, ref[0]) < 2e-3


@pytest.mark.parametrize("p,n", [(1, 5), (64, 32), (130, 37), (200, 1)])
@pytest.mark.parametrize("parts", ["w", "b", "wb"])
def test_stage2_reduce_kernel(p, n, parts):
    """Stage 2 alone: column sums of (P, N) float32 partials over several BLOCK_P steps (P > 64 on a
    GPU with many programs), ragged column strips, cast to the output dtype; outputs poisoned first."""
    from opsadv.backends.triton_common.norm import norm as N
    g = torch.Generator().manual_seed(p * 100 + n)
    dw_part, db_part = torch.randn(p, n, generator=g), torch.randn(p, n, generator=g)
    dw = torch.full((n,), float("nan"), dtype=torch.float16)
    db = torch.full((n,), float("nan"), dtype=torch.float32)
    has_w, has_b = "w" in parts, "b" in parts
    N._kernels()["reduce"][(N.triton_cdiv(n, N.REDUCE_BLOCK_N),)](
        dw_part, db_part, dw, db, p, n, HAS_W=has_w, HAS_DB=has_b,
        BLOCK_P=N.REDUCE_BLOCK_P, BLOCK_N=N.REDUCE_BLOCK_N)
    if has_w:
        assert rel_err(dw.float(), dw_part.double().sum(0).half().float()) < 2e-3
    else:
        assert dw.isnan().all()
    if has_b:
        assert rel_err(db, db_part.double().sum(0).float()) < 1e-5
    else:
        assert db.isnan().all()
