"""cast_to_fp8: every impl bit for bit against torch's own cast of float32(x) / scale (the reference's
quantize_with_scale), the transpose and the amax; odd and strided shapes, specials, both fp8 formats; bad arguments;
torch.compile and opcheck; the Triton kernel under the interpreter on CPU (poisoned outputs) and on an sm_89+ GPU."""
import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError
from opsadv.ops import cast_to_fp8

from conftest import requires_gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
IMPLS = ["reference.cast_to_fp8", "cuda.triton.cast_to_fp8"]


def _oracle(x, scale, dtype):
    """torch's cast of float32(x) / scale, clamped (NaN stays NaN), the transpose, max |x| in float64."""
    q = (x.double().float() / scale.float()).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)
    amax = x.double().abs().max() if x.numel() else torch.zeros((), dtype=torch.float64)
    return q, q.t().contiguous(), amax


def _same_fp8(a, b) -> bool:
    """Equal values, NaN where the other has NaN (NaN's bit pattern may differ)."""
    fa, fb = a.float(), b.float()
    return a.shape == b.shape and torch.equal(fa.isnan(), fb.isnan()) and torch.equal(fa.nan_to_num(), fb.nan_to_num())


def _x(m, n, dtype, g, *, layout="contiguous"):
    x = torch.randn(m, n, generator=g, dtype=torch.float64) * 2.0 ** (torch.arange(m) % 9 - 4.0)[:, None]
    x = x.to(dtype)
    if layout == "transposed":
        x = x.t().contiguous().t()
    elif layout == "sliced":                 # a column window of a wider buffer: row stride > n
        wide = torch.randn(m, n + 5, generator=g).to(dtype)
        wide[:, 2:2 + n] = x
        x = wide[:, 2:2 + n]
    elif layout == "expanded":               # one row broadcast: row stride 0
        x = x[:1].expand(m, n)
    return x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (127, 3), (65, 129), (200, 64)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_matches_torch_cast_bit_for_bit(impl, shape, xdtype, dtype):
    g = torch.Generator().manual_seed(hash((shape, str(xdtype), str(dtype))) % 2**31)
    x = _x(*shape, xdtype, g)
    # a scale that puts the largest values past FMAX (they clamp) and the smallest into subnormals
    scale = (x.float().abs().amax() / FMAX[dtype] / 4).reshape(())
    with opsadv.use_backend(impl.split(".")[0], strict=True), opsadv.trace() as t:
        q, qt, amax = cast_to_fp8(x, scale, dtype=dtype, transpose=True)
    assert t.counts == {impl: 1}
    want, want_t, want_amax = _oracle(x, scale, dtype)
    assert q.dtype == qt.dtype == dtype and q.is_contiguous() and qt.is_contiguous()
    assert _same_fp8(q, want) and _same_fp8(qt, want_t)
    assert amax.dtype == torch.float32 and amax.shape == () and amax.item() == want_amax.item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_strided_inputs(impl, layout):
    g = torch.Generator().manual_seed(3)
    x = _x(70, 33, torch.bfloat16, g, layout=layout)
    scale = torch.tensor(0.003)
    with opsadv.use_backend(impl.split(".")[0], strict=True):
        q, qt, amax = cast_to_fp8(x, scale, dtype=E5M2, transpose=True)
    want, want_t, want_amax = _oracle(x, scale, E5M2)
    assert _same_fp8(q, want) and _same_fp8(qt, want_t) and amax.item() == want_amax.item()


@pytest.mark.parametrize("impl", IMPLS)
def test_specials_and_no_transpose(impl):
    """NaN stays NaN (and makes the amax NaN), +-inf clamp to +-FMAX, -0.0 keeps its sign; no transpose: None."""
    x = torch.tensor([[1.0, float("nan"), float("inf")], [float("-inf"), -0.0, -3.0]], dtype=torch.bfloat16)
    scale = torch.tensor(0.5)
    with opsadv.use_backend(impl.split(".")[0], strict=True):
        q, qt, amax = cast_to_fp8(x, scale)
    assert qt is None and amax.isnan()
    want = _oracle(x, scale, E4M3)[0]
    if impl.startswith("cuda") and not x.is_cuda:
        # triton 3.6's interpreter casts a float32 NaN to an fp8 number (384): the NaN positions are checked on the
        # GPU (test_gpu_matches_torch_cast), the rest here
        q, want = q.float().nan_to_num(), want.float().nan_to_num()
        q[0, 1] = want[0, 1] = 0
    assert _same_fp8(q, want)
    assert q.float()[0, 2] == 448 and q.float()[1, 0] == -448 and torch.signbit(q.float()[1, 1])
    finite = x.clone()
    finite[0, 1] = 2.0
    with opsadv.use_backend(impl.split(".")[0], strict=True):
        assert cast_to_fp8(finite, scale)[2].item() == float("inf")      # inf is the max |x| then


def test_triton_writes_every_element_of_its_poisoned_outputs():
    """On CPU the host fills the outputs with NaN first: a finite input leaves no NaN, in either output."""
    x = _x(129, 67, torch.float32, torch.Generator().manual_seed(1))
    with opsadv.use_backend("cuda", strict=True):
        q, qt, _ = cast_to_fp8(x, torch.tensor(0.01), transpose=True)
    assert not q.float().isnan().any() and not qt.float().isnan().any()


def test_empty_and_zero_inputs():
    for shape in ((0, 5), (4, 0)):
        q, qt, amax = cast_to_fp8(torch.zeros(shape), torch.tensor(1.0), transpose=True)
        assert q.shape == shape and qt.shape == shape[::-1] and amax.item() == 0.0
    with opsadv.use_backend("cuda", strict=True):
        q, _, amax = cast_to_fp8(torch.zeros(3, 5, dtype=torch.bfloat16), torch.tensor(1.0))
    assert amax.item() == 0.0 and not q.float().any()


@pytest.mark.parametrize("call,arg,match", [
    (lambda: cast_to_fp8(torch.randn(2, 3, 4), torch.tensor(1.0)), "x", "2"),
    (lambda: cast_to_fp8(torch.randn(2, 3).to(torch.int32), torch.tensor(1.0)), "x", "int32"),
    (lambda: cast_to_fp8(torch.randn(2, 3), torch.tensor([1.0, 2.0])), "scale", "one element"),
    (lambda: cast_to_fp8(torch.randn(2, 3), torch.tensor(1.0, dtype=torch.float64)), "scale", "float32"),
    (lambda: cast_to_fp8(torch.randn(2, 3), 1.0), "scale", "float"),
    (lambda: cast_to_fp8(torch.randn(2, 3), torch.tensor(1.0), dtype=torch.bfloat16), "dtype", "float8"),
    (lambda: cast_to_fp8(torch.randn(2, 3), torch.tensor(1.0), transpose=1), "transpose", "bool"),
    (lambda: cast_to_fp8(torch.randn(2, 3, requires_grad=True), torch.tensor(1.0)), "x", "requires_grad"),
])
def test_bad_arguments_name_the_argument(call, arg, match):
    with pytest.raises(InvalidArgumentError, match=f"cast_to_fp8.*'{arg}'.*{match}|cast_to_fp8.*{arg}.*{match}"):
        call()


def test_explain_names_the_kernel_and_features():
    x = torch.randn(300, 40, dtype=torch.bfloat16)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("cast_to_fp8", x, torch.tensor(1.0), dtype=E5M2, transpose=True)
    assert e.chosen == "cuda.triton.cast_to_fp8" and e.spec.features == frozenset({"e5m2", "transpose"})


def test_compile_fullgraph_and_opcheck():
    x = torch.randn(37, 20, dtype=torch.bfloat16)
    scale = torch.tensor(0.01)
    with opsadv.use_backend("reference"):
        want = cast_to_fp8(x, scale, dtype=E5M2, transpose=True)
        got = torch.compile(lambda a, s: cast_to_fp8(a, s, dtype=E5M2, transpose=True), fullgraph=True,
                            backend="aot_eager")(x, scale)
        assert all(_same_fp8(g, w) for g, w in zip(got[:2], want[:2])) and torch.equal(got[2], want[2])
        for transpose in (True, False):
            torch.library.opcheck(torch.ops.opsadv.cast_to_fp8.default, (x, scale, E4M3, transpose, 0),
                                  test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@requires_gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 2048), (1000, 2752), (1, 64)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_matches_torch_cast(shape, dtype):
    """The compiled kernel (sm_89+) on bf16 activations of the training shapes, bit for bit."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 stores need sm_89+")
    g = torch.Generator().manual_seed(0)
    x = _x(*shape, torch.bfloat16, g).cuda()
    x.view(-1)[-3:] = torch.tensor([float("nan"), float("inf"), -0.0])
    scale = (x.float().nan_to_num(posinf=0).abs().amax() / FMAX[dtype] / 2).reshape(())
    with opsadv.use_backend("cuda", strict=True), opsadv.trace() as t:
        q, qt, amax = cast_to_fp8(x, scale, dtype=dtype, transpose=True)
        torch.cuda.synchronize()
    assert t.counts == {"cuda.triton.cast_to_fp8": 1}
    want, want_t, want_amax = _oracle(x, scale, dtype)
    assert _same_fp8(q, want) and _same_fp8(qt, want_t) and amax.isnan() and want_amax.isnan()   # (the NaN)


_SM90 = r"""
import json, re, torch
from opsadv.testing.sm90 import compile_sm90
from opsadv.backends.triton_common.scaled_gemm import kernels as K, cast as C
from opsadv.backends.triton_common.scaled_gemm.scaled_gemm import FP8_FORMAT
res = {}
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    for transpose in (True, False):
        m, n = 8192, 2048
        x = torch.empty(m, n, dtype=torch.bfloat16)
        q, qt = torch.empty(m, n, dtype=dtype), torch.empty(n, m, dtype=dtype)
        fmax, mant, emin = FP8_FORMAT[dtype]
        kw = dict(x_ptr=x, q_ptr=q, qt_ptr=qt, part_ptr=torch.empty(1), scale_ptr=torch.empty(1), M=m, N=n, s_xm=n,
                  s_xn=1, FMAX=fmax, MANT=mant, EMIN=emin, BLOCK_M=C.BLOCK_M, BLOCK_N=C.BLOCK_N, TRANSPOSE=transpose)
        r = compile_sm90(K.cast_kernel, kw, num_warps=4, num_stages=1)
        res[f"{str(dtype)[-6:]}-{transpose}"] = {"spills": r["spill_stores"] + r["spill_loads"],
                                                  "cvt": len(re.findall(r"cvt\.rn\.satfinite\.e[45]m[23]x2", r["ptx"]))}
    m, n = 8192, 2048
    x = torch.empty(m, n, dtype=torch.bfloat16)
    q, qt = torch.empty(m, n, dtype=dtype), torch.empty(n, m, dtype=dtype)
    h = torch.empty(20)
    fmax, mant, emin = FP8_FORMAT[dtype]
    kw = dict(x_ptr=x, q_ptr=q, qt_ptr=qt, hist_ptr=h, hist_bits_ptr=h.view(torch.int32), scale_ptr=torch.empty(1),
              M=m, N=n, s_xm=n, s_xn=1, SLOTS=17, FMAX=fmax, MANT=mant, EMIN=emin, BLOCK_M=C.BLOCK_M,
              BLOCK_N=C.BLOCK_N, BLOCK_H=32, TRANSPOSE=True)
    r = compile_sm90(K.cast_delayed_kernel, kw, num_warps=4, num_stages=1)
    res[f"delayed-{str(dtype)[-6:]}"] = {"spills": r["spill_stores"] + r["spill_loads"],
                                         "cvt": len(re.findall(r"cvt\.rn\.satfinite\.e[45]m[23]x2", r["ptx"]))}
kw = dict(x_ptr=x, hist_ptr=h, hist_bits_ptr=h.view(torch.int32), M=m, N=n, s_xm=n, s_xn=1, SLOTS=17,
          BLOCK_M=C.BLOCK_M, BLOCK_N=C.BLOCK_N)
r = compile_sm90(K.history_amax_kernel, kw, num_warps=4, num_stages=1)
res["history_amax"] = {"spills": r["spill_stores"] + r["spill_loads"], "cvt": 1}
print(json.dumps(res))
"""


def test_kernel_compiles_for_sm90_without_spills():
    """The kernels for the H100 (sm_90) at a training shape, both formats, with and without the transpose (and
    cast_to_fp8_delayed's two): no spills, and the fp8 stores are hardware conversions (cvt ... e4m3x2 / e5m2x2)."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _SM90]).strip().splitlines()[-1])
    assert len(r) == 7
    for k, v in r.items():
        assert v["spills"] == 0 and v["cvt"] > 0, (k, v)
