"""The ops' per-call fast path (dispatch._fast, issue #34): a plain eager call whose exact argument metadata an
identical call stored after the full path (validation, eager mode, bucket key, memo) runs the stored resolution
directly.  It must behave as the full path does: the same error for a bad argument after a good call of the same
shapes, a policy change seen at once, trace counts kept, identical results and gradients, the torch.ops path for
traced / mode calls, and a spy on dispatch.call still seeing every call."""
import importlib

import pytest
import torch

import opsadv
from opsadv.core import dispatch
from opsadv.core.errors import InvalidArgumentError
from opsadv.ops.sparse_attention.layout import SparseLayout

N = importlib.import_module("opsadv.ops.norm")
G = importlib.import_module("opsadv.ops.gemm")
A = importlib.import_module("opsadv.ops.flash_attention")
S = importlib.import_module("opsadv.ops.sparse_attention")
ops = opsadv.ops


def _norm_args():
    return dict(x=torch.randn(2, 3, 8), weight=torch.randn(8), residual=torch.randn(2, 3, 8))


def _error(fn):
    """(type, argument, message) of what fn raises (InvalidArgumentError, or whatever the full checks raise)."""
    with pytest.raises(Exception) as e:
        fn()
    return type(e.value), getattr(e.value, "arg", None), str(e.value)


# (good call, the same call with one argument made bad); each bad call has the good call's tensor shapes
X, W, R, B = torch.randn(2, 3, 8), torch.randn(8), torch.randn(2, 3, 8), torch.randn(8)
Q, K, V = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
LAY = SparseLayout.sliding_window(5, 2, block_size=16)
GU = torch.randn(2, 3, 16)
BAD = {
    "rms eps<0": (lambda: ops.rms_norm(X, W, 1e-6), lambda: ops.rms_norm(X, W, -1e-6)),
    "rms eps nan": (lambda: ops.rms_norm(X, W, 1e-6), lambda: ops.rms_norm(X, W, float("nan"))),
    "rms eps bool": (lambda: ops.rms_norm(X, W, 1.0), lambda: ops.rms_norm(X, W, True)),
    "rms offset inf": (lambda: ops.rms_norm(X, W, 1e-6, offset=1.0),
                       lambda: ops.rms_norm(X, W, 1e-6, offset=float("inf"))),
    "rms weight dtype": (lambda: ops.rms_norm(X, W, 1e-6), lambda: ops.rms_norm(X, W.double(), 1e-6)),
    "rms weight list": (lambda: ops.rms_norm(X, W, 1e-6), lambda: ops.rms_norm(X, [1.0] * 8, 1e-6)),
    "rms residual shape": (lambda: ops.rms_norm(X, W, 1e-6, residual=R),
                           lambda: ops.rms_norm(X, W, 1e-6, residual=R[:1])),
    "ln bias shape": (lambda: ops.layer_norm(X, W, B, 1e-5), lambda: ops.layer_norm(X, W, B[:4], 1e-5)),
    "ln eps inf": (lambda: ops.layer_norm(X, W, B, 1e-5), lambda: ops.layer_norm(X, W, B, float("inf"))),
    "gemm alpha nan": (lambda: ops.gemm(X, W[:, None].expand(8, 4).contiguous(), alpha=2.0),
                       lambda: ops.gemm(X, W[:, None].expand(8, 4).contiguous(), alpha=float("nan"))),
    "gemm activation": (lambda: ops.gemm(X, torch.randn(8, 4), activation="gelu"),
                        lambda: ops.gemm(X, torch.randn(8, 4), activation="tanh")),
    "gemm alpha bool": (lambda: ops.gemm(X, torch.randn(8, 4), alpha=1.0),
                        lambda: ops.gemm(X, torch.randn(8, 4), alpha=True)),
    "gemm bias dtype": (lambda: ops.gemm(X, torch.randn(8, 4), bias=torch.randn(4)),
                        lambda: ops.gemm(X, torch.randn(8, 4), bias=torch.randn(4, dtype=torch.float64))),
    "swiglu_gemm bias": (lambda: ops.swiglu_gemm(X, torch.randn(8, 6), bias=torch.randn(6)),
                         lambda: ops.swiglu_gemm(X, torch.randn(8, 6), bias=torch.randn(3))),
    "swiglu odd": (lambda: ops.swiglu(GU), lambda: ops.swiglu(GU[..., :15])),
    "attn scale<0": (lambda: ops.flash_attention(Q, K, V, scale=0.5), lambda: ops.flash_attention(Q, K, V, scale=-0.5)),
    "attn causal int": (lambda: ops.flash_attention(Q, K, V, causal=True),
                        lambda: ops.flash_attention(Q, K, V, causal=1)),
    "attn mask dtype": (lambda: ops.flash_attention(Q, K, V, attn_mask=torch.ones(5, 5, dtype=torch.bool)),
                        lambda: ops.flash_attention(Q, K, V, attn_mask=torch.ones(5, 5, dtype=torch.int32))),
    "sparse layout length": (lambda: ops.sparse_attention(Q, K, V, LAY),
                             lambda: ops.sparse_attention(Q, K, V, SparseLayout.sliding_window(6, 2, block_size=16))),
    "sparse scale inf": (lambda: ops.sparse_attention(Q, K, V, LAY, scale=0.5),
                         lambda: ops.sparse_attention(Q, K, V, LAY, scale=float("inf"))),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_argument_after_good_calls_raises_the_cold_error(case, grad):
    good, bad = BAD[case]
    with opsadv.use_backend("reference"), torch.set_grad_enabled(grad):
        dispatch.clear_cache()
        cold = _error(bad)
        for _ in range(3):
            good()
        assert dispatch._fast, "the good call was not stored for the fast path"
        assert _error(bad) == cold


def test_repeated_calls_skip_validation_and_still_count_in_traces(monkeypatch):
    x, w = torch.randn(4, 16), torch.randn(16)
    calls = []
    real = N.validate
    monkeypatch.setattr(N, "validate", lambda *a: calls.append(a) or real(*a))
    with opsadv.use_backend("reference"), torch.no_grad():
        with opsadv.trace() as t:
            for _ in range(5):
                ops.rms_norm(x, w, 1e-6)
        assert len(calls) == 1                             # the first call only: the rest hit the fast path
        assert t.counts["reference.rms_norm"] == 5
        ops.rms_norm(torch.randn(4, 32), torch.randn(32), 1e-6)    # other shapes: the full path again
        assert len(calls) == 2


def test_a_policy_change_is_seen_at_once():
    x, w = torch.randn(4, 16), torch.randn(16)
    with torch.no_grad():
        with opsadv.use_backend("reference"), opsadv.trace() as t:
            for _ in range(3):
                ops.rms_norm(x, w, 1e-6)
        assert set(t.counts) == {"reference.rms_norm"}
        with opsadv.use_backend("cuda"), opsadv.trace() as t:      # the Triton impl, under the interpreter
            ops.rms_norm(x, w, 1e-6)
        assert set(t.counts) == {"cuda.triton.rms_norm"}
        with opsadv.use_backend("reference"), opsadv.trace() as t:
            ops.rms_norm(x, w, 1e-6)
        assert set(t.counts) == {"reference.rms_norm"}


def test_memo_writes_empty_the_fast_cache():
    x, w = torch.randn(4, 16), torch.randn(16)
    with opsadv.use_backend("reference"), torch.no_grad():
        ops.rms_norm(x, w, 1e-6)
        ops.rms_norm(x, w, 1e-6)
        assert dispatch._fast
        dispatch.clear_cache()
        assert not dispatch._fast
        ops.rms_norm(x, w, 1e-6)
        assert dispatch._fast
        ops.layer_norm(x, w, None, 1e-5)                   # a new bucket resolves: the memo is written
        assert len(dispatch._fast) == 1                    # (emptied, then this call's entry)


def test_a_spy_on_dispatch_call_sees_every_call(monkeypatch):
    x, w = torch.randn(4, 16), torch.randn(16)
    with opsadv.use_backend("reference"), torch.no_grad():
        for _ in range(2):
            ops.rms_norm(x, w, 1e-6)
        assert dispatch._fast
        seen = []
        real = dispatch.call
        monkeypatch.setattr(dispatch, "call", lambda *a, **kw: seen.append(a[0][0]) or real(*a, **kw))
        assert not dispatch._fast
        for _ in range(3):
            ops.rms_norm(x, w, 1e-6)
        assert seen == ["rms_norm"] * 3 and not dispatch._fast
        monkeypatch.undo()
        ops.rms_norm(x, w, 1e-6)
        assert dispatch._fast                              # the real call is back: stored again


class Passthrough(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_still_takes_the_torch_ops_path():
    x, w = torch.randn(4, 16), torch.randn(16)
    with opsadv.use_backend("reference"), torch.no_grad():
        for _ in range(2):
            ops.rms_norm(x, w, 1e-6)
        with Passthrough() as mode:
            ops.rms_norm(x, w, 1e-6)
    assert torch.ops.opsadv.rms_norm.default in mode.funcs or torch.ops.opsadv.rms_norm in mode.funcs


def _both(ys):
    """One output from (norm, sum): both get a gradient."""
    return ys[0] * 3 + ys[1]


def _calls():
    """(name, fn(*tensors) -> output, input tensors) per op, grad-recording where the inputs require grad."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        "rms_norm": (lambda x, w, res: _both(ops.rms_norm(x, w, 1e-6, residual=res, offset=1.0)), (r(3, 8), r(8),
                                                                                                   r(3, 8))),
        "rms_norm plain": (lambda x, w: ops.rms_norm(x, w, 1e-6), (r(3, 8), r(8))),
        "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), (r(3, 8), r(8), r(8))),
        "gemm": (lambda a, b, bias: ops.gemm(a, b, bias=bias, alpha=0.5), (r(2, 3, 8), r(8, 4), r(4))),
        "gemm gelu": (lambda a, b, bias: ops.gemm(a, b, bias=bias, activation="gelu"), (r(3, 8), r(8, 4), r(4))),
        "swiglu_gemm": (lambda x, w: ops.swiglu_gemm(x, w), (r(3, 8), r(8, 6))),
        "swiglu": (lambda gu: ops.swiglu(gu), (r(3, 6),)),
        "flash_attention": (lambda q, k, v: ops.flash_attention(q, k, v, causal=True), (r(1, 2, 5, 8), r(1, 1, 5, 8),
                                                                                         r(1, 1, 5, 8))),
        "flash_attention lse": (lambda q, k, v: ops.flash_attention(q, k, v, return_lse=True)[0],
                                (r(1, 2, 5, 8), r(1, 1, 5, 8), r(1, 1, 5, 8))),
        "sparse_attention": (lambda q, k, v: ops.sparse_attention(q, k, v, SparseLayout.sliding_window(5, 2,
                                                                                                        block_size=16)),
                             (r(1, 2, 5, 8), r(1, 2, 5, 8), r(1, 2, 5, 8))),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_fast_calls_give_the_full_paths_outputs_and_gradients(name):
    fn, tensors = _calls()[name]
    with opsadv.use_backend("reference"):
        with torch.no_grad():
            with Passthrough():
                want = fn(*tensors)                        # the torch.ops path
            for _ in range(3):                             # the full eager path, then the fast path
                assert torch.equal(fn(*tensors), want)
        ins = [t.clone().requires_grad_() for t in tensors]
        ref = [t.clone().requires_grad_() for t in tensors]
        with Passthrough():
            out_ref = fn(*ref)
        go = torch.randn_like(out_ref)
        grads_ref = torch.autograd.grad(out_ref, ref, go)
        for i in range(3):
            n_fast = len(dispatch._fast)
            out = fn(*ins)
            assert torch.equal(out, out_ref)
            for a, b in zip(torch.autograd.grad(out, ins, go), grads_ref):
                assert torch.equal(a, b)
        assert len(dispatch._fast) == n_fast              # the last calls were fast hits (nothing stored)


def test_outputs_of_the_fast_path_keep_their_autograd_node_names():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    with opsadv.use_backend("reference"):
        names = {ops.rms_norm(x, w, 1e-6).grad_fn.name() for _ in range(3)}
        gnames = {ops.gemm(x, torch.randn(8, 4, requires_grad=True)).grad_fn.name() for _ in range(3)}
    assert names == {"RmsNormFnBackward"} and gnames == {"GemmFnBackward"}


def test_fused_rows_transposed_view_follows_the_buffer():
    from opsadv.convert.modules import FusedRows
    ps = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))]
    f = FusedRows(ps)
    with torch.no_grad():
        t1 = f.get_t()
        assert torch.equal(t1, torch.cat([p.detach() for p in ps]).t()) and f.get_t() is t1
        ps[0].data = ps[0].data.clone()                    # no longer a view of the buffer: fused again
        t2 = f.get_t()
        assert t2 is not t1 and t2.data_ptr() == f.buf.data_ptr()
    t3 = f.get_t()                                         # grad enabled: the differentiable concatenation
    assert t3.requires_grad and t3.grad_fn is not None


def test_norm_output_buffer_like_the_input():
    from opsadv.backends.triton_common.norm import norm as CN
    x = torch.empty(2, 3, 8, dtype=torch.float16, device="meta")
    y = CN._out_like(x)
    assert (y.shape, y.dtype, y.device, y.is_contiguous()) == (x.shape, x.dtype, x.device, True)
    c = CN._out_like(torch.empty(2, 8))                    # CPU (the interpreter): NaN-poisoned
    assert c.isnan().all()
