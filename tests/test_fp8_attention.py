"""fp8_attention (FP8 attention, issue 42 part 2): the per-head quantization, the reference against an independent
float64 computation on the dequantized inputs, the Triton kernel through the interpreter, bad inputs, the
differentiable fp8_attention_from_bf16 and its FP8 backward, and GPU tests (`-k gpu`).

Tolerances.  The interpreter's fp8 tl.dot is exact (products of e4m3 values are exact in float32), and the kernel
rounds P on the e4m3 grid itself there (kernels.py, ROUND_P), so against the exact attention of the dequantized
inputs the kernel's only error beyond float32 is P's rounding to e4m3: up to 2^-4 relative per probability, ~2.5%
rms, which does not average away relative to the output of random v (the output is itself such an average).
KERNEL_TOL = 5e-2 bounds it (measured 0.7-2.4%); where all keys of a row fit one kv block the P rounding is
emulated exactly (_emulated) and the kernel must agree to EMULATED_TOL.  lse sums the unrounded P: it matches the
reference to float32 accuracy (LSE_TOL).

Backward tolerances.  The FP8 backward kernel's FP8 GEMM (QK^T) is exact under the interpreter and its other GEMMs
run in fp16 there (the interpreter's bf16 dot is wrong), so against the reference backward's float64 emulation of
its roundings (P and dS rounded to fp16) only float32-vs-float64 arithmetic differs: BWD_EMULATED_TOL.  Against
float64 autograd of the dequantized attention with the exact forward out, the fp16 roundings of P, dS and the
gradients remain (measured 3-6e-4): BWD_F64_TOL.  With the kernel forward's out (P rounded to e4m3) delta inherits
that error, ~1% on dq / dk for both backwards alike; there the FP8 backward must be within BWD_FACTOR x the
flash (fp16) backward's error, the issue's criterion."""
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
BWD_EMULATED_TOL = 2e-4
BWD_F64_TOL = 2e-3
BWD_FACTOR = 2.0
HALF = torch.bfloat16 if HAS_CUDA else torch.float16     # the gradients' dtype in the cuda backend's tests


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
    assert impl.min_cc == (8, 9) and impl.backward is not None   # A100 / Jetson Orin refused by capability
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("fp8_attention", *args, causal=True, out_dtype=HALF, backward=True)
        assert e.spec.backward and e.chosen == IMPL
        e = opsadv.explain("fp8_attention", *args, causal=True, out_dtype=torch.float32, backward=True)
        assert e.chosen is None and "bfloat16 or float16" in str(e)      # float32 gradients: not this kernel's
        if not HAS_CUDA:
            e = opsadv.explain("fp8_attention", *args, causal=True, out_dtype=torch.bfloat16, backward=True)
            assert e.chosen is None and "interpreter" in str(e)
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


@pytest.mark.parametrize("backend,backward", [("reference", None), ("cuda", "bf16"), ("cuda", None)])
def test_from_bf16_forward_and_gradients(backend, backward):
    """Out is fp8_attention of quantize_qkv's inputs.  The gradients: flash_attention's backward on the dequantized
    inputs (straight through the quantization) where that is the choice (the reference backend's default,
    backward="bf16"); the FP8 backward (this op's impl.backward) by default on the cuda backend.  Either way within
    the fp8 error of float64's at the original inputs."""
    g = torch.Generator().manual_seed(5)
    dtype = torch.float32 if backend == "reference" else HALF   # (the interpreter has no exact bf16 dot)
    dev = "cpu" if backend == "reference" else DEV
    q, k, v = (torch.randn(s, generator=g).to(dev, dtype).requires_grad_() for s in ((1, 4, 33, 64), (1, 2, 45, 64),
                                                                                      (1, 2, 45, 64)))
    do = torch.randn(1, 4, 33, 64, generator=g).to(dev, dtype)
    with opsadv.use_backend(backend), opsadv.trace() as t:
        out = fp8_attention_from_bf16(q, k, v, causal=True, backward=backward)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert out.dtype == dtype and dq.dtype == dk.dtype == dv.dtype == dtype
    fp8_bwd = backend == "cuda" and backward is None
    fwd_impl = IMPL if backend == "cuda" else "reference.fp8_attention"
    flash = {i for i in t.counts if ".flash_attention" in i}            # (on a GPU maybe a vendor kernel's)
    assert set(t.counts) == ({IMPL} if fp8_bwd else {fwd_impl, *flash}) and len(flash) == (0 if fp8_bwd else 1)
    with opsadv.use_backend(backend):
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
        with torch.no_grad():
            direct, lse = opsadv.ops.fp8_attention(q8, k8, v8, qd, kd, vd, causal=True, out_dtype=dtype,
                                                   return_lse=True)
        assert torch.equal(out, direct)
        if fp8_bwd:
            want_pass = torch.ops.opsadv.fp8_attention_backward(do, q8, k8, v8, qd, kd, vd, out, lse, True, None,
                                                                "fp8", 0)
        else:
            deq = [dequantize_heads(x8, ds, dtype) for x8, ds in ((q8, qd), (k8, kd), (v8, vd))]
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


# ---- the FP8 backward ---------------------------------------------------------------------------------------
def _dequantized_grads(args, do, causal, scale=None):
    """float64 autograd of the dequantized attention (the function the forward evaluated), written without the
    reference: (dq, dk, dv)."""
    q8, k8, v8, qd, kd, vd = args
    rep = q8.shape[1] // k8.shape[1]
    q, k, v = (dequantize_heads(x8, ds, torch.float64).requires_grad_() for x8, ds in ((q8, qd), (k8, kd), (v8, vd)))
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        i, j = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    out = torch.softmax(s, -1).nan_to_num(0.0) @ v.repeat_interleave(rep, 1)    # rows that see no key: 0
    return torch.autograd.grad(out, (q, k, v), do.to(q.device, torch.float64))


def _forward(args, causal, exact: bool):
    """(out, lse) in HALF: the kernel forward's (P rounded to e4m3), or exact (the reference's float64 out)."""
    with opsadv.use_backend("reference" if exact else "cuda", strict=True):
        out, lse = opsadv.ops.fp8_attention(*args, causal=causal, return_lse=True,
                                            out_dtype=torch.float64 if exact else HALF)
    return out.to(HALF), lse.float()


def _fp8_backward(do, args, out, lse, causal, choice="fp8"):
    """The backward op under the cuda backend (the FP8 kernel, or with "bf16" flash_attention's), traced."""
    with opsadv.use_backend("cuda", strict=True), opsadv.trace() as t:
        grads = torch.ops.opsadv.fp8_attention_backward(do, *args, out, lse, causal, None, choice, 0)
    return grads, t.counts


BWD_CASES = [   # (b, h_q, h_kv, s_q, s_k, d, causal, fp8_inputs keywords)
    (1, 2, 2, 37, 37, 64, True, {}),
    (2, 4, 2, 37, 50, 64, True, {"q_kv_head": True}),          # GQA, cross-length, FA3's per-kv-head q descale
    (1, 4, 1, 3, 127, 32, False, {}),                           # MQA, d32, a long key row
    (1, 2, 2, 1, 37, 64, True, {}),                             # one query (bottom-right: it sees every key)
    (1, 2, 2, 127, 127, 128, True, {}),
    (1, 2, 1, 40, 19, 32, True, {"granularity": "tensor"}),    # s_q > s_k: rows that see no key
]


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kw", BWD_CASES)
def test_fp8_backward_kernel_matches_emulation_and_float64(b, hq, hkv, sq, sk, d, causal, kw):
    """The kernel (dispatched through the backward op; its output buffers NaN-poisoned on CPU) against the reference
    backward's float64 emulation of its roundings (tight), and against float64 autograd of the dequantized
    attention (the fp16 roundings of P, dS and the gradients)."""
    from opsadv.ops.fp8_attention.reference import fp8_attention_bwd
    g = torch.Generator().manual_seed(11)
    args = _on_dev(fp8_inputs(b, hq, hkv, sq, sk, d, g, **kw))
    do = torch.randn(b, hq, sq, d, generator=g).to(DEV, HALF)
    out, lse = _forward(args, causal, exact=True)
    grads, counts = _fp8_backward(do, args, out, lse, causal)
    assert set(counts) == {IMPL}
    emulated = fp8_attention_bwd(None, *(t.cpu() for t in (do, *args, out, lse)), causal, 1 / math.sqrt(d),
                                 acc=torch.float64)
    exact = _dequantized_grads(args, do, causal)
    for name, got, em, want in zip("qkv", grads, emulated, exact):
        assert got.dtype == HALF and got.shape == want.shape and not torch.isnan(got).any(), name
        assert _rel(got, em) < (BWD_EMULATED_TOL if not HAS_CUDA else 5e-3), name    # (GPU: exp2 / order differ)
        assert _rel(got, want) < BWD_F64_TOL * (1 if not HAS_CUDA else 4), name      # (GPU: bf16 roundings)
    if sq > sk and causal:          # the rows that see no key get no gradient
        assert bool((grads[0][:, :, :sq - sk] == 0).all())


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kw", [BWD_CASES[1], BWD_CASES[3]])
def test_fp8_backward_within_2x_of_flash_backward(b, hq, hkv, sq, sk, d, causal, kw):
    """The issue's criterion on the CPU: with the kernel forward's out (delta inherits its P rounding), each
    gradient's error against float64 autograd of the dequantized attention is within BWD_FACTOR x that of
    flash_attention's backward (fp16 here, the choice backward="bf16") on the same out and lse."""
    g = torch.Generator().manual_seed(12)
    args = _on_dev(fp8_inputs(b, hq, hkv, sq, sk, d, g, **kw))
    do = torch.randn(b, hq, sq, d, generator=g).to(DEV, HALF)
    out, lse = _forward(args, causal, exact=False)
    fp8, c8 = _fp8_backward(do, args, out, lse, causal)
    half, c16 = _fp8_backward(do, args, out, lse, causal, "bf16")
    assert set(c8) == {IMPL} and IMPL not in c16
    exact = _dequantized_grads(args, do, causal)
    for name, a, h, w in zip("qkv", fp8, half, exact):
        assert _rel(a, w) <= BWD_FACTOR * _rel(h, w), name


@pytest.mark.parametrize("cfg_kv,cfg_q", [
    (dict(BLOCK_M=32, BLOCK_N=16), dict(BLOCK_M=32, BLOCK_N=16)),
    (dict(BLOCK_M=16, BLOCK_N=64, LPT=True), dict(BLOCK_M=64, BLOCK_N=16)),
    (dict(BLOCK_M=16, BLOCK_N=32, TMA=True), dict(BLOCK_M=32, BLOCK_N=32, TMA=True))])
def test_fp8_backward_tiles_strides_and_launch_order(cfg_kv, cfg_q):
    """Other tiles (masked / unmasked q and kv tails, the causal band across tiles), the longest-first launch order
    (LPT), the streamed tiles through TMA descriptors (the interpreter runs descriptor loads; past s_q / s_k they
    read zeros), and strided operands: q8 with a non-unit head-dim stride (copied), V seq-contiguous (copied), dO a
    transposed (b, s, h, d) view, out in (b, s, h, d) memory -- all equal the emulation."""
    from opsadv.backends.triton_common.fp8_attention.fp8_attention import fp8_bwd
    from opsadv.ops.fp8_attention.reference import fp8_attention_bwd
    g = torch.Generator().manual_seed(13)
    q8, k8, v8, qd, kd, vd = _on_dev(fp8_inputs(2, 4, 2, 45, 77, 64, g))
    do = torch.randn(2, 45, 4, 64, generator=g).to(DEV, HALF).transpose(1, 2)
    out, lse = _forward((q8, k8, v8, qd, kd, vd), True, exact=True)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    q_s = q8.transpose(2, 3).contiguous().transpose(2, 3)
    v_t = v8.transpose(2, 3).contiguous().transpose(2, 3)
    got = fp8_bwd(None, do, q_s, k8, v_t, qd, kd, vd, out, lse, True, 0.125, configs=(cfg_kv, cfg_q))
    want = fp8_attention_bwd(None, *(t.cpu() for t in (do, q8, k8, v8, qd, kd, vd, out, lse)), True, 0.125,
                             acc=torch.float64)
    for name, a, w in zip("qkv", got, want):
        assert not torch.isnan(a).any() and _rel(a, w) < (BWD_EMULATED_TOL if not HAS_CUDA else 5e-3), name


def test_from_bf16_backward_choice_and_refusals():
    """backward=: a bad value names the argument; "fp8" that nothing serves raises NoKernelError with every impl's
    reasons at the call (float32 gradients: the kernel's other GEMMs are half precision); the reference backend
    serves "fp8" with its emulation and keeps flash_attention's backward by default; empty operands give zero
    gradients."""
    from opsadv.errors import NoKernelError
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 9, 32, generator=g).requires_grad_() for _ in range(3))
    with pytest.raises(InvalidArgumentError) as ei:
        fp8_attention_from_bf16(q, k, v, backward="fp16")
    assert "argument 'backward'" in str(ei.value) and "'fp8', 'bf16' or None" in str(ei.value)
    with opsadv.use_backend("cuda"), pytest.raises(NoKernelError) as ei:
        fp8_attention_from_bf16(*(t.to(DEV) for t in (q, k, v)), backward="fp8")
    assert "fp8_attention (backward)" in str(ei.value) and IMPL in ei.value.reasons
    assert any("bfloat16 or float16" in r for r in ei.value.reasons[IMPL])
    with opsadv.use_backend("reference"), opsadv.trace() as t:
        out = fp8_attention_from_bf16(q, k, v, causal=True, backward="fp8")
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert set(t.counts) == {"reference.fp8_attention"} and all(not x.isnan().any() for x in grads)
    with opsadv.use_backend("reference"):
        for sq, sk in ((0, 9), (9, 0)):
            qe, ke, ve = (torch.randn(1, 2, n, 32).requires_grad_() for n in (sq, sk, sk))
            grads = torch.autograd.grad(fp8_attention_from_bf16(qe, ke, ve, backward="fp8").sum(), (qe, ke, ve))
            assert [x.shape for x in grads] == [qe.shape, ke.shape, ve.shape]
            assert all(bool((x == 0).all()) for x in grads)


def test_backward_op_opcheck():
    """The backward custom op's fake kernel and schema (compile / export see fp8_attention_from_bf16's backward as
    one op)."""
    args = fp8_inputs(1, 2, 1, 9, 12, 32, torch.Generator().manual_seed(0))
    with opsadv.use_backend("reference"):
        out, lse = opsadv.ops.fp8_attention(*args, causal=True, return_lse=True, out_dtype=torch.float32)
        do = torch.randn_like(out)
        for choice in ("fp8", "bf16", "auto"):
            torch.library.opcheck(torch.ops.opsadv.fp8_attention_backward.default,
                                  (do, *args, out, lse, True, None, choice, 0), test_utils=("test_faketensor",))


def test_error_budget_keeps_p_do_ds_out_of_fp8():
    """Why the backward's only FP8 GEMM is QK^T (bwd_kernels.py, docs/fp8.md), emulated in float64 (s 256): rounding
    P (for dV), dO (for dP) or dS (for dQ / dK) to e4m3 puts that gradient's error above BWD_FACTOR x the bf16
    backward's against float64 autograd of the dequantized attention, while the chosen scheme (exact fp8 operands,
    P and dS in bf16) stays within it."""
    from opsadv.ops.fp8_attention.reference import fp8_attention_bwd
    g = torch.Generator().manual_seed(3)
    b, h, s, d = 1, 2, 256, 64
    args = quantize_qkv(*(torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(3)))
    q, k, v = (dequantize_heads(x8, ds, torch.float64) for x8, ds in zip(args[:3], args[3:]))
    do = torch.randn(b, h, s, d, generator=g).to(torch.bfloat16).double()
    sc = 1 / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    p = torch.softmax((q @ k.transpose(-1, -2) * sc).masked_fill(mask, float("-inf")), -1)
    out = p @ v
    exact = _dequantized_grads(args, do, True)

    def e4m3(x, per_block):   # current-scaled e4m3 rounding (per (b, h), or per row block of 64)
        xs = x.reshape(*x.shape[:-2], -1, 64, x.shape[-1]) if per_block else x
        amax = xs.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30) / 448
        return ((xs / amax).float().to(E4M3).double() * amax).reshape(x.shape)

    def grads(fp8_p=False, fp8_do=False, fp8_ds=False):
        bf = lambda x: x.to(torch.bfloat16).double()     # noqa: E731  (the bf16 backward's roundings)
        pr = e4m3(p, False) if fp8_p else bf(p)
        dv = pr.transpose(-1, -2) @ (e4m3(do, False) if fp8_p else do)
        dp = (e4m3(do, False) if fp8_do else do) @ v.transpose(-1, -2)
        ds = p * (dp - (do * bf(out)).sum(-1, keepdim=True))
        dsr = e4m3(ds, True) if fp8_ds else bf(ds)
        return dsr @ k * sc, dsr.transpose(-1, -2) @ q * sc, dv

    chosen = fp8_attention_bwd(None, do.to(torch.bfloat16), *args, out.to(torch.bfloat16), torch.logsumexp(
        (q @ k.transpose(-1, -2) * sc).masked_fill(mask, float("-inf")), -1).float(), True, sc, acc=torch.float64)
    base = [_rel(x, w) for x, w in zip(grads(), exact)]
    assert all(_rel(x, w) <= BWD_FACTOR * e for x, w, e in zip(chosen, exact, base))
    for flags, hit in (({"fp8_p": True}, (2,)), ({"fp8_do": True}, (0, 1)), ({"fp8_ds": True}, (0, 1))):
        err = [_rel(x, w) for x, w in zip(grads(**flags), exact)]
        assert all(err[i] > BWD_FACTOR * base[i] for i in hit), (flags, err, base)


_BWD_COMPILE = r"""
import json, os, re
os.environ.pop("TRITON_INTERPRET", None)
import torch
from opsadv.backends.cuda.profiles import FP8_ATTN_TILES
from opsadv.backends.triton_common.fp8_attention import bwd_kernels as B
from opsadv.backends.triton_common.tma import desc_bhsd
from opsadv.testing.sm90 import compile_sm90
b, h, s = 2, 16, 4096
out = {}
for d in (64, 128):
    q = torch.empty(b, h, s, d, dtype=torch.float8_e4m3fn)
    do = torch.empty(b, h, s, d, dtype=torch.bfloat16)
    lse2, ds = torch.empty(b, h, s), torch.ones(b, h)
    tail = ds.stride() * 3 + (h, 1, 1, s, s, 0, 0.1, 0.08)
    for name in ("kv", "q"):
        t = FP8_ATTN_TILES["h100"]["bwd_" + name][d][0]
        if name == "kv":    # streamed: q8 / dO tiles of BLOCK_M rows
            descs = (desc_bhsd(q, t["BLOCK_M"]), desc_bhsd(do, t["BLOCK_M"])) if t["TMA"] else (None, None)
            fn, args = B.fp8_bwd_kv_kernel, ((q, q, q, do, do, do, lse2, lse2, ds, ds, ds, *descs)
                                             + q.stride()[:3] * 3 + do.stride()[:3] * 3 + tail)
        else:               # streamed: k8 / v8 tiles of BLOCK_N rows
            descs = (desc_bhsd(q, t["BLOCK_N"]), desc_bhsd(q, t["BLOCK_N"])) if t["TMA"] else (None, None)
            fn, args = B.fp8_bwd_q_kernel, ((q, q, q, do, do, lse2, lse2, ds, ds, ds, *descs)
                                            + q.stride()[:3] * 3 + do.stride()[:3] * 2 + tail)
        kw = dict(zip(fn.arg_names, args), HEAD_DIM=d, BLOCK_D=d, BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
                  CAUSAL=True, EVEN_M=True, TMA=t["TMA"], **({"EVEN_N": True, "LPT": False} if name == "kv" else {}))
        r = compile_sm90(fn, kw, num_warps=t["num_warps"], num_stages=t["num_stages"])
        wg = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f32\.(\w+)\.(\w+)", r["ptx"])
        out[f"{name}{d}"] = {"spills": r["spill_stores"] + r["spill_loads"], "wgmma": sorted(set(wg)),
                             "tma_loads": r["tma_loads"], "tma": t["TMA"]}
print(json.dumps(out))
"""


def test_fp8_backward_compiles_for_sm90():
    """Compiled for sm_90a without a GPU (ptxas): in both kernels QK^T is an e4m3 wgmma and the other GEMMs bf16
    wgmmas, and the h100 profile's default tiles (d64; d128 through TMA; causal) do not spill."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _BWD_COMPILE]).strip().splitlines()[-1])
    for name, rep in r.items():
        assert rep["spills"] == 0 and rep["wgmma"] == [["bf16", "bf16"], ["e4m3", "e4m3"]], (name, rep)
        assert (rep["tma_loads"] > 0) == rep["tma"], (name, rep)


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
    """fp8_attention_from_bf16's gradients (the FP8 backward, the cuda backend's default) against float64 at the
    original bf16 inputs, beside the bf16 flash_attention's: the FP8 forward's input quantization moves them by a
    few %, whichever backward runs (the issue's 2x criterion is taken at the point the forward evaluated, the
    dequantized inputs: test_gpu_fp8_backward_error_within_2x_of_bf16_backward)."""
    q, k, v = (t.requires_grad_() for t in _bf16_inputs(2, 8, 8, 2048, 2048, 128, seed=1))
    do = torch.randn_like(q)
    with opsadv.use_backend("cuda"):
        g8 = torch.autograd.grad(fp8_attention_from_bf16(q, k, v, causal=causal), (q, k, v), do)
        g16 = torch.autograd.grad(opsadv.ops.flash_attention(q, k, v, causal=causal), (q, k, v), do)
    _, g64 = _float64_grads(q.cpu(), k.cpu(), v.cpu(), do.cpu(), causal)
    for a, b16, w in zip(g8, g16, g64):
        assert _rel(a, w) < 0.1 and _rel(b16, w) < 1e-2


GPU_BWD_CASES = [(1, 8, 8, 2048, 128, True), (1, 8, 8, 2048, 128, False), (1, 16, 4, 1024, 128, True),
                 (2, 4, 4, 1000, 64, True)]


@requires_gpu
@pytest.mark.parametrize("b,hq,hkv,s,d,causal", GPU_BWD_CASES)
def test_gpu_fp8_backward_error_within_2x_of_bf16_backward(b, hq, hkv, s, d, causal):
    """The issue's criterion: fp8_attention_from_bf16's gradients by the FP8 backward (the cuda backend's default)
    and by backward="bf16" (flash_attention's backward on the dequantized inputs), each against float64 autograd of
    the dequantized attention (what the FP8 forward evaluated; both backwards read its out and lse): every FP8
    gradient's error within BWD_FACTOR x the bf16 one's."""
    q, k, v = (t.requires_grad_() for t in _bf16_inputs(b, hq, hkv, s, s, d, seed=2))
    do = torch.randn_like(q)
    with opsadv.use_backend("cuda"), opsadv.trace() as t:
        g8 = torch.autograd.grad(fp8_attention_from_bf16(q, k, v, causal=causal), (q, k, v), do)
    assert set(t.counts) == {IMPL} and t.counts[IMPL] == 2           # forward and backward
    with opsadv.use_backend("cuda"):
        g16 = torch.autograd.grad(fp8_attention_from_bf16(q, k, v, causal=causal, backward="bf16"), (q, k, v), do)
    exact = _dequantized_grads(quantize_qkv(q.detach(), k.detach(), v.detach()), do, causal)
    errs = {n: (_rel(a, w), _rel(h, w)) for n, a, h, w in zip("qkv", g8, g16, exact)}
    assert all(e8 <= BWD_FACTOR * e16 for e8, e16 in errs.values()), errs


@requires_gpu
@pytest.mark.parametrize("b,hq,hkv,s,d,causal", GPU_BWD_CASES[2:])
def test_gpu_fp8_backward_matches_emulation(b, hq, hkv, s, d, causal, monkeypatch):
    """The kernel on the GPU (output buffers NaN-poisoned) against the reference backward's float64 emulation of its
    roundings: only float32 arithmetic (exp2, summation order) differs, and the bf16 roundings it moves."""
    from opsadv.ops.fp8_attention.reference import fp8_attention_bwd
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    args = quantize_qkv(*_bf16_inputs(b, hq, hkv, s, s, d, seed=3))
    do = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    out, lse = _forward(args, causal, exact=False)
    grads, counts = _fp8_backward(do, args, out, lse, causal)
    assert set(counts) == {IMPL}
    want = fp8_attention_bwd(None, do, *args, out, lse, causal, 1 / math.sqrt(d), acc=torch.float64)
    for name, a, w in zip("qkv", grads, want):
        assert not torch.isnan(a).any() and _rel(a, w) < 5e-3, name
