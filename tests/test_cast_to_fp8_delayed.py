"""cast_to_fp8_delayed: every impl against a plain-Python model of delayed scaling (a list of the amaxes recorded, the
scale from the last L of them or the call's own on the first call, torch's cast under it) over runs of calls longer
than the window; the reference and the Triton kernel (interpreter on CPU) leave bit-identical histories; current
scaling (L = 0), NaN and inf, odd / strided / expanded shapes, poisoned outputs, bad arguments, torch.compile (one
graph over many calls, no recompiles) and opcheck, and the compiled kernel on an sm_89+ GPU."""
import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError
from opsadv.ops import cast_to_fp8_delayed
from opsadv.ops.scaled_gemm import new_amax_history, quantize_with_scale

from conftest import requires_gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
IMPLS = ["reference.cast_to_fp8_delayed", "cuda.triton.cast_to_fp8_delayed"]


class Model:
    """Delayed scaling as the op's docstring states it, in Python floats: the scale for call i is max of the amaxes
    of calls i-L .. i-1 (the first call: its own; L = 0: always its own) / FMAX, 1 for 0 or NaN."""

    def __init__(self, length):
        self.length, self.amaxes = length, []

    def step(self, x, dtype):
        a = x.double().abs().max().item() if x.numel() else 0.0
        window = self.amaxes[-self.length:] if self.length and self.amaxes else [a]
        m = float("nan") if any(v != v for v in window) else max(window)
        self.amaxes.append(a)
        return torch.tensor(m / FMAX[dtype] if m > 0 else 1.0, dtype=torch.float32)


def _same_fp8(a, b, skip_nan=False) -> bool:
    fa, fb = a.float(), b.float()
    if skip_nan:                           # (triton 3.6's interpreter casts NaN to a number)
        keep = ~fb.isnan()
        fa, fb = fa[keep], fb[keep]
    return torch.equal(fa.isnan(), fb.isnan()) and torch.equal(fa.nan_to_num(), fb.nan_to_num())


def _x(m, n, dtype, g, magnitude=1.0, layout="contiguous"):
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * magnitude
         * 2.0 ** (torch.arange(m) % 9 - 4.0)[:, None]).to(dtype)
    if layout == "transposed":
        x = x.t().contiguous().t()
    elif layout == "sliced":
        wide = torch.randn(m, n + 5, generator=g).to(dtype)
        wide[:, 2:2 + n] = x
        x = wide[:, 2:2 + n]
    elif layout == "expanded":
        x = x[:1].expand(m, n)
    return x


def _run(impl, length, shapes, xdtype, dtype, layout="contiguous", seed=0):
    """Calls of impl on inputs whose magnitude swings by 2^+-6 between calls; each checked against Model and
    torch's cast.  Returns the history after each call."""
    g = torch.Generator().manual_seed(seed)
    hist, model, states = new_amax_history(length), Model(length), []
    with opsadv.use_backend(impl.split(".")[0], strict=True), opsadv.trace() as t:
        for i, shape in enumerate(shapes):
            x = _x(*shape, xdtype, g, 2.0 ** ((i * 5) % 13 - 6), layout)
            want_scale = model.step(x, dtype)
            q, qt, scale = cast_to_fp8_delayed(x, hist, dtype=dtype, transpose=True)
            assert scale.dtype == torch.float32 and scale.shape == () and scale.item() == want_scale.item(), i
            want = quantize_with_scale(x, scale, dtype)
            assert q.dtype == qt.dtype == dtype and q.is_contiguous() and qt.is_contiguous()
            assert _same_fp8(q, want) and _same_fp8(qt, want.t().contiguous()), i
            states.append(hist.clone())
    assert t.counts == {impl: len(shapes)}
    return states


@pytest.mark.parametrize("length", [1, 3, 16])
def test_impls_follow_delayed_scaling_and_agree_on_the_history(length):
    shapes = [(1, 1), (3, 127), (127, 3), (65, 129), (2, 70)] * (1 + (length + 2) // 5)   # past the window
    ref = _run(IMPLS[0], length, shapes, torch.bfloat16, E4M3)
    tri = _run(IMPLS[1], length, shapes, torch.bfloat16, E4M3)
    for i, (a, b) in enumerate(zip(ref, tri)):
        assert torch.equal(a, b), (i, a, b)
    assert ref[-1][-1].item() == 0.0 and ref[-1][-2].item() == 1.0          # counter back at 0; started


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("xdtype,dtype,layout", [
    (torch.float32, E5M2, "transposed"), (torch.float16, E4M3, "sliced"), (torch.bfloat16, E5M2, "expanded"),
])
def test_dtypes_and_strides(impl, xdtype, dtype, layout):
    _run(impl, 2, [(37, 160), (64, 64), (5, 300), (37, 160)], xdtype, dtype, layout)


@pytest.mark.parametrize("impl", IMPLS)
def test_length_zero_is_current_scaling(impl):
    """L = 0: every call's scale is its own amax / FMAX (the recipe's weights); the slot is cleared again."""
    ref = _run(impl, 0, [(3, 5), (40, 70), (1, 1), (40, 70)], torch.bfloat16, E4M3)
    assert all(not s[0].item() and not s[-2].item() for s in ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf(impl):
    """A NaN in x is recorded as NaN; while it is in the window the scale is 1 (as scale_from_amax); it leaves
    after L calls.  An inf is recorded as inf (scale inf: finite values quantize to 0)."""
    hist = new_amax_history(2)
    x = torch.ones(4, 6)
    with opsadv.use_backend(impl.split(".")[0], strict=True):
        cast_to_fp8_delayed(x * 8.0, hist)                          # scale 8 / 448
        nan = x.clone()
        nan[2, 3] = float("nan")
        _, _, s = cast_to_fp8_delayed(nan, hist)
        assert s.item() == pytest.approx(8 / 448) and hist[:3].isnan().sum().item() == 1
        scales = [cast_to_fp8_delayed(x, hist)[2].item() for _ in range(3)]
        assert scales == [1.0, 1.0, pytest.approx(1 / 448)]       # the NaN in the window twice, then gone
        inf = x.clone()
        inf[0, 0] = float("inf")
        cast_to_fp8_delayed(inf, hist)
        q, _, s = cast_to_fp8_delayed(x, hist)
        assert s.item() == float("inf") and not q.float().any()


def test_triton_writes_every_element_of_its_poisoned_outputs():
    x = _x(129, 67, torch.float32, torch.Generator().manual_seed(1))
    hist = new_amax_history(4)
    with opsadv.use_backend("cuda", strict=True):
        for _ in range(2):                                          # first call and a started history
            q, qt, s = cast_to_fp8_delayed(x, hist, transpose=True)
            assert not q.float().isnan().any() and not qt.float().isnan().any() and not s.isnan()


def test_empty_input_records_zero():
    hist = new_amax_history(2)
    cast_to_fp8_delayed(torch.full((3, 3), 4.48), hist)
    q, qt, s = cast_to_fp8_delayed(torch.zeros(0, 5), hist, transpose=True)
    assert q.shape == (0, 5) and qt.shape == (5, 0) and s.item() == pytest.approx(0.01)
    assert hist[:3].tolist() == [4.480000019073486, 0.0, 0.0] and hist[3].item() == 2.0


@pytest.mark.parametrize("call,arg,match", [
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3, 4), new_amax_history(2)), "x", "2"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3).to(torch.int32), new_amax_history(2)), "x", "int32"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3), torch.zeros(6, dtype=torch.float64)), "history", "float64"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3), torch.zeros(3)), "history", "shape"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3), torch.zeros(2, 6)), "history", "shape"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3), torch.zeros(12)[::2]), "history", "contiguous"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3), 1.0), "history", "float"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3), new_amax_history(2), dtype=torch.bfloat16), "dtype", "float8"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3), new_amax_history(2), transpose=1), "transpose", "bool"),
    (lambda: cast_to_fp8_delayed(torch.randn(2, 3, requires_grad=True), new_amax_history(2)), "x",
     "requires_grad"),
    (lambda: new_amax_history(-1), "length", "-1"),
    (lambda: new_amax_history(2.0), "length", "2.0"),
])
def test_bad_arguments_name_the_argument(call, arg, match):
    with pytest.raises(InvalidArgumentError, match=f"'{arg}'.*{match}|{arg}.*{match}"):
        call()


def test_explain_names_the_kernel_and_features():
    x = torch.randn(300, 40, dtype=torch.bfloat16)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("cast_to_fp8_delayed", x, new_amax_history(4), dtype=E5M2, transpose=True)
    assert e.chosen == "cuda.triton.cast_to_fp8_delayed" and e.spec.features == frozenset({"e5m2", "transpose"})


def test_compile_is_one_graph_over_many_calls_and_opcheck():
    """Compiled calls mutate the history as eager ones do, and the ring's movement recompiles nothing."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(3)
    xs = [_x(37, 20, torch.bfloat16, g, 2.0 ** (i % 5 - 2)) for i in range(6)]
    eager, compiled = new_amax_history(3), new_amax_history(3)
    fn = torch.compile(lambda a, h: cast_to_fp8_delayed(a, h, dtype=E5M2, transpose=True), fullgraph=True,
                       backend="aot_eager")
    with opsadv.use_backend("reference"):
        for x in xs:
            want = cast_to_fp8_delayed(x, eager, dtype=E5M2, transpose=True)
            got = fn(x, compiled)
            assert all(_same_fp8(a, b) for a, b in zip(got[:2], want[:2])) and torch.equal(got[2], want[2])
            assert torch.equal(eager, compiled)
        assert counters["stats"]["unique_graphs"] == 1
        for transpose in (True, False):
            torch.library.opcheck(torch.ops.opsadv.cast_to_fp8_delayed.default,
                                  (xs[0], new_amax_history(2), E4M3, transpose, 0),
                                  test_utils=("test_schema", "test_faketensor"))


@requires_gpu
@pytest.mark.parametrize("shape", [(8192, 2048), (1000, 2752), (1, 64)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_matches_the_reference_over_a_run(shape, dtype):
    """The compiled kernel (sm_89+) over 20 calls (a 16-long window, so the ring wraps): scales, fp8 copies and
    the history bit for bit the reference's; then a NaN is recorded as NaN."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 stores need sm_89+")
    g = torch.Generator().manual_seed(0)
    h_ref, h_gpu = new_amax_history(16), new_amax_history(16, "cuda")
    for i in range(20):
        x = _x(*shape, torch.bfloat16, g, 2.0 ** ((i * 5) % 13 - 6))
        with opsadv.use_backend("reference"):
            want = cast_to_fp8_delayed(x, h_ref, dtype=dtype, transpose=True)
        with opsadv.use_backend("cuda", strict=True):
            got = cast_to_fp8_delayed(x.cuda(), h_gpu, dtype=dtype, transpose=True)
        assert _same_fp8(got[0].cpu(), want[0]) and _same_fp8(got[1].cpu(), want[1]), i
        assert got[2].item() == want[2].item() and torch.equal(h_gpu.cpu(), h_ref), i
    x = _x(*shape, torch.bfloat16, g).cuda()
    x.view(-1)[-1] = float("nan")
    with opsadv.use_backend("cuda", strict=True):
        cast_to_fp8_delayed(x, h_gpu, dtype=dtype)
    assert h_gpu[:17].isnan().sum().item() == 1
