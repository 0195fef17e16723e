"""scaled_swiglu_gemm (FP8 SwiGLU / GeGLU GEMM, issue 42): the reference against an independent float64 computation
on the dequantized operands, the Triton kernels (pointer and TMA) under the interpreter (its fp8 tl.dot is exact in
float32 at these sizes; outputs float32 / float16, never bf16, whose interpreter path is not exact) on odd shapes,
strided and row-major operands, every scale granularity, fp8 output; the conformance cases on the cuda backend; bad
inputs naming the op and argument; compile / opcheck; sm_90 compiles of the h100 tiles without spills; GPU tests
(`-k gpu`, skipped without one)."""
import json

import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv.errors import InvalidArgumentError, NoKernelError
from opsadv.ops.scaled_gemm import quantize_fp8
from opsadv.ops.scaled_gemm.reference import FP8_MAX

from conftest import HAS_CUDA, requires_gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OP = "scaled_swiglu_gemm"
TRITON = ("cuda.triton.scaled_swiglu_gemm", "cuda.triton.scaled_swiglu_gemm_tma")
DEV = "cuda" if HAS_CUDA else "cpu"
# Hopper's FP8 MMA accumulates with fewer than fp32's bits between promotions; the interpreter's dot is exact float32
KERNEL_TOL = 2e-3 if HAS_CUDA else 1e-6


def _u8(t):
    return t.view(torch.uint8)


def _operands(m, k, n, gx, gw, dx=E4M3, dw=E4M3, seed=0, w_col_major=True, x_row_stride=None, device="cpu"):
    """x (m, k), w_gate_up (k, 2n) fp8 with their scales.  Rows of x, and the gate / up columns of w, of magnitudes
    far apart, so a scale on the wrong row / column / block or a gate paired with the wrong up column shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64) * (4.0 ** (torch.arange(m) % 5 - 2))[:, None]
    w = torch.randn(k, 2 * n, generator=g, dtype=torch.float64) * k ** -0.5
    w = w * (2.0 ** (torch.arange(2 * n) % 3 + 2.0 * (torch.arange(2 * n) >= n)))[None, :] \
        * (2.0 ** (torch.arange(k) // 128 % 3))[:, None]
    x8, sx = quantize_fp8(x, gx, dx)
    w8, sw = quantize_fp8(w, gw, dw)
    if w_col_major:
        w8 = w8.t().contiguous().t()
    if x_row_stride:                   # x's rows inside a wider buffer
        buf = torch.zeros(m, x_row_stride, dtype=torch.uint8)
        buf[:, :k] = _u8(x8)
        x8 = buf.view(dx)[:, :k]
    return tuple(t.to(device) for t in (x8, w8, sx, sw))


def _deq(x8, s):
    """x8 * scale in float64, the scale's granularity read from its shape (written apart from the library's)."""
    s = s.double().cpu()
    x = x8.cpu().double()
    if s.numel() == 1:
        return x * s.reshape(())
    r, c = x.shape
    i, j = torch.arange(r)[:, None], torch.arange(c)[None, :]
    if s.shape == (r, 1):
        full = s[i, 0 * j]
    elif s.shape == (1, c):
        full = s[0 * i, j]
    elif s.shape == (r, -(-c // 128)):
        full = s[i, j // 128]
    else:
        full = s[i // 128, j // 128]
    return x * full


def _oracle(x8, w8, sx, sw, bias=None, activation="silu"):
    gu = _deq(x8, sx) @ _deq(w8, sw)
    if bias is not None:
        gu = gu + bias.cpu().double()
    n = gu.shape[1] // 2
    act = F.silu if activation == "silu" else (lambda z: F.gelu(z, approximate="tanh"))
    return act(gu[:, :n]) * gu[:, n:]


def _rel(x, y):
    x, y = x.cpu().double(), y.cpu().double()
    return ((x - y).norm() / y.norm()).item()


# ---- reference semantics ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 127])
@pytest.mark.parametrize("gx,gw", [("tensor", "tensor"), ("row", "col"), ("block1x128", "block128x128"),
                                   ("tensor", "block128x128")])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_reference_against_float64_oracle(m, gx, gw, activation):
    x8, w8, sx, sw = _operands(m, 256, 72, gx, gw)        # N = 72: a 128-column scale block spans gate and up
    bias = torch.randn(144, dtype=torch.bfloat16)
    with opsadv.use_backend("reference"), opsadv.trace() as t:
        y = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, bias=bias, activation=activation, out_dtype=torch.float32)
    assert dict(t.counts) == {"reference.scaled_swiglu_gemm": 1}
    assert y.dtype == torch.float32 and y.shape == (m, 72)
    assert _rel(y, _oracle(x8, w8, sx, sw, bias, activation)) < 1e-7        # float64 inside, float32 out


def test_reference_equals_scaled_gemm_then_swiglu():
    """The op is swiglu(scaled_gemm(...)) on the same [W_g | W_u]: the composition it replaces."""
    x8, w8, sx, sw = _operands(17, 128, 40, "row", "col", dw=E5M2)
    with opsadv.use_backend("reference"):
        y = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, activation="gelu_tanh", out_dtype=torch.float32)
        gu = opsadv.ops.scaled_gemm(x8, w8, sx, sw, out_dtype=torch.float32)
        z = opsadv.ops.swiglu(gu.double(), activation="gelu_tanh")
    assert _rel(y, z) < 1e-6


@pytest.mark.parametrize("fp8", [True, E5M2])
def test_reference_fp8_output(fp8):
    x8, w8, sx, sw = _operands(33, 256, 64, "block1x128", "block128x128")
    with opsadv.use_backend("reference"):
        y8, ys = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, out_fp8=fp8)
    dtype = E4M3 if fp8 is True else fp8
    want = _oracle(x8, w8, sx, sw)
    assert y8.dtype == dtype and y8.shape == (33, 64) and ys.shape == () and ys.dtype == torch.float32
    assert abs(ys.item() - want.abs().max().item() / FP8_MAX[dtype]) <= 1e-5 * ys.item()
    assert _rel(y8.double() * ys.double(), want) < (0.04 if dtype == E4M3 else 0.08)
    assert y8.float().abs().max().item() == FP8_MAX[dtype]


def test_empty_and_k_zero():
    one = torch.ones(())
    y = opsadv.ops.scaled_swiglu_gemm(torch.zeros(0, 32, dtype=E4M3), torch.zeros(32, 16, dtype=E4M3), one, one)
    assert y.shape == (0, 8) and y.dtype == torch.bfloat16
    bias = torch.randn(16)
    y = opsadv.ops.scaled_swiglu_gemm(torch.zeros(3, 0, dtype=E4M3), torch.zeros(0, 16, dtype=E4M3), one, one,
                                      bias=bias, out_dtype=torch.float32)
    assert torch.allclose(y, (F.silu(bias[:8]) * bias[8:]).expand(3, 8))


# ---- the Triton kernels (the interpreter on CPU tensors, or the GPU) ---------------------------------------------
KERNEL_CASES = [
    # m, k, n, gx, gw, kw
    (1, 128, 48, "tensor", "tensor", {"bias": True}),
    (3, 80, 40, "row", "col", {"activation": "gelu_tanh"}),                      # K tail (BLOCK_K 32), N ragged
    (127, 96, 24, "row", "col", {"x_row_stride": 160, "bias": True}),            # strided x rows
    (5, 256, 72, "block1x128", "block128x128", {"bias": True}),                  # a scale block spans gate and up
    (37, 128, 48, "row", "block128x128", {"w_col_major": False, "dw": E5M2}),    # row-major e5m2 w
    (9, 128, 40, "tensor", "col", {"dx": E5M2, "activation": "gelu_tanh", "out": torch.float16}),
]


@pytest.mark.parametrize("impl", TRITON)
@pytest.mark.parametrize("m,k,n,gx,gw,kw", KERNEL_CASES)
def test_triton_kernel_matches_oracle(impl, m, k, n, gx, gw, kw):
    kw = dict(kw)
    op_kw = {"activation": kw.pop("activation", "silu"), "out_dtype": kw.pop("out", torch.float32)}
    bias = kw.pop("bias", False)
    x8, w8, sx, sw = _operands(m, k, n, gx, gw, device=DEV, **kw)
    if bias:
        op_kw["bias"] = torch.randn(2 * n, dtype=torch.float16, device=DEV)
    with opsadv.use_backend("reference"):
        want = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, **{**op_kw, "out_dtype": torch.float32})
    with opsadv.use_backend("cuda", strict=True, impls={OP: impl}), opsadv.trace() as t:
        got = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, **op_kw)
    assert dict(t.counts) == {impl: 1}
    assert got.dtype == op_kw["out_dtype"] and got.shape == (m, n) and bool(got.isfinite().all())
    tol = KERNEL_TOL if got.dtype == torch.float32 else 2e-3            # float16 out: its own rounding
    assert _rel(got, want) < tol
    assert _rel(want, _oracle(x8, w8, sx, sw, op_kw.get("bias"), op_kw["activation"])) < 1e-7


@pytest.mark.parametrize("impl", TRITON)
@pytest.mark.parametrize("config", [(16, 16, 32, 4, 1), (64, 64, 64, 4, 1)])
def test_every_output_element_written(impl, config, monkeypatch):
    """The impl called with tiles smaller and larger than the output (outputs start as NaN on the CPU and under
    OPSADV_POISON_OUTPUTS: an unwritten element stays NaN)."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    from opsadv.backends.triton_common.scaled_gemm import scaled_gemm as S
    x8, w8, sx, sw = _operands(37, 128, 40, "row", "col", device=DEV)
    with opsadv.use_backend("reference"):
        want = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, out_dtype=torch.float32)
    got, scale = S._swiglu_run(None, x8, w8, sx, sw, None, "silu", torch.float32, None, tma=impl.endswith("tma"),
                               config=config)
    assert scale is None and bool(got.isfinite().all()) and _rel(got, want) < KERNEL_TOL


@pytest.mark.parametrize("impl", TRITON)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_triton_fp8_output_amax_and_rounding(impl, fp8):
    x8, w8, sx, sw = _operands(37, 256, 40, "row", "col", device=DEV)
    bias = torch.randn(80, device=DEV)
    with opsadv.use_backend("reference"):
        w8_, ws = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, bias=bias, out_fp8=fp8)
    with opsadv.use_backend("cuda", strict=True, impls={OP: impl}):
        y8, ys = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, bias=bias, out_fp8=fp8)
    assert y8.dtype == fp8 and y8.shape == (37, 40) and ys.shape == ()
    assert abs(ys.item() - ws.item()) <= max(2e-7, KERNEL_TOL) * ws.item()     # every tile's amax, reduced
    # the same fp8 values but for elements whose float32 value sits on a rounding tie's edge
    assert (y8.float() != w8_.float()).float().mean().item() < (0.01 if DEV == "cpu" else 0.05)


def test_conformance_cases_on_the_cuda_backend():
    """The op's conformance cases (fp8 operands kept as built) through the cuda backend's Triton kernel, against the
    reference, float32 and float16 cells (bf16 cells are the GPU's: the interpreter's bf16 stores round toward zero)."""
    from opsadv.testing import CATALOGUE, run_case
    cases = [c for c in CATALOGUE if c.op == OP]
    assert len(cases) == 4
    for case in cases:
        for dtype in (torch.float32, torch.float16):
            r = run_case(case, "cuda", dtype, DEV, seed=3)
            assert r.status == "pass" and r.impl.startswith("cuda.triton.scaled_swiglu_gemm"), (case.name, r)


def test_explain_features_and_tma_refusal():
    x8, w8, sx, sw = _operands(3, 40, 24, "row", "col", dw=E5M2, w_col_major=False)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain(OP, x8, w8, sx, sw, bias=torch.zeros(48), activation="gelu_tanh", out_fp8=True)
    assert {"scale_a_row", "scale_b_col", "b_e5m2", "b_row_major", "bias", "act_gelu_tanh", "out_fp8"} \
        <= e.spec.features
    assert e.spec.shapes == ((3, 40), (40, 48))
    reasons = {c.impl.id: " ".join(c.reasons) for c in e.candidates}
    if DEV == "cpu":        # (the interpreter takes every impl but for the TMA one's shape rules)
        assert "K a multiple of 16" in reasons["cuda.triton.scaled_swiglu_gemm_tma"]
        assert "N a multiple of 16, got N=24" in reasons["cuda.triton.scaled_swiglu_gemm_tma"]
        assert e.chosen == "cuda.triton.scaled_swiglu_gemm"


# ---- bad inputs ----------------------------------------------------------------------------------------------
def _bad(**change):
    x8, w8, sx, sw = _operands(4, 256, 16, "row", "col")
    d = dict(x=x8, w_gate_up=w8, x_scale=sx, w_scale=sw)
    d.update(change)
    return d


@pytest.mark.parametrize("change,arg,words", [
    (dict(x=torch.randn(4, 256, dtype=torch.bfloat16)), "x", "float8_e4m3fn"),
    (dict(x=torch.zeros(2, 4, 256, dtype=E4M3)), "x", "rank 2"),
    (dict(w_gate_up=torch.zeros(128, 32, dtype=E4M3)), "w_gate_up", "K = 256"),
    (dict(w_gate_up=torch.zeros(256, 31, dtype=E4M3), w_scale=torch.ones(())), "w_gate_up", "even second dim"),
    (dict(x_scale=torch.ones(4, 3)), "x_scale", "(4, 2) (1x128 blocks"),
    (dict(w_scale=torch.ones(32, 1)), "w_scale", "(1, 32) (per column)"),
    (dict(w_scale=torch.ones(1, 32, dtype=torch.float16)), "w_scale", "float32"),
    (dict(x_scale=torch.tensor([[1.0], [float("nan")], [1.0], [1.0]])), "x_scale", "finite scales > 0"),
    (dict(w_scale=-torch.ones(1, 32)), "w_scale", "finite scales > 0"),
    (dict(bias=torch.randn(16)), "bias", "(32,) ([b_gate | b_up])"),
    (dict(bias=torch.randn(32, dtype=torch.float64)), "bias", "float32"),
    (dict(activation="relu"), "activation", "gelu_tanh"),
    (dict(out_dtype=torch.float8_e4m3fn), "out_dtype", "out_fp8=True"),
    (dict(out_fp8="e4m3"), "out_fp8", "float8_e5m2"),
    (dict(w_scale=torch.ones(1, 32, device="meta")), "w_scale", "same as x"),
])
def test_bad_inputs_name_the_argument(change, arg, words):
    d = _bad(**change)
    with pytest.raises(InvalidArgumentError) as ei:
        opsadv.ops.scaled_swiglu_gemm(d.pop("x"), d.pop("w_gate_up"), d.pop("x_scale"), d.pop("w_scale"), **d)
    msg = str(ei.value)
    assert f"argument '{arg}'" in msg and words in msg and OP in msg, msg


def test_block_scales_need_k_multiple_of_128_and_grad_refused():
    x8, w8 = torch.zeros(4, 192, dtype=E4M3), torch.zeros(192, 32, dtype=E4M3)
    with pytest.raises(InvalidArgumentError, match="K a multiple of 128"):
        opsadv.ops.scaled_swiglu_gemm(x8, w8, torch.ones(4, 2), torch.ones(()))
    x8, w8, sx, sw = _operands(4, 128, 16, "tensor", "tensor")
    with pytest.raises(InvalidArgumentError, match="forward only"):
        opsadv.ops.scaled_swiglu_gemm(x8, w8, sx.requires_grad_(), sw)


def test_pinned_impl_that_cannot_serve_raises_with_reason():
    x8, w8, sx, sw = _operands(3, 40, 24, "row", "col")
    with opsadv.use_backend("cuda", strict=True, impls={OP: "cuda.triton.scaled_swiglu_gemm_tma"}):
        with pytest.raises(NoKernelError, match="K a multiple of 16"):
            opsadv.ops.scaled_swiglu_gemm(x8.to(DEV), w8.to(DEV), sx.to(DEV), sw.to(DEV))


def test_compile_fullgraph_and_opcheck():
    x8, w8, sx, sw = _operands(8, 128, 16, "row", "col")
    bias = torch.randn(32)
    with opsadv.use_backend("reference"):
        want = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, bias=bias, out_fp8=True)
        got = torch.compile(lambda *a: opsadv.ops.scaled_swiglu_gemm(*a, bias=bias, out_fp8=True), fullgraph=True,
                            backend="eager")(x8, w8, sx, sw)
        # (opcheck's test_schema compares fp8 tensors with a mul CPU torch lacks for float8: left out)
        torch.library.opcheck(torch.ops.opsadv.scaled_swiglu_gemm.default,
                              (x8, w8, sx, sw, bias, "gelu_tanh", torch.float16, None, 0),
                              test_utils=("test_faketensor", "test_autograd_registration"))
    assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])


# ---- sm_90 compiles of the h100 tiles (no GPU needed; skipped without ptxas) ---------------------------------------
_SM90 = r"""
import json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.tools.tensor_descriptor import TensorDescriptor
from opsadv.testing.sm90 import compile_sm90
from opsadv.backends.triton_common.scaled_gemm import kernels as K
from opsadv.backends.cuda.profiles import SCALED_GEMM_CONFIGS
E4M3 = torch.float8_e4m3fn
m, k, n = 16384, 2048, 8192
res = {}
for kind, cfgs in SCALED_GEMM_CONFIGS["h100"].items():
    if not kind.startswith("swiglu"):
        continue
    block = kind == "swiglu_block"
    for cfg in cfgs:
        for tma in (True, False):
            bm, bn, bk, warps, stages = cfg
            a, bt = torch.empty(m, k, dtype=E4M3), torch.empty(2 * n, k, dtype=E4M3)
            sa = torch.empty(m, k // 128 if block else 1)
            sb = torch.empty(k // 128, 2 * n // 128) if block else torch.empty(1, 2 * n)
            args = dict(a_ptr=a, b_ptr=bt, a_desc=TensorDescriptor.from_tensor(a, [bm, bk]),
                        b_desc=TensorDescriptor.from_tensor(bt, [bn, bk]), out_ptr=torch.empty(m, n),
                        bias_ptr=torch.empty(2 * n, dtype=torch.bfloat16), res_ptr=a, sa_ptr=sa, sb_ptr=sb,
                        amax_ptr=torch.empty(1), M=m, N=n, K=k, M_BUCKET=m,
                        s_am=k, s_ak=1, s_bk=1, s_bn=k, s_om=n, s_on=1, s_rm=0, s_rn=0,
                        s_sam=sa.stride(0), s_sak=1 if block else 0, s_sbk=sb.stride(0) if block else 0, s_sbn=1,
                        TMA=tma, B_NK=tma, A_BLOCK=block, B_BLOCK=block, ACT=3, HAS_BIAS=True, HAS_RES=False,
                        OUT_FP8=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SWIGLU=True)
            r = compile_sm90(K.scaled_gemm_kernel, args, warps, stages)
            res[f"{kind} {cfg} tma={tma}"] = {"spills": r["spill_stores"] + r["spill_loads"],
                                              "registers": r["registers"], "tma_loads": r["tma_loads"],
                                              "wgmma": len(re.findall(r"wgmma\.mma_async", r["ptx"]))}
print(json.dumps(res))
"""


def test_h100_swiglu_tiles_compile_for_sm90_without_spills():
    """Every h100 scaled_swiglu_gemm tile, TMA (K-major w) and pointer kernels, with the heaviest epilogue (bias,
    gelu_tanh, fp8 output): no spills, e4m3 wgmma, TMA loads where TMA is on."""
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _SM90]).strip().splitlines()[-1])
    from opsadv.backends.cuda.profiles import SCALED_GEMM_CONFIGS
    assert len(r) == 2 * sum(len(v) for kind, v in SCALED_GEMM_CONFIGS["h100"].items() if kind.startswith("swiglu"))
    for key, v in r.items():
        assert v["spills"] == 0 and v["wgmma"] > 0, (key, v)
        assert (v["tma_loads"] > 0) == key.endswith("tma=True"), (key, v)


# ---- GPU (skipped without one): `pytest tests/test_scaled_swiglu.py -k gpu` -----------------------------------------
GPU_CASES = [(4096, 2048, 4096, "tensor", "tensor", "silu"), (1000, 2048, 2752, "row", "col", "silu"),
             (1024, 2048, 4096, "block1x128", "block128x128", "silu"), (8, 2048, 1024, "row", "col", "gelu_tanh")]


@requires_gpu
@pytest.mark.parametrize("m,k,n,gx,gw,act", GPU_CASES)
@pytest.mark.parametrize("impl", TRITON)
def test_gpu_impls_match_reference_bf16(impl, m, k, n, gx, gw, act, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    x8, w8, sx, sw = _operands(m, k, n, gx, gw, device="cuda")
    bias = torch.randn(2 * n, device="cuda", dtype=torch.bfloat16)
    with opsadv.use_backend("reference"):
        want = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, bias=bias, activation=act, out_dtype=torch.float32)
    with opsadv.use_backend("cuda", strict=True, impls={OP: impl}):
        got = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, bias=bias, activation=act)
        got8, gs = opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw, bias=bias, activation=act, out_fp8=True)
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 8e-3
    assert _rel(got8.float() * gs, want) < 0.05


@requires_gpu
def test_gpu_auto_picks_a_triton_kernel():
    x8, w8, sx, sw = _operands(512, 2048, 1024, "row", "col", device="cuda")
    with opsadv.use_backend("cuda"), opsadv.trace() as t:
        opsadv.ops.scaled_swiglu_gemm(x8, w8, sx, sw)
    assert set(t.counts) <= set(TRITON) and t.counts, dict(t.counts)
