"""The norms' short host path (issues #4, #6): eager no-grad calls run the impl's `inference`
function, which skips the saved statistics (no mean/rstd allocated, no 0-element xsum); the eager
backward passes a shared 0-element stand-in for an absent residual gradient and impls may return None
for absent weight/bias gradients.  Results must be bit-for-bit those of the full path (the torch.ops
path with statistics), which is what compile / export / autograd keep using.  Triton kernels run
under the interpreter (CPU)."""
import pytest
import torch

import opsadv
from opsadv.backends.triton_common.norm import norm as N
from opsadv.core.dispatch import Resolved
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import KernelImpl
from opsadv.core import op_common as _common
from opsadv.ops.norm import _well_formed, validate

from conftest import rel_err


class Passthrough(torch.overrides.TorchFunctionMode):
    """Any torch-function mode sends the public ops down the torch.ops path (fake kernels, registered
    autograd): the reference for the eager short paths."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _inputs(op, shape, dtype, residual, weight=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    n = shape[-1]
    x = r(*shape)
    w = (1 + 0.1 * r(n)) if weight else None
    b = r(n) if bias and op == "layer_norm" else None
    res = r(*shape) if residual else None
    return x, w, b, res


def _call(op, x, w, b, res, offset=0.0):
    if op == "layer_norm":
        return opsadv.ops.layer_norm(x, w, b, 1e-5, residual=res)
    return opsadv.ops.rms_norm(x, w, 1e-6, residual=res, offset=offset)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 67), (3, 5, 127), (17, 1)])
@pytest.mark.parametrize("residual", [False, True])
def test_no_grad_inference_is_bitwise_the_full_forward(op, dtype, shape, residual):
    x, w, b, res = _inputs(op, shape, dtype, residual, seed=shape[-1])
    offset = 1.0 if op == "rms_norm" and shape[-1] == 127 else 0.0
    with opsadv.use_backend("cuda"), torch.no_grad():
        fast = _call(op, x, w, b, res, offset)
        with Passthrough():
            full = _call(op, x, w, b, res, offset)
    fast, full = (fast, full) if residual else ((fast,), (full,))
    for a, e in zip(fast, full):
        assert a.dtype == e.dtype and a.shape == e.shape and not a.isnan().any()
        assert torch.equal(a, e)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_stats_skipped_only_where_nobody_reads_them(op, monkeypatch):
    seen = []
    real = N._forward

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append((k.get("stats", True), out))
        return out

    monkeypatch.setattr(N, "_forward", spy)
    x, w, b, _ = _inputs(op, (4, 33), torch.float32, False)
    with opsadv.use_backend("cuda"):
        with torch.no_grad():
            _call(op, x, w, b, None)                          # eager, no grad: inference
            with Passthrough():
                stats_out = (torch.ops.opsadv.layer_norm(x, w, b, 1e-5, None) if op == "layer_norm"
                             else torch.ops.opsadv.rms_norm(x, w, 1e-6, None, 0.0))
        _call(op, x.requires_grad_(), w, b, None)             # a gradient can reach the stats: computed
    (s0, o0), (s1, o1), (s2, o2) = seen
    assert s0 is False and o0[1] is None and o0[2] is None and o0[3] is None    # no xsum, mean, rstd
    assert s1 is True and s2 is True
    for o in (o1, o2):
        assert o[1].numel() == 0 and o[3].shape == (4,) and o[3].dtype == torch.float32
        assert (o[2] is None) == (op == "rms_norm")
    # the op's contract at the torch.library boundary is unchanged: every output is a tensor
    assert all(isinstance(t, torch.Tensor) for t in stats_out) and stats_out[-1].shape == (4,)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("case", ["plain", "residual_y_only", "residual_both", "no_weight", "weight_no_bias"])
def test_eager_backward_is_bitwise_the_op_backward(op, case):
    """The eager backward (router called directly, shared empty dsum, None for absent grads) gives
    the torch.ops backward's gradients bit for bit."""
    residual = case.startswith("residual")
    x, w, b, res = _inputs(op, (3, 7, 65), torch.float32, residual, weight=case != "no_weight",
                           bias=case not in ("no_weight", "weight_no_bias"), seed=len(case))
    g = torch.Generator().manual_seed(5)
    gy, gs = torch.randn(x.shape, generator=g), torch.randn(x.shape, generator=g)

    def grads(mode, dtype=torch.float32):
        leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, w, b, res)]
        backend = "reference" if mode == "reference" else "cuda"
        with opsadv.use_backend(backend), (Passthrough() if mode == "ops" else _nullcontext()):
            out = _call(op, *leaves)
            y, s = out if residual else (out, None)
            loss = (y * gy.to(dtype)).sum() + ((s * gs.to(dtype)).sum() if case == "residual_both" else 0)
            used = [t for t in leaves if t is not None]
            # create_graph: the backward runs with grad enabled, so it takes the torch.ops backward op
            return torch.autograd.grad(loss, used, create_graph=mode == "ops")

    eager = grads("eager")
    for a, e, r in zip(eager, grads("ops"), grads("reference", torch.float64)):
        assert torch.equal(a, e.detach())
        assert rel_err(a, r) < 1e-5


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


def test_resolved_infer_function():
    def fn(ctx, *a):
        return "fn"

    def bwd(ctx, *a):
        return "bwd"

    def inf(ctx, *a):
        return "inf"

    with_inf = KernelImpl("t.x", "rms_norm", "t", fn, bwd, inference=inf)
    without = KernelImpl("t.y", "rms_norm", "t", fn, bwd)
    assert Resolved(with_inf, None, fn).infer is inf
    assert Resolved(with_inf, None, bwd).infer is bwd                 # backward resolutions: run
    assert Resolved(without, None, fn).infer is fn
    other = lambda ctx, *a: "other"                                   # noqa: E731  (e.g. a tuner's stand-in)
    assert Resolved(with_inf, None, other).infer is other


def test_inference_counted_by_trace():
    x = torch.randn(2, 16)
    with opsadv.use_backend("cuda"), torch.no_grad(), opsadv.trace() as t:
        opsadv.ops.rms_norm(x, None)
    assert dict(t.counts) == {"cuda.triton.rms_norm": 1}


def test_shared_empty_is_one_cached_zero_element_tensor():
    a, b = torch.randn(3, dtype=torch.float16), torch.randn(5, dtype=torch.float16)
    e = _common.shared_empty(a)
    assert e.numel() == 0 and e.dtype == torch.float16 and e.device == a.device
    assert _common.shared_empty(b) is e and _common.shared_empty(a.float()) is not e


def test_backward_plan_cached_and_covers_rows():
    for n, m, sms in [(67, 1, 2), (1000, 127, 132), (4096, 3, 132), (65536, 5000, 132)]:
        block, rows, warps, progs, per_prog, progs2 = N.bwd_plan(n, m, sms)
        assert per_prog % rows == 0 and progs * per_prog >= m > (progs - 1) * per_prog
        assert progs2 * N.REDUCE_BLOCK_N >= n and N.bwd_plan(n, m, sms) == (block, rows, warps, progs, per_prog, progs2)


BAD = [
    ("x", dict(x=torch.randn(())), "rank"),
    ("x", dict(x=torch.ones(2, 4, dtype=torch.int32)), "dtype"),
    ("x", dict(x=[1.0, 2.0]), "torch.Tensor"),
    ("weight", dict(weight=torch.randn(4, dtype=torch.float64)), "dtype"),
    ("weight", dict(weight=torch.randn(5)), "shape"),
    ("weight", dict(weight=torch.randn(1, 4)), "rank"),
    ("weight", dict(weight=torch.randn(4, device="meta")), "device"),
    ("bias", dict(bias=torch.randn(3)), "shape"),
    ("residual", dict(residual=torch.randn(2, 5)), "shape"),
    ("residual", dict(residual=torch.randn(2, 4, dtype=torch.float16)), "dtype"),
    ("eps", dict(eps=float("nan")), "finite"),
    ("eps", dict(eps=-1e-5), ">= 0"),
    ("eps", dict(eps=True), "finite"),
    ("offset", dict(offset=float("inf")), "finite"),
]


@pytest.mark.parametrize("arg,change,words", BAD, ids=[f"{a}-{w}" for a, _, w in BAD])
def test_fast_validation_never_accepts_a_bad_call(arg, change, words):
    call = dict(x=torch.randn(2, 4), weight=torch.randn(4), bias=torch.randn(4), eps=1e-5, residual=None,
                offset=0.0)
    call.update(change)
    args = (call["x"], call["weight"], call["bias"], call["eps"], call["residual"], call["offset"])
    assert not _well_formed(*args)
    with pytest.raises(InvalidArgumentError) as e:
        validate("rms_norm", *args)
    assert e.value.arg == arg and words in str(e.value)


def test_fast_validation_accepts_the_common_calls():
    x = torch.randn(2, 3, 4)
    assert _well_formed(x, torch.randn(4), None, 1e-6, torch.randn(2, 3, 4), 1.0)
    assert _well_formed(x, None, None, 0.0, None, 0.0)
    assert not _well_formed(x, None, None, 1, None, 0.0)       # an int eps: the full checks (which accept it)
    validate("rms_norm", x, None, None, 1, None, 0)
