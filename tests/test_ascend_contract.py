"""Contract tests of the ascend backend without an NPU: torch_npu is replaced by the in-process
test double (tests/fake_torch_npu), which computes the documented semantics of each torch_npu op
on CPU tensors and records every call.  The backend's mapping code (scale, mask polarity, layouts,
sparse modes, cumulative lengths, softmax statistics, AOE) runs for real and is compared with the
reference backend in float64.  Nothing here says the numbers hold on Ascend hardware."""
from __future__ import annotations

import dataclasses
import importlib.abc
import math
import sys

import pytest
import torch

import opsadv
from opsadv.backends.ascend import _npu, aoe_cli_options, classify_soc
from opsadv.backends.ascend.attention import COMPRESSED, lse_from_softmax_stats, softmax_stats_from_lse
from opsadv.core.env import current_env
from opsadv.errors import InvalidArgumentError, NoKernelError, UnknownOptionError
from opsadv.registry import get_registry, reset_registry

sys.path.insert(0, __import__("os").path.dirname(__file__))
from fake_torch_npu import FakeNPU, install  # noqa: E402

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_out_lse_match(out, lse, ro, rl, tol: float) -> None:
    """An attention (out, lse) against the reference's in float64: shapes, no NaN, out within tol, the same rows
    without a key (lse -inf, out 0), lse within 2e-2 elsewhere."""
    assert out.shape == ro.shape and lse.shape == rl.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel(out, ro) < tol
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin].double() - rl[fin]).abs().max().item() < 2e-2
    assert torch.all(out[~fin] == 0)


def _npu_env(soc_from_env: int | None = None):
    return dataclasses.replace(current_env(), device_type="npu", npu_installed=True, npu_soc_version=soc_from_env,
                               device_name=None, compute_capability=None)


def activate_double(monkeypatch, soc=220, name="Ascend910B3", available=True, soc_from_env=None) -> FakeNPU:
    state = FakeNPU(soc_version=soc, device_name=name, available=available)
    install(monkeypatch, state)
    reset_registry(_npu_env(soc_from_env))
    return state


@pytest.fixture
def npu(monkeypatch):
    """torch_npu = the double on an Atlas A2 (SoC 220); a fresh registry; restored afterwards."""
    state = activate_double(monkeypatch)
    yield state
    sys.modules.pop("torch_npu", None)
    reset_registry()


@pytest.fixture
def restore_registry():
    yield
    sys.modules.pop("torch_npu", None)
    reset_registry()


def ascend_record():
    return get_registry().backends["ascend"]


# ---- SoC classification and probe ------------------------------------------------------------------
@pytest.mark.parametrize("code,family,supported,bf16,fa,aoe", [
    (100, "910A", False, False, False, ()), (104, "910A", False, False, False, ()),
    (200, "310P", True, False, False, (1, 2)), (205, "310P", True, False, False, (1, 2)),
    (220, "A2", True, True, True, (2, 4)), (225, "A2", True, True, True, (2, 4)),
    (240, "310B", True, False, False, ()), (243, "310B", True, False, False, ()),
    (250, "A3", True, True, True, (2,)), (256, "A3", True, True, True, (2,)),
    (260, "950", True, True, True, ()),
    (105, "unknown", False, False, False, ()), (219, "unknown", False, False, False, ()),
    (261, "unknown", False, False, False, ()),
])
def test_soc_classification_table(code, family, supported, bf16, fa, aoe):
    s = classify_soc(code)
    assert (s.family, s.supported, s.bf16, s.fusion_attention, s.aoe_modes) == (family, supported, bf16, fa, aoe)
    if not supported:
        assert s.reason


def test_probe_not_installed_never_imports(monkeypatch, restore_registry):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    reg = reset_registry(_npu_env())
    rec = reg.backends["ascend"]
    assert not rec.available and "not installed" in rec.probe.reasons[0]
    assert "torch_npu" not in sys.modules


class _FailingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import torch_npu` find a module whose import raises `exc`."""

    def __init__(self, exc):
        self.exc = exc

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.exc


@pytest.mark.parametrize("exc,hint", [
    (ImportError("libascendcl.so: cannot open shared object file"), "set_env.sh"),
    (RuntimeError("Two accelerators cannot be used at the same time in PyTorch"), "CUDA build of torch"),
    (RuntimeError("ACL init failed"), "set_env.sh"),
])
def test_probe_import_failures_give_hints(monkeypatch, restore_registry, exc, hint):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder(exc), *sys.meta_path])
    reg = reset_registry(_npu_env())          # must not raise: the failure becomes reasons
    rec = reg.backends["ascend"]
    assert not rec.available
    text = " ".join(rec.probe.reasons)
    assert type(exc).__name__ in text and str(exc) in text and hint in text
    assert not reg.failures or all(f.name != "opsadv.backends.ascend" for f in reg.failures)


def test_probe_no_device(monkeypatch, restore_registry):
    state = activate_double(monkeypatch, available=False)
    rec = ascend_record()
    assert not rec.available and "is_available() is False" in rec.probe.reasons[0]
    assert not state.named("npu.get_soc_version")      # no further device work without a device


def test_probe_refuses_first_generation_910_by_code_not_name(monkeypatch, restore_registry):
    activate_double(monkeypatch, soc=101, name="Ascend910B")   # bare "Ascend910B" is first-gen
    rec = ascend_record()
    assert not rec.available and "first-generation" in rec.probe.reasons[0] and "101" in rec.probe.reasons[0]
    activate_double(monkeypatch, soc=222, name="Ascend910B2")
    assert ascend_record().available and ascend_record().probe.capabilities["soc_family"] == "A2"


def test_probe_uses_env_soc_without_device_call(monkeypatch, restore_registry):
    state = activate_double(monkeypatch, soc=220, soc_from_env=250)
    rec = ascend_record()
    assert rec.available and rec.probe.capabilities["soc_family"] == "A3"
    assert not state.named("npu.get_soc_version")


def test_probe_skips_import_next_to_cuda(monkeypatch, restore_registry):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder(AssertionError("imported")), *sys.meta_path])
    reg = reset_registry(dataclasses.replace(current_env(), device_type="cuda", compute_capability=(9, 0)))
    assert not reg.backends["ascend"].available and "CUDA" in reg.backends["ascend"].probe.reasons[0]


def test_auto_prefers_ascend_on_an_npu(npu):
    info = ascend_record().info
    assert info.device_types == ("npu",) and info.auto_priority > get_registry().backends["cuda"].info.auto_priority
    b = opsadv.use_backend("auto")
    assert b.name == "ascend" and b.profile == "a2"


# ---- flash_attention ----------------------------------------------------------------------------------
def _qkv(b, hq, hkv, sq, sk, d, dtype):
    mk = lambda h, s: torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)  # noqa: E731
    return mk(hq, sq), mk(hkv, sk), mk(hkv, sk)


def _compare_attention(fn, q, k, v, tol, **kw):
    """fn under ascend vs the reference backend in float64, forward (out, lse) and gradients."""
    with opsadv.use_backend("ascend"):
        out, lse = fn(q, k, v, return_lse=True, **kw)
        dout = torch.randn_like(out)
        out.backward(dout)
    grads = [t.grad for t in (q, k, v)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    with opsadv.use_backend("reference"):
        ro, rl = fn(q64, k64, v64, return_lse=True, **kw)
        ro.backward(dout.double())
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel(out, ro) < tol
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)                       # -inf exactly where no key is allowed
    assert (lse[fin].double() - rl[fin]).abs().max().item() < tol * 10
    for g, r in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert not g.isnan().any() and rel(g, r) < tol * 2
    return out, lse


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [
    (1, 1, 1, 1, 1, 16, False), (2, 4, 2, 7, 5, 16, True), (1, 3, 3, 37, 37, 32, True),
    (2, 4, 1, 3, 40, 8, True), (1, 2, 2, 33, 17, 24, False),
])
def test_flash_attention_matches_reference(npu, b, hq, hkv, sq, sk, d, causal):
    torch.manual_seed(sq * 31 + sk)
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, torch.float16)
    _compare_attention(opsadv.ops.flash_attention, q, k, v, TOL[torch.float16], causal=causal)
    call = npu.named("npu_fusion_attention")[-1].kwargs
    assert call["input_layout"] == "BNSD" and call["head_num"] == hq            # GQA native: query heads
    assert call["scale"] == pytest.approx(1 / math.sqrt(d))                     # never the op's default 1.0
    assert call["keep_prob"] == 1.0
    if causal:
        assert call["sparse_mode"] == 3 and tuple(call["atten_mask"].shape) == (COMPRESSED, COMPRESSED)
    else:
        assert call["sparse_mode"] == 0 and call["atten_mask"] is None
    grad = npu.named("npu_fusion_attention_grad")[-1].kwargs
    assert grad["scale_value"] == pytest.approx(1 / math.sqrt(d)) and grad["sparse_mode"] == call["sparse_mode"]


def test_flash_attention_bf16_and_custom_scale(npu):
    torch.manual_seed(3)
    q, k, v = _qkv(1, 2, 2, 9, 11, 16, torch.bfloat16)
    _compare_attention(opsadv.ops.flash_attention, q, k, v, TOL[torch.bfloat16], causal=True, scale=0.3)
    assert npu.named("npu_fusion_attention")[-1].kwargs["scale"] == pytest.approx(0.3)


def test_causal_alignment_more_queries_than_keys(npu):
    """Bottom-right causal with s_q > s_k: the first s_q - s_k rows see no key -> zeros, lse -inf."""
    torch.manual_seed(4)
    q, k, v = _qkv(1, 2, 2, 9, 4, 16, torch.float16)
    out, lse = _compare_attention(opsadv.ops.flash_attention, q, k, v, TOL[torch.float16], causal=True)
    assert torch.all(out[:, :, :5] == 0) and torch.all(torch.isneginf(lse[:, :, :5]))
    assert torch.isfinite(lse[:, :, 5:]).all()


def test_mask_polarity(npu):
    """opsadv bool masks are True = attend; the NPU's atten_mask is True = masked out."""
    torch.manual_seed(5)
    q, k, v = _qkv(2, 2, 1, 6, 10, 16, torch.float16)
    mask = torch.rand(2, 1, 6, 10) > 0.4
    mask[1, 0, 2] = False                                           # one fully masked row
    out, lse = _compare_attention(opsadv.ops.flash_attention, q, k, v, TOL[torch.float16], attn_mask=mask)
    sent = npu.named("npu_fusion_attention")[-1].kwargs
    assert sent["sparse_mode"] == 0 and torch.equal(sent["atten_mask"], ~mask)
    assert torch.all(out[1, :, 2] == 0) and torch.isneginf(lse[1, :, 2]).all()


def test_mask_and_causal_combined_per_head_mask(npu):
    torch.manual_seed(6)
    q, k, v = _qkv(1, 4, 2, 5, 8, 16, torch.float16)
    mask = torch.rand(4, 5, 8) > 0.3                                # (h, s_q, s_k): broadcast over batch
    _compare_attention(opsadv.ops.flash_attention, q, k, v, TOL[torch.float16], attn_mask=mask, causal=True)
    sent = npu.named("npu_fusion_attention")[-1].kwargs["atten_mask"]
    j, i = torch.arange(8)[None, :], torch.arange(5)[:, None]
    assert torch.equal(sent, ~(mask & (j <= i + 3))[None])            # NPU BNSS shape, causal folded in


def test_softmax_stats_helpers_roundtrip():
    lse = torch.tensor([[[0.5, float("-inf"), 2.0]]])
    for layout in ("BNSD", "TND"):
        m, s = softmax_stats_from_lse(lse, layout)
        assert m.shape[-1] == 8 and torch.all(s == 1)
        back = lse_from_softmax_stats(m, s, layout)
        assert torch.equal(back[torch.isfinite(lse)], lse[torch.isfinite(lse)])


def test_inputs_non_contiguous(npu):
    torch.manual_seed(7)
    base = torch.randn(1, 7, 3, 16, dtype=torch.float16)
    q = base.transpose(1, 2).detach().requires_grad_()              # (1, 3, 7, 16), non-contiguous
    k = base.transpose(1, 2).flip(2).detach().requires_grad_()
    v = torch.randn(1, 3, 7, 16, dtype=torch.float16).requires_grad_()
    _compare_attention(opsadv.ops.flash_attention, q, k, v, TOL[torch.float16], causal=True)


# ---- sparse_attention ---------------------------------------------------------------------------------
def _layout(sq, sk, *, fill, causal=False, window=None, cu=None, kpm=None, bs=4, num_global=0):
    bm = torch.full((1, 1, -(-sq // bs), -(-sk // bs)), fill, dtype=torch.bool)
    return opsadv.SparseLayout(sq, sk, bs, bm, causal=causal, window=window, cu_seqlens=cu, key_padding_mask=kpm,
                               num_global=num_global)


def _sparse(layout):
    return lambda q, k, v, **kw: opsadv.ops.sparse_attention(q, k, v, layout, **kw)


@pytest.mark.parametrize("sq,sk,window,causal", [(13, 13, (3, 2), False), (13, 13, (4, 0), True),
                                                  (7, 12, (2, 1), False), (12, 5, (1, 1), True)])
def test_window_is_a_bottom_right_band(npu, sq, sk, window, causal):
    torch.manual_seed(sq + sk)
    q, k, v = _qkv(2, 4, 2, sq, sk, 16, torch.float16)
    lay = _layout(sq, sk, fill=False, window=window, causal=causal)
    _compare_attention(_sparse(lay), q, k, v, TOL[torch.float16])
    sent = npu.named("npu_fusion_attention")[-1].kwargs
    assert sent["sparse_mode"] == 4 and tuple(sent["atten_mask"].shape) == (COMPRESSED, COMPRESSED)
    assert sent["pre_tockens"] == window[0] and sent["next_tockens"] == (min(window[1], 0) if causal else window[1])


@pytest.mark.parametrize("lens,causal,window", [((3, 5, 2), False, None), ((4, 0, 9, 1), True, None),
                                                 ((6, 7), False, (2, 1))])
def test_varlen_is_tnd_with_cumulative_lengths(npu, lens, causal, window):
    torch.manual_seed(sum(lens))
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv(1, 4, 2, t, t, 16, torch.float16)
    lay = _layout(t, t, fill=window is None, causal=causal, window=window, cu=cu)
    _compare_attention(_sparse(lay), q, k, v, TOL[torch.float16])
    sent = npu.named("npu_fusion_attention")[-1]
    assert sent.kwargs["input_layout"] == "TND" and tuple(sent.args[0].shape) == (t, 4, 16)
    assert sent.kwargs["actual_seq_qlen"] == cu[1:].tolist() == sent.kwargs["actual_seq_kvlen"]
    assert sent.kwargs["sparse_mode"] == (4 if window else 3 if causal else 0)


def test_dense_block_mask_is_plain_attention(npu):
    torch.manual_seed(8)
    q, k, v = _qkv(1, 2, 2, 10, 10, 16, torch.float16)
    _compare_attention(_sparse(_layout(10, 10, fill=True, causal=True, window=(1, 1))), q, k, v, TOL[torch.float16])
    assert npu.named("npu_fusion_attention")[-1].kwargs["sparse_mode"] == 3


def test_sparse_rejections_give_reasons(npu):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float16)
    with opsadv.use_backend("ascend"):
        exp = opsadv.explain("sparse_attention", q, k, v, _layout(8, 8, fill=False, window=(1, 1), num_global=1))
        assert exp.chosen is None and "global" in str(exp)
        bm = torch.tensor([[[[True, False], [False, True]]]])
        pattern = opsadv.SparseLayout(8, 8, 4, bm)
        with pytest.raises(NoKernelError, match="block-sparse"):
            opsadv.ops.sparse_attention(q, k, v, pattern)


@pytest.mark.parametrize("fill,causal,window", [(True, False, None), (True, True, None), (False, False, (2, 3)),
                                                (False, True, (3, 0))])
def test_key_padding_is_an_explicit_b1ss_mask(npu, fill, causal, window):
    torch.manual_seed(15)
    q, k, v = _qkv(2, 2, 1, 9, 11, 16, torch.float16)
    kpm = torch.ones(2, 11, dtype=torch.bool)
    kpm[0, 7:] = False
    kpm[1, :] = False                                              # batch 1: every key is padding
    lay = _layout(9, 11, fill=fill, causal=causal, window=window, kpm=kpm)
    out, lse = _compare_attention(_sparse(lay), q, k, v, TOL[torch.float16])
    sent = npu.named("npu_fusion_attention")[-1].kwargs
    assert sent["sparse_mode"] == 0 and tuple(sent["atten_mask"].shape) == (2, 1, 9, 11)
    assert torch.equal(sent["atten_mask"], ~lay.dense_mask())
    assert torch.all(out[1] == 0) and torch.isneginf(lse[1]).all()


def test_window_band_in_inference(npu):
    torch.manual_seed(16)
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 12, 12, 16, torch.float16))
    lay = _layout(12, 12, fill=False, window=(2, 1), causal=True)
    with torch.no_grad(), opsadv.use_backend("ascend"):
        out = opsadv.ops.sparse_attention(q, k, v, lay)
    sent = npu.named("npu_fused_infer_attention_score")[-1].kwargs
    assert (sent["sparse_mode"], sent["pre_tokens"], sent["next_tokens"]) == (4, 2, 0)
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.sparse_attention(q.double(), k.double(), v.double(), lay)
    assert rel(out, ref) < TOL[torch.float16]


# ---- norms and gemm ---------------------------------------------------------------------------------
def _compare(fn, args, tol, ref_args=None):
    with opsadv.use_backend("ascend"):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        gs = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, gs)
    grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    r_args = [a.detach().double().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    with opsadv.use_backend("reference"):
        rout = fn(*r_args)
        routs = rout if isinstance(rout, tuple) else (rout,)
        torch.autograd.backward(routs, [g.double() for g in gs])
    rgrads = [a.grad for a in r_args if isinstance(a, torch.Tensor) and a.requires_grad]
    for o, r in zip(outs, routs):
        assert not o.isnan().any() and rel(o, r) < tol
    for g, r in zip(grads, rgrads):
        assert rel(g, r) < tol * 3
    with opsadv.trace() as t, opsadv.use_backend("ascend"):
        fn(*args)
    assert all(impl.startswith("ascend.") for impl in t.counts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual,offset,weight", [(False, 0.0, True), (True, 0.0, True), (False, 1.0, True),
                                                     (True, 0.0, False)])
def test_rms_norm(npu, dtype, residual, offset, weight):
    torch.manual_seed(9)
    x = torch.randn(3, 5, 67, dtype=dtype, requires_grad=True)
    w = (torch.randn(67, dtype=dtype) * 0.3 + (0 if offset else 1)).requires_grad_() if weight else None
    r = torch.randn(3, 5, 67, dtype=dtype, requires_grad=True) if residual else None
    fn = lambda x, w, r: opsadv.ops.rms_norm(x, w, 1e-5, residual=r, offset=offset)  # noqa: E731
    _compare(fn, (x, w, r), 2e-5 if dtype == torch.float32 else TOL.get(dtype, 4e-3))
    names = [c.name for c in npu.calls]
    assert ("npu_add_rms_norm" if residual else "npu_rms_norm") in names and "npu_rms_norm_backward" in names


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm(npu, dtype, residual):
    torch.manual_seed(10)
    x = torch.randn(4, 3, 33, dtype=dtype, requires_grad=True)
    w = torch.randn(33, dtype=dtype, requires_grad=True)
    bias = torch.randn(33, dtype=dtype, requires_grad=True)
    r = torch.randn(4, 3, 33, dtype=dtype, requires_grad=True) if residual else None
    fn = lambda x, w, b, r: opsadv.ops.layer_norm(x, w, b, 1e-5, residual=r)  # noqa: E731
    _compare(fn, (x, w, bias, r), 2e-5 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm(npu, activation, dtype):
    torch.manual_seed(11)
    a = torch.randn(2, 5, 24, dtype=dtype, requires_grad=True)
    b = (torch.randn(24, 19, dtype=dtype) * 0.2).requires_grad_()
    bias = torch.randn(19, dtype=dtype, requires_grad=True)
    res = torch.randn(2, 5, 19, dtype=dtype, requires_grad=True)
    fn = lambda a, b, bias, res: opsadv.ops.gemm(a, b, bias=bias, activation=activation, residual=res,  # noqa: E731
                                                 alpha=0.7)
    _compare(fn, (a, b, bias, res), 2e-5 if dtype == torch.float32 else 4e-3)
    with torch.no_grad():       # grad-recording calls run the activation as torch ops; no-grad ones fuse it
        fn(a, b, bias, res)
    if activation.startswith("gelu"):
        assert npu.named("npu_gelu")[-1].kwargs["approximate"] == ("tanh" if activation == "gelu_tanh" else "none")


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_gemm(npu, bias):
    torch.manual_seed(12)
    x = torch.randn(7, 24, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(24, 2 * 13, dtype=torch.float16) * 0.2).requires_grad_()
    bb = torch.randn(26, dtype=torch.float16, requires_grad=True) if bias else None
    _compare(lambda x, w, b: opsadv.ops.swiglu_gemm(x, w, bias=b), (x, w, bb), 4e-3)
    with torch.no_grad():       # grad-recording calls run the GEMM, then the swiglu op; no-grad ones fuse them
        opsadv.ops.swiglu_gemm(x, w, bias=bb)
    assert npu.named("npu_swiglu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu(npu, dtype):
    torch.manual_seed(13)
    gu = torch.randn(2, 5, 2 * 19, dtype=dtype, requires_grad=True)
    _compare(opsadv.ops.swiglu, (gu,), 2e-5 if dtype == torch.float32 else 4e-3)
    assert npu.named("npu_swiglu")[-1].kwargs["dim"] == -1


@pytest.mark.parametrize("bshd", [True, False], ids=["bshd-stored", "bhsd"])
@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotary_embedding(npu, dtype, positions, bshd):
    """npu_rotary_mul maps the op (general tables: their halves differ), forward and the -angle backward."""
    torch.manual_seed(14)
    b, hq, hk, s, d = 2, 4, 2, 7, 16
    mk = (lambda h: torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2)) if bshd else (
        lambda h: torch.randn(b, h, s, d, dtype=dtype))
    q, k = mk(hq).requires_grad_(), mk(hk).requires_grad_()
    rows = 11 if positions else s
    cos, sin = torch.randn(rows, d, dtype=dtype), torch.randn(rows, d, dtype=dtype)
    pos = torch.randint(0, rows, (b, s)) if positions else None
    fn = lambda q, k, c, sn: opsadv.ops.rotary_embedding(q, k, c, sn, position_ids=pos)  # noqa: E731
    _compare(fn, (q, k, cos, sin), 2e-5 if dtype == torch.float32 else 4e-3)
    assert len(npu.named("npu_rotary_mul")) >= 4        # q and k, forward and backward


def test_rotary_partial_and_interleaved_refused_with_reasons(npu):
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.float16), torch.randn(1, 2, 3, 8, dtype=torch.float16)
    with opsadv.use_backend("ascend"):
        why = str(opsadv.explain("rotary_embedding", q, k, torch.randn(3, 4, dtype=torch.float16),
                                 torch.randn(3, 4, dtype=torch.float16)))
        assert "ascend.npu_rotary_mul" in why and "partial" in why
        why = str(opsadv.explain("rotary_embedding", q, k, torch.randn(3, 8, dtype=torch.float16),
                                 torch.randn(3, 8, dtype=torch.float16), interleaved=True))
        assert "interleaved" in why


# ---- explain reasons ----------------------------------------------------------------------------------
def test_explain_reasons_on_a2(npu):
    with opsadv.use_backend("ascend"):
        q, k, v = _qkv(1, 2, 2, 4, 4, 16, torch.float32)
        assert "dtype float32 not in" in str(opsadv.explain("flash_attention", q, k, v))
        q, k, v = _qkv(1, 1, 1, 2, 2, 800, torch.float16)
        assert "head_dim 800 > 768" in str(opsadv.explain("flash_attention", q, k, v))
        q, k, v = _qkv(1, 2, 2, 4, 4, 16, torch.float16)
        fmask = torch.zeros(4, 4, dtype=torch.float16)
        assert "attn_mask_float" in str(opsadv.explain("flash_attention", q, k, v, attn_mask=fmask))
        exp = opsadv.explain("flash_attention", q, k, v, causal=True)
        assert exp.chosen == "ascend.npu_fusion_attention"


def test_explain_reasons_on_310p(monkeypatch, restore_registry):
    activate_double(monkeypatch, soc=202, name="Ascend310P3")
    assert opsadv.use_backend("auto").name == "ascend"
    with opsadv.use_backend("ascend"):
        q, k, v = _qkv(1, 2, 2, 4, 4, 16, torch.float16)
        text = str(opsadv.explain("flash_attention", q, k, v))
        assert "npu_fusion_attention needs Atlas A2/A3/950" in text and "log-sum-exp" in text
        x = torch.randn(3, 16, dtype=torch.bfloat16)
        text = str(opsadv.explain("rms_norm", x, torch.ones(16, dtype=torch.bfloat16)))
        assert "bfloat16 needs Atlas A2 (910B)" in text
        x = torch.randn(3, 16, dtype=torch.float16, requires_grad=True)
        _compare(lambda x: opsadv.ops.rms_norm(x, None, 1e-6), (x,), 4e-3)   # fp16 norm serves on 310P


# ---- AOE ------------------------------------------------------------------------------------------------
@pytest.fixture
def aoe_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TUNE_BANK_PATH", raising=False)
    monkeypatch.delenv("AOE_MODE", raising=False)
    return tmp_path


@pytest.mark.parametrize("soc,ok,refused", [(220, (2, 4), (1,)), (250, (2,), (1, 4)), (202, (1, 2), (4,)),
                                            (260, (), (1, 2, 4))])
def test_aoe_modes_per_soc(monkeypatch, restore_registry, aoe_env, soc, ok, refused):
    import os
    state = activate_double(monkeypatch, soc=soc)
    tag = classify_soc(soc).tag
    for mode in ok:
        b = opsadv.use_backend("ascend", aoe_mode=mode)
        opts = b.policy.option_dict
        assert opts["aoe_mode"] == mode
        assert opts["aoe_dump_path"] == str(aoe_env / "aoe" / tag / "dump") == state.aoe_dump_paths[-1]
        assert os.environ["TUNE_BANK_PATH"] == opts["tune_bank_path"] == str(aoe_env / "aoe" / tag / "tune_bank")
        assert os.environ["AOE_MODE"] == str(mode)
    for mode in refused:
        with pytest.raises(InvalidArgumentError, match="aoe_mode") as e:
            opsadv.use_backend("ascend", aoe_mode=mode)
        assert f"SoC {soc}" in str(e.value) and f"{mode} (" in str(e.value)


def test_aoe_mode_1_on_910b_explains(monkeypatch, restore_registry, aoe_env):
    state = activate_double(monkeypatch, soc=223, name="Ascend910B4")
    with pytest.raises(InvalidArgumentError) as e:
        opsadv.use_backend("ascend", aoe_mode=1)
    msg = str(e.value)
    assert "accepts 2 (operator tuning) and 4 (gradient-split tuning)" in msg and "1 (subgraph tuning)" in msg
    assert not state.aoe_dump_paths


def test_aoe_options_validation(npu, aoe_env, tmp_path):
    with pytest.raises(UnknownOptionError):
        opsadv.use_backend("ascend", aoe_mod=2)
    with pytest.raises(InvalidArgumentError):
        opsadv.use_backend("ascend", aoe_mode=3)
    with pytest.raises(InvalidArgumentError):
        opsadv.use_backend("ascend", aoe_mode=True)
    with pytest.raises(InvalidArgumentError):
        opsadv.use_backend("ascend", tune_bank_path=str(tmp_path))     # needs aoe_mode
    bank = tmp_path / "mybank"
    b = opsadv.use_backend("ascend", aoe_mode=2, tune_bank_path=str(bank), aoe_dump_path=str(tmp_path / "d"))
    assert b.policy.option_dict["tune_bank_path"] == str(bank) and bank.is_dir()
    assert npu.aoe_dump_paths[-1] == str(tmp_path / "d")
    assert opsadv.use_backend("ascend").policy.option_dict == {}      # no AOE unless asked
    assert aoe_cli_options(None) == {} and aoe_cli_options("4") == {"aoe_mode": 4}
    with pytest.raises(InvalidArgumentError):
        aoe_cli_options("x")


def test_state_is_the_double(npu):
    assert _npu.STATE.test_double and _npu.device_types() == ("npu", "cpu")


# ---- the inference path ---------------------------------------------------------------------------
def _oracle(q, k, v, **kw):
    with opsadv.use_backend("reference"):
        return opsadv.ops.flash_attention(q.double(), k.double(), v.double(), return_lse=True, **kw)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(attn_mask="b1ss")])
def test_inference_uses_fused_infer_attention(npu, kw):
    torch.manual_seed(13)
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, 9, 6, 16, torch.float16))
    if kw.get("attn_mask") == "b1ss":
        kw = dict(attn_mask=torch.rand(2, 1, 9, 6) > 0.3)
    with torch.no_grad(), opsadv.use_backend("ascend"):
        out, lse = opsadv.ops.flash_attention(q, k, v, return_lse=True, **kw)
    ro, rl = _oracle(q, k, v, **kw)
    assert [c.name for c in npu.calls if "attention" in c.name] == ["npu_fused_infer_attention_score"]
    sent = npu.calls[-1].kwargs
    assert sent["num_heads"] == 4 and sent["num_key_value_heads"] == 2 and sent["softmax_lse_flag"]
    assert sent["scale"] == pytest.approx(0.25) and sent["input_layout"] == "BNSD"
    assert rel(out, ro) < TOL[torch.float16]
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin) and (lse[fin].double() - rl[fin]).abs().max() < 1e-2
    assert torch.all(out[~fin] == 0)


def test_inference_path_limits(npu):
    """head_dim 520 (> 512) and per-head masks stay on npu_fusion_attention; inputs that need
    grad always do."""
    torch.manual_seed(14)
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 3, 3, 520, torch.float16))
    with torch.no_grad(), opsadv.use_backend("ascend"):
        opsadv.ops.flash_attention(q, k, v)
        q, k, v = (t.detach() for t in _qkv(1, 2, 2, 3, 3, 16, torch.float16))
        opsadv.ops.flash_attention(q, k, v, attn_mask=torch.rand(2, 3, 3) > 0.2)
    q, k, v = _qkv(1, 2, 2, 3, 3, 16, torch.float16)
    with opsadv.use_backend("ascend"):
        opsadv.ops.flash_attention(q, k, v)
    assert [c.name for c in npu.calls if "attention" in c.name] == ["npu_fusion_attention"] * 3


def test_conformance_kit_quick_catalogue_under_the_double(npu):
    """The conformance kit's quick catalogue against the double: no cell fails; skips carry reasons."""
    from opsadv.testing import run_conformance
    from opsadv.testing.report import summary
    results = run_conformance("ascend", quick=True, device="cpu")
    # the double runs layer_norm through torch's CPU native_layer_norm_backward, whose bf16 weight / bias gradients
    # carry ~1e-2 relative error (its own accumulation, measured against float64), over the 3x-reference rule: a
    # property of the CPU kernel the double calls, not of the mapping (torch_npu's kernel runs on the NPU)
    cpu_kernel = {("layer_norm", "bfloat16")}
    fails = [f"{r.op}/{r.shape_class} {r.dtype}: {r.reason}" for r in results if r.status == "fail"
             and not ((r.op, str(r.dtype).removeprefix("torch.")) in cpu_kernel and "backward output" in (r.reason or ""))]
    assert not fails, fails
    assert summary(results)["pass"] > 50
    assert all(r.reason for r in results if r.status == "skip")
