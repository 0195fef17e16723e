"""fp8_attention (FP8 attention, issue 42 part 2): the per-head quantization, the reference against an independent
float64 computation on the dequantized inputs, the Triton kernel through the interpreter, bad inputs, the
differentiable fp8_attention_from_bf16, and GPU tests (`-k gpu`).

Tolerances.  The interpreter's fp8 tl.dot is exact (products of e4m3 values are exact in float32), and the kernel
rounds P on the e4m3 grid itself there (kernels.py, ROUND_P), so against the exact attention of the dequantized
inputs the kernel's only error beyond float32 is P's rounding to e4m3: up to 2^-4 relative per probability, ~2.5%
rms, which does not average away relative to the output of random v (the output is itself such an average).
KERNEL_TOL = 5e-2 bounds it (measured 0.7-2.4%); where all keys of a row fit one kv block the P rounding is
emulated exactly (_emulated) and the kernel must agree to EMULATED_TOL.  lse sums the unrounded P: it matches the
reference to float32 accuracy (LSE_TOL)."""
import math

import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError
from opsadv.ops.fp8_attention import (dequantize_heads, fp8_attention_from_bf16, quantize_heads, quantize_qkv)
from opsadv.ops.fp8_attention.cases import fp8_inputs

from conftest import HAS_CUDA, requires_gpu

E4M3 = torch.float8_e4m3fn
IMPL = "cuda.triton.fp8_attention"
KERNEL_TOL = 5e-2
EMULATED_TOL = 5e-3
LSE_TOL = 1e-4
DEV = "cuda" if HAS_CUDA else "cpu"      # the cuda backend's tests: the interpreter on a CPU, the GPU on one


def _on_dev(args):
    return tuple(t.to(DEV) for t in args)


def _rel(x, y):
    x, y = x.cpu().double(), y.cpu().double()
    return ((x - y).norm() / y.norm()).item()


def _oracle(q8, k8, v8, qd, kd, vd, causal, scale=None):
    """float64 attention of the dequantized inputs, written independently of the reference: per (batch, head) loops,
    descales looked up by index, an explicit causal loop."""
    b, hq, sq, d = q8.shape
    hkv, sk = k8.shape[1], k8.shape[2]
    scale = scale if scale is not None else 1 / math.sqrt(d)

    def factor(ds, bi, hi, heads):
        ds = ds.double().cpu()
        if ds.numel() == 1:
            return ds.reshape(()).item()
        return ds[bi, hi * ds.shape[1] // heads].item()     # (b, h) or q's (b, h_kv)
    out = torch.zeros(b, hq, sq, d, dtype=torch.float64)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            hk = h // (hq // hkv)
            q = q8[bi, h].cpu().double() * factor(qd, bi, h, hq)
            k = k8[bi, hk].cpu().double() * factor(kd, bi, hk, hkv)
            v = v8[bi, hk].cpu().double() * factor(vd, bi, hk, hkv)
            s = q @ k.t() * scale
            for i in range(sq):
                n = min(sk, i + sk - sq + 1) if causal else sk
                if n <= 0:
                    continue
                row = s[i, :n]
                lse[bi, h, i] = torch.logsumexp(row, 0)
                out[bi, h, i] = torch.softmax(row, 0) @ v[:n]
    return out, lse


# ---- quantization ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_quantize_heads_rule_and_round_trip_bound(granularity):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 37, 64, generator=g) * (10.0 ** torch.arange(-2, 4.0)).reshape(2, 3, 1, 1)
    x8, ds = quantize_heads(x, granularity)
    assert x8.dtype == E4M3 and ds.dtype == torch.float32
    assert ds.shape == ((2, 3) if granularity == "head" else ())
    full = ds.reshape(2, 3, 1, 1) if granularity == "head" else ds
    amax = x.abs().amax(dim=(2, 3)) if granularity == "head" else x.abs().amax()
    assert torch.equal(ds, amax / 448)                                # descale = amax / FMAX
    assert torch.equal(x8.view(torch.uint8), (x / full).to(E4M3).view(torch.uint8))   # torch's cast bit for bit
    err = (dequantize_heads(x8, ds).double() - x.double()).abs()
    normal = x.abs() / full >= 2.0 ** -6
    bound = torch.where(normal, x.abs().double() * 2.0 ** -4, (full * 2.0 ** -10).double().expand_as(x))
    assert bool((err <= bound * (1 + 1e-6) + 1e-30).all())
    # the same rule as scaled_gemm's per-tensor quantize_fp8
    from opsadv.ops.scaled_gemm import quantize_fp8
    a8, a_s = quantize_fp8(x[0, 0], "tensor")
    h8, h_s = quantize_heads(x[:1, :1], "tensor")
    assert torch.equal(a8.view(torch.uint8), h8[0, 0].view(torch.uint8)) and torch.equal(a_s, h_s)


def test_quantize_zeros_nan_inf_and_bad_arguments():
    x = torch.zeros(1, 3, 4, 32)
    x[0, 1, 0, 0] = float("nan")
    x[0, 2, 0, 0], x[0, 2, 1, 1] = float("inf"), 3.0
    x8, ds = quantize_heads(x)
    assert ds[0, 0].item() == 1.0 and ds[0, 1].item() == 1.0        # zeros (and NaN only): descale 1
    assert ds[0, 2].item() == torch.tensor(3.0 / 448).item()          # inf ignored by amax, clamped to 448
    assert x8[0, 2, 0, 0].float().item() == 448.0 and math.isnan(x8[0, 1, 0, 0].float().item())
    with pytest.raises(ValueError, match="granularity"):
        quantize_heads(x, "row")
    with pytest.raises(ValueError, match="batch, heads, seq, head_dim"):
        quantize_heads(torch.randn(3, 4, 32))
    with pytest.raises(ValueError, match="float16"):
        quantize_heads(x8)


# ---- reference semantics --------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kw", [
    (1, 2, 2, 1, 1, 32, False, {}),
    (2, 4, 2, 37, 37, 64, True, {"q_kv_head": True}),
    (1, 3, 1, 17, 83, 64, True, {}),
    (1, 2, 2, 40, 19, 32, True, {"granularity": "tensor"}),      # rows that see no key: zeros, lse -inf
])
def test_reference_against_float64_oracle(b, hq, hkv, sq, sk, d, causal, kw):
    args = fp8_inputs(b, hq, hkv, sq, sk, d, torch.Generator().manual_seed(1), **kw)
    want, want_lse = _oracle(*args, causal, scale=0.3)
    with opsadv.use_backend("reference"):
        out, lse = opsadv.ops.fp8_attention(*args, causal=causal, scale=0.3, return_lse=True, out_dtype=torch.float64)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64 and out.shape == (b, hq, sq, d)
    assert _rel(out, want) < 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-12)
    with opsadv.use_backend("reference"):
        bf = opsadv.ops.fp8_attention(*args, causal=causal, scale=0.3)
    assert bf.dtype == torch.bfloat16 and _rel(bf, want) < 4e-3


def test_empty_operands():
    q8, k8, v8, qd, kd, vd = fp8_inputs(1, 2, 2, 3, 5, 32, torch.Generator().manual_seed(0))
    out, lse = opsadv.ops.fp8_attention(q8[:, :, :0], k8, v8, qd, kd, vd, return_lse=True)
    assert out.shape == (1, 2, 0, 32) and lse.shape == (1, 2, 0)
    out, lse = opsadv.ops.fp8_attention(q8, k8[:, :, :0], v8[:, :, :0], qd, kd, vd, return_lse=True)
    assert out.shape == (1, 2, 3, 32) and bool((out == 0).all()) and bool(torch.isneginf(lse).all())


# ---- the Triton kernel (interpreter) ------------------------------------------------------------------------
def _emulated(q8, k8, v8, qd, kd, vd, causal, scale):
    """What the kernel computes when every key of a row lies in one kv block: P = exp(s - rowmax) * 256 rounded to
    e4m3, out = v_descale * (P8 @ v8) / sum(P) (the unrounded P), float64."""
    from opsadv.ops.fp8_attention.reference import expand_descale
    b, hq, sq, d = q8.shape
    hkv, sk = k8.shape[1], k8.shape[2]
    rep = hq // hkv
    qf = dequantize_heads(q8, qd, torch.float64)
    kf = dequantize_heads(k8, kd, torch.float64).repeat_interleave(rep, 1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(s - m) * 256
    p8 = p.float().to(E4M3).double()
    v = v8.double().repeat_interleave(rep, 1)
    vdf = expand_descale(vd, b, hkv).double().repeat_interleave(rep, 1) if vd.numel() > 1 else vd.double()
    l = p.sum(-1, keepdim=True)
    return torch.where(l > 0, (p8 @ v) * vdf / l.clamp_min(1e-300), 0.0)


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kw", [
    (1, 1, 1, 1, 1, 64, False, {}),
    (1, 2, 2, 3, 3, 128, True, {}),
    (2, 4, 2, 37, 37, 64, False, {"q_kv_head": True}),
    (1, 2, 1, 127, 127, 64, True, {}),
    (1, 2, 2, 37, 127, 128, True, {}),                     # bottom-right causal, s_q < s_k
    (1, 2, 2, 40, 19, 32, True, {"granularity": "tensor"}),  # s_q > s_k: rows with no key
])
def test_triton_kernel_matches_reference(b, hq, hkv, sq, sk, d, causal, kw):
    args = _on_dev(fp8_inputs(b, hq, hkv, sq, sk, d, torch.Generator().manual_seed(2), **kw))
    with opsadv.use_backend("reference"):
        want, want_lse = opsadv.ops.fp8_attention(*args, causal=causal, return_lse=True, out_dtype=torch.float32)
    with opsadv.use_backend("cuda", strict=True), opsadv.trace() as t:
        out, lse = opsadv.ops.fp8_attention(*args, causal=causal, return_lse=True, out_dtype=torch.float32)
    assert set(t.counts) == {IMPL}
    assert not torch.isnan(out).any() and _rel(out, want) < KERNEL_TOL
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse[fin], want_lse[fin], rtol=0, atol=LSE_TOL)
    if sk <= 32 and not HAS_CUDA:   # one kv block (the interpreter's BLOCK_N, exact fp8 dot): P's rounding emulated
        assert _rel(out, _emulated(*(t.cpu() for t in args), causal, 1 / math.sqrt(d))) < EMULATED_TOL


@pytest.mark.parametrize("cfg", [dict(BLOCK_M=16, BLOCK_N=32, V_T=True), dict(BLOCK_M=32, BLOCK_N=32, TMA=True),
                                 dict(BLOCK_M=16, BLOCK_N=64, TMA=True, V_T=True)])
def test_kernel_variants_v_transposed_and_tma(cfg):
    """The Hopper configs' variants: V from a seq-contiguous copy (the K-major FP8 operand) and full blocks through
    tensor descriptors (the interpreter runs descriptor loads); the tail blocks take pointer loads."""
    from opsadv.backends.triton_common.fp8_attention.fp8_attention import fp8_fwd
    args = _on_dev(fp8_inputs(2, 4, 2, 37, 80, 64, torch.Generator().manual_seed(3)))
    with opsadv.use_backend("reference"):
        want, want_lse = opsadv.ops.fp8_attention(*args, causal=True, return_lse=True, out_dtype=torch.float32)
    out, lse = fp8_fwd(None, *args, True, 1 / 8, torch.float16, config=cfg)
    assert out.dtype == torch.float16 and _rel(out, want) < KERNEL_TOL
    assert torch.allclose(lse, want_lse, rtol=0, atol=LSE_TOL)


def test_strided_inputs_and_bf16_output():
    """q with a non-unit stride along d (copied), V already seq-contiguous (read as it is), bf16 out (the kernel
    only stores it: no bf16 dot)."""
    q8, k8, v8, qd, kd, vd = _on_dev(fp8_inputs(1, 2, 2, 33, 45, 64, torch.Generator().manual_seed(4)))
    q_s = q8.transpose(2, 3).contiguous().transpose(2, 3)
    v_t = v8.transpose(2, 3).contiguous().transpose(2, 3)
    with opsadv.use_backend("reference"):
        want = opsadv.ops.fp8_attention(q8, k8, v8, qd, kd, vd, out_dtype=torch.float32)
    with opsadv.use_backend("cuda", strict=True):
        out = opsadv.ops.fp8_attention(q_s, k8, v_t, qd, kd, vd)
    assert out.dtype == torch.bfloat16 and _rel(out, want) < KERNEL_TOL


def test_explain_features_and_refusals():
    args = _on_dev(fp8_inputs(2, 4, 2, 37, 50, 64, torch.Generator().manual_seed(0), q_kv_head=True))
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("fp8_attention", *args, causal=True, out_dtype=torch.float16)
    assert {"causal", "gqa", "cross_length", "q_descale_kv_head", "k_descale_head", "v_descale_head"} <= e.spec.features
    assert e.chosen == IMPL and e.spec.dtype == torch.float16
    from opsadv.backends.triton_common.fp8_attention.fp8_attention import impls
    from opsadv.core.env import current_env
    (impl,) = impls(current_env())
    assert impl.min_cc == (8, 9) and impl.backward is None       # A100 / Jetson Orin refused by capability
    from opsadv.backends.ascend import fp8_attention as asc
    from opsadv.backends.ascend.soc import classify_soc
    (a,) = asc.impls(classify_soc(222))
    assert "no FP8" in a.check(None, None)[0]


# ---- bad inputs ----------------------------------------------------------------------------------------------
def _bad(**change):
    q8, k8, v8, qd, kd, vd = fp8_inputs(2, 4, 2, 8, 8, 32, torch.Generator().manual_seed(0))
    d = dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)
    d.update(change)
    return d


@pytest.mark.parametrize("change,arg,words", [
    (dict(q=torch.randn(2, 4, 8, 32, dtype=torch.bfloat16)), "q", "float8_e4m3fn"),
    (dict(k=torch.zeros(2, 2, 8, 32, dtype=torch.float8_e5m2)), "k", "e5m2 is the gradients' format"),
    (dict(v=torch.zeros(2, 2, 9, 32, dtype=E4M3)), "v", "(2, 2, 8, 32)"),
    (dict(k=torch.zeros(2, 3, 8, 32, dtype=E4M3), v=torch.zeros(2, 3, 8, 32, dtype=E4M3)), "k", "dividing"),
    (dict(q_descale=torch.ones(2, 3)), "q_descale", "(2, 4) (per q head) or (2, 2)"),
    (dict(k_descale=torch.ones(2, 4)), "k_descale", "(2, 2) (per kv head)"),
    (dict(v_descale=torch.ones(2, 2, dtype=torch.float64)), "v_descale", "float32"),
    (dict(k_descale=torch.tensor([[1.0, 0.0], [1.0, 1.0]])), "k_descale", "finite descales > 0"),
    (dict(q_descale=torch.tensor(float("inf"))), "q_descale", "finite descales > 0"),
    (dict(out_dtype=E4M3), "out_dtype", "bfloat16"),
    (dict(causal=1), "causal", "a bool"),
    (dict(scale=-1.0), "scale", "finite float > 0"),
])
def test_bad_inputs_name_the_argument(change, arg, words):
    d = _bad(**change)
    tensors = [d.pop(n) for n in ("q", "k", "v", "q_descale", "k_descale", "v_descale")]
    with pytest.raises(InvalidArgumentError) as ei:
        opsadv.ops.fp8_attention(*tensors, **d)
    msg = str(ei.value)
    assert f"argument '{arg}'" in msg and words in msg and "fp8_attention" in msg, msg


def test_requires_grad_refused():
    d = _bad()
    with pytest.raises(InvalidArgumentError, match="forward only"):
        opsadv.ops.fp8_attention(d["q"], d["k"], d["v"], d["q_descale"].requires_grad_(), d["k_descale"],
                                 d["v_descale"])


def test_compile_fullgraph_and_opcheck():
    args = fp8_inputs(1, 2, 1, 9, 12, 32, torch.Generator().manual_seed(0))
    with opsadv.use_backend("reference"):
        want = opsadv.ops.fp8_attention(*args, causal=True)
        got = torch.compile(lambda *a: opsadv.ops.fp8_attention(*a, causal=True), fullgraph=True,
                            backend="eager")(*args)
        torch.library.opcheck(torch.ops.opsadv.fp8_attention.default, (*args, True, None, torch.float32, 0),
                              test_utils=("test_faketensor", "test_autograd_registration"))
    assert torch.equal(got, want)


# ---- training: fp8_attention_from_bf16 -----------------------------------------------------------------------
def _float64_grads(q, k, v, do, causal):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        s = s.masked_fill(j > i + k.shape[2] - q.shape[2], float("-inf"))
    out = torch.softmax(s, -1) @ vd.repeat_interleave(rep, 1)
    return out, torch.autograd.grad(out, (qd, kd, vd), do.double())


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_from_bf16_forward_and_gradients(backend):
    """Out is fp8_attention of quantize_qkv's inputs; the gradients are flash_attention's backward on the dequantized
    inputs (straight through the quantization), within the fp8 error of float64's at the original inputs."""
    g = torch.Generator().manual_seed(5)
    dtype = torch.float32 if backend == "reference" else torch.float16   # (the interpreter has no exact bf16 dot)
    dev = "cpu" if backend == "reference" else DEV
    q, k, v = (torch.randn(s, generator=g).to(dev, dtype).requires_grad_() for s in ((1, 4, 33, 64), (1, 2, 45, 64),
                                                                                      (1, 2, 45, 64)))
    do = torch.randn(1, 4, 33, 64, generator=g).to(dev, dtype)
    with opsadv.use_backend(backend):
        out = fp8_attention_from_bf16(q, k, v, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        assert out.dtype == dtype and dq.dtype == dk.dtype == dv.dtype == dtype
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
        with torch.no_grad():
            direct, lse = opsadv.ops.fp8_attention(q8, k8, v8, qd, kd, vd, causal=True, out_dtype=dtype,
                                                   return_lse=True)
        assert torch.equal(out, direct)
        deq = [dequantize_heads(x8, ds, dtype).requires_grad_() for x8, ds in ((q8, qd), (k8, kd), (v8, vd))]
        want_pass = torch.ops.opsadv.flash_attention_backward(do, *deq, out, lse, None, True, None, False, 0)
    for a, b_ in zip((dq, dk, dv), want_pass):
        assert torch.equal(a, b_)
    ref_out, ref_grads = _float64_grads(q.cpu(), k.cpu(), v.cpu(), do.cpu(), True)
    assert _rel(out, ref_out) < 0.08                 # input quantization (~2^-5 rms per element) + P rounding
    for a, b_ in zip((dq, dk, dv), ref_grads):
        assert _rel(a, b_) < 0.1


def test_from_bf16_refuses_fp8_and_bad_granularity():
    q = torch.randn(1, 2, 4, 32)
    with pytest.raises(InvalidArgumentError, match="granularity"):
        fp8_attention_from_bf16(q, q, q, granularity="row")
    with pytest.raises(InvalidArgumentError, match="argument 'q'"):
        fp8_attention_from_bf16(q.to(E4M3), q, q)


# ---- GPU (skipped without one): `pytest tests/test_fp8_attention.py -k gpu` ----------------------------------
GPU_CASES = [(2, 16, 16, 4096, 4096, 128, False), (2, 16, 16, 4096, 4096, 128, True),
             (1, 32, 8, 2048, 2048, 128, True), (2, 8, 8, 1000, 1000, 64, True), (1, 8, 2, 37, 300, 128, True)]


def _bf16_inputs(b, hq, hkv, sq, sk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to("cuda", torch.bfloat16)
                 for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))


@requires_gpu
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", GPU_CASES)
def test_gpu_kernel_matches_reference_and_bf16_attention(b, hq, hkv, sq, sk, d, causal):
    """Against the exact attention of the dequantized inputs: the P rounding's error (KERNEL_TOL); against bf16
    flash_attention on the unquantized inputs: the input quantization's too (each e4m3 element ~2.5% rms off, a
    few % of the output), at most 15x bf16 flash_attention's own error against float64 there."""
    q, k, v = _bf16_inputs(b, hq, hkv, sq, sk, d)
    args = quantize_qkv(q, k, v)
    with opsadv.use_backend("reference"):
        want, want_lse = opsadv.ops.fp8_attention(*args, causal=causal, return_lse=True, out_dtype=torch.float32)
    with opsadv.use_backend("cuda", strict=True), opsadv.trace() as t:
        out, lse = opsadv.ops.fp8_attention(*args, causal=causal, return_lse=True)
    assert set(t.counts) == {IMPL} and out.dtype == torch.bfloat16
    assert _rel(out, want) < KERNEL_TOL
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-3)
    with opsadv.use_backend("cuda"):
        bf16 = opsadv.ops.flash_attention(q, k, v, causal=causal)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(hq // hkv, 1),
                                                             v.double().repeat_interleave(hq // hkv, 1),
                                                             is_causal=causal) if sq == sk else None
    if exact is not None:
        assert _rel(out, exact) < 15 * _rel(bf16, exact) + 1e-2


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_from_bf16_gradients_against_bf16_backward(causal):
    """fp8_attention_from_bf16's gradients against float64 at the bf16 inputs, beside the bf16 flash_attention's:
    the FP8 forward's input quantization moves them by a few %, not the 2x of bf16's error the issue asks of an FP8
    backward (docs/fp8.md: that needs an FP8 backward on unquantized saved inputs, not written yet)."""
    q, k, v = (t.requires_grad_() for t in _bf16_inputs(2, 8, 8, 2048, 2048, 128, seed=1))
    do = torch.randn_like(q)
    with opsadv.use_backend("cuda"):
        g8 = torch.autograd.grad(fp8_attention_from_bf16(q, k, v, causal=causal), (q, k, v), do)
        g16 = torch.autograd.grad(opsadv.ops.flash_attention(q, k, v, causal=causal), (q, k, v), do)
    _, g64 = _float64_grads(q.cpu(), k.cpu(), v.cpu(), do.cpu(), causal)
    for a, b16, w in zip(g8, g16, g64):
        assert _rel(a, w) < 0.1 and _rel(b16, w) < 1e-2
