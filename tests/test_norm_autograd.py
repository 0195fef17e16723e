"""Eager autograd of the norm ops with a fused residual when only some outputs carry a gradient
(grads are not materialized: the backward gets None for unused outputs): x, residual, weight and
bias gradients against torch autograd of the float64 formula, on the reference backend and the
cuda backend's Triton kernels (interpreter on CPU)."""
import zlib

import pytest
import torch
import torch.nn.functional as F

import opsadv

from conftest import rel_err


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("use", ["y", "sum", "both"])
def test_residual_partial_outputs(backend, kind, use):
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{use}".encode()))   # stable across processes
    t, n = 5, 67
    x, r = torch.randn(t, n, generator=g), torch.randn(t, n, generator=g)
    w, b = 1 + 0.1 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)
    gy, gs = torch.randn(t, n, generator=g), torch.randn(t, n, generator=g)

    def loss(y, s):
        return ((y * gy).sum() if use in ("y", "both") else 0) + ((s * gs).sum() if use in ("sum", "both") else 0)

    leaves = [v.clone().double().requires_grad_() for v in (x, r, w, b)]
    s64 = leaves[0] + leaves[1]
    y64 = (F.layer_norm(s64, (n,), leaves[2], leaves[3], 1e-5) if kind == "layer_norm"
           else F.rms_norm(s64, (n,), leaves[2], 1e-6))
    used = leaves if kind == "layer_norm" else leaves[:3]
    want = torch.autograd.grad(loss(y64, s64), used, allow_unused=True)

    ours = [v.clone().requires_grad_() for v in (x, r, w, b)]
    with opsadv.use_backend(backend):
        if kind == "layer_norm":
            y, s = opsadv.ops.layer_norm(ours[0], ours[2], ours[3], 1e-5, residual=ours[1])
        else:
            y, s = opsadv.ops.rms_norm(ours[0], ours[2], 1e-6, residual=ours[1])
        got = torch.autograd.grad(loss(y, s), ours if kind == "layer_norm" else ours[:3], allow_unused=True)
    for name, a, e in zip("xrwb", got, want):
        if e is None or not e.abs().sum():
            assert a is None or not a.abs().sum(), name
            continue
        assert a is not None and rel_err(a.double(), e) < 1e-4, (name, use)
