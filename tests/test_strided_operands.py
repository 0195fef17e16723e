"""Secondary operands (norm weight / bias / residual, gemm bias / residual, swiglu_gemm bias, rotary
cos / sin, swiglu gate_up) given as strided (::2), expanded (stride 0) and storage-offset views: the
cuda backend's kernels (interpreter on CPU) must match the reference backend, forward and backward
(issue 37 item 3: the kernels read ptr + offsets, so a non-unit-stride vector was silently misread)."""
import pytest
import torch

import opsadv

from conftest import HAS_CUDA, rel_err

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = 1e-4
VARIANTS = ["strided", "expanded", "offset"]


def _view(shape, variant, g):
    """(leaf, view): a fresh random leaf and a view of `shape` built from it the `variant` way."""
    n = shape[-1]
    if variant == "strided":
        leaf = torch.randn(*shape[:-1], 2 * n, generator=g)
        make = lambda t: t[..., ::2]  # noqa: E731
    elif variant == "expanded":          # stride 0 along the leading dim (or the only dim of a vector)
        leaf = torch.randn(*((1,) * (len(shape) - 1)), n, generator=g) if len(shape) > 1 else torch.randn(1, generator=g)
        make = lambda t: t.expand(*shape)  # noqa: E731
    else:
        numel = 1
        for s in shape:
            numel *= s
        leaf = torch.randn(numel + 3, generator=g)
        make = lambda t: t[3:].view(*shape)  # noqa: E731
    leaf = leaf.to(DEV).requires_grad_()
    v = make(leaf)
    assert v.storage_offset() > 0 if variant == "offset" else not v.is_contiguous()
    return leaf, make


def _compare(fn, dense, special, g, backward=True):
    """Run fn(*dense, *special views) on cuda and reference; compare outputs and grads of all leaves."""
    sleaves, makes = zip(*special)
    results = []
    for backend in ("cuda", "reference"):
        d = [t.detach().clone().requires_grad_() for t in dense]
        s = [t.detach().clone().requires_grad_() for t in sleaves]
        # precision="tf32": the Triton GEMMs take float32 only under it (the interpreter computes in fp32)
        with opsadv.use_backend(backend, **({"precision": "tf32"} if backend == "cuda" else {})):
            out = fn(*d, *(m(t) for m, t in zip(makes, s)))
            outs = out if isinstance(out, tuple) else (out,)
            grads = ()
            if backward:
                gos = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(DEV) for o in outs]
                grads = torch.autograd.grad(outs, d + s, gos)
        results.append((outs, grads))
    (o1, g1), (o2, g2) = results
    for a, b in zip(o1, o2):
        assert rel_err(a, b) < TOL
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert a.shape == b.shape and rel_err(a, b) < TOL, i


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("operand", ["weight", "residual"])
def test_rms_norm(variant, operand):
    g = torch.Generator().manual_seed(1)
    m, n = 5, 64
    x = torch.randn(m, n, generator=g).to(DEV)
    w = torch.randn(n, generator=g).to(DEV)
    if operand == "weight":
        fn = lambda x, w: opsadv.ops.rms_norm(x, w, 1e-6)  # noqa: E731
        _compare(fn, [x], [_view((n,), variant, g)], g)
    else:
        fn = lambda x, w, r: opsadv.ops.rms_norm(x, w, 1e-6, residual=r)  # noqa: E731
        _compare(fn, [x, w], [_view((m, n), variant, g)], g)


def test_rms_norm_strided_weight_fp16():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g).half().to(DEV)
    w = torch.randn(128, generator=g).half().to(DEV)[::2]
    with opsadv.use_backend("cuda"):
        y = opsadv.ops.rms_norm(x, w, 1e-6)
    with opsadv.use_backend("reference"):
        yr = opsadv.ops.rms_norm(x.float(), w.float(), 1e-6)
    assert rel_err(y, yr) < 2e-3


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("operand", ["weight", "bias", "residual"])
def test_layer_norm(variant, operand):
    g = torch.Generator().manual_seed(3)
    m, n = 5, 48
    x = torch.randn(m, n, generator=g).to(DEV)
    w, b = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    if operand == "weight":
        fn = lambda x, b, w: opsadv.ops.layer_norm(x, w, b)  # noqa: E731
        _compare(fn, [x, b], [_view((n,), variant, g)], g)
    elif operand == "bias":
        fn = lambda x, w, b: opsadv.ops.layer_norm(x, w, b)  # noqa: E731
        _compare(fn, [x, w], [_view((n,), variant, g)], g)
    else:
        fn = lambda x, w, b, r: opsadv.ops.layer_norm(x, w, b, residual=r)  # noqa: E731
        _compare(fn, [x, w, b], [_view((m, n), variant, g)], g)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("operand", ["bias", "residual"])
def test_gemm(variant, operand):
    g = torch.Generator().manual_seed(4)
    m, k, n = 6, 32, 24
    a, b = torch.randn(m, k, generator=g).to(DEV), torch.randn(k, n, generator=g).to(DEV)
    if operand == "bias":
        fn = lambda a, b, bias: opsadv.ops.gemm(a, b, bias=bias, activation="gelu_tanh")  # noqa: E731
        _compare(fn, [a, b], [_view((n,), variant, g)], g)
    else:
        fn = lambda a, b, r: opsadv.ops.gemm(a, b, residual=r, activation="silu")  # noqa: E731
        _compare(fn, [a, b], [_view((m, n), variant, g)], g)


@pytest.mark.parametrize("variant", VARIANTS)
def test_swiglu_gemm_bias(variant):
    g = torch.Generator().manual_seed(5)
    m, k, n = 6, 32, 16
    x, w = torch.randn(m, k, generator=g).to(DEV), torch.randn(k, 2 * n, generator=g).to(DEV)
    fn = lambda x, w, bias: opsadv.ops.swiglu_gemm(x, w, bias=bias)  # noqa: E731
    _compare(fn, [x, w], [_view((2 * n,), variant, g)], g)


@pytest.mark.parametrize("variant", VARIANTS)
def test_swiglu_gate_up(variant):
    g = torch.Generator().manual_seed(6)
    _compare(lambda gu: opsadv.ops.swiglu(gu), [], [_view((5, 32), variant, g)], g)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rotary_cos_sin(variant):
    g = torch.Generator().manual_seed(8)
    b, h, s, d = 1, 2, 5, 16
    q, k = torch.randn(b, h, s, d, generator=g).to(DEV), torch.randn(b, h, s, d, generator=g).to(DEV)
    fn = lambda q, k, c, sn: opsadv.ops.rotary_embedding(q, k, c, sn)  # noqa: E731
    _compare(fn, [q, k], [_view((s, d), variant, g), _view((s, d), variant, g)], g)


def _sparse_masks(variant):
    """(block mask (1, 1, 2, 3), key padding (2, 40)), each a `variant` view."""
    bm = torch.tensor([[True, False, True], [True, True, False]])[None, None]
    pad = torch.ones(2, 40, dtype=torch.bool)
    pad[0, 30:] = pad[1, :7] = False
    if variant == "strided":
        return torch.stack((bm, ~bm), -1)[..., 0], torch.stack((pad, ~pad), -1)[..., 0]
    if variant == "expanded":
        return bm[..., :1, :].expand(1, 1, 2, 3), pad[:1].expand(2, 40)
    return (torch.cat((torch.zeros(5, dtype=torch.bool), bm.flatten()))[5:].view(1, 1, 2, 3),
            torch.cat((torch.zeros(3, dtype=torch.bool), pad.flatten()))[3:].view(2, 40))


@pytest.mark.parametrize("variant", VARIANTS)
def test_sparse_attention_masks(variant):
    from opsadv import SparseLayout
    bm, pad = _sparse_masks(variant)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g).to(DEV) for _ in range(3))
    layouts = (SparseLayout.from_block_mask(bm, block_size=16, seq_q=32, seq_k=40),
               SparseLayout.from_padding_mask(pad, block_size=16))
    for lay in layouts:
        qq = q[:, :, :lay.seq_q]
        outs = []
        for backend, kw in (("cuda", {"precision": "fp16"}), ("reference", {})):
            with opsadv.use_backend(backend, **kw):
                outs.append(opsadv.ops.sparse_attention(qq, k, v, lay))
        assert rel_err(outs[0], outs[1]) < 2e-2
