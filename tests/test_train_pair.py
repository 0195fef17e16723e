"""Training calls of the attention ops run the forward + backward pair of one impl, the pair their train bucket
timed, eager and traced alike.  A device-less test backend offers two impls of each op: `pairs.a.*` ranks first
but refuses the backward bucket (as an impl whose backward loses there would), `pairs.b.*` serves everything.
Re-dispatching the backward in its own bucket runs b's backward after a's forward: these tests guard against that,
traced and eager."""
import dataclasses
import warnings
from collections import Counter

import pytest
import torch

import opsadv
from opsadv import KernelImpl, SparseLayout
from opsadv.ops.flash_attention.reference import FEATURES as ATTN_FEATURES, attention_bwd, attention_fwd
from opsadv.ops.sparse_attention.reference import FEATURES as SPARSE_FEATURES, sparse_bwd, sparse_fwd
from opsadv.core import dispatch
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

from conftest import rel_err, requires_gpu

CALLS: Counter = Counter()


def _counted(fn, tag):
    def run(ctx, *args):
        CALLS[tag] += 1
        return fn(ctx, *args)
    return run


def _no_backward_bucket(spec, env):
    return ["its backward is not offered to the backward bucket"] if spec.backward else []


class Pairs:
    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="pairs", device_types=("cpu",), auto_priority=50)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        for op, fwd, bwd, feats in (("flash_attention", attention_fwd, attention_bwd, ATTN_FEATURES),
                                    ("sparse_attention", sparse_fwd, sparse_bwd, SPARSE_FEATURES)):
            for name, prio, check in (("a", 400, _no_backward_bucket), ("b", 300, None)):
                registry.add(KernelImpl(id=f"pairs.{name}.{op}", op=op, backend="pairs",
                                        fn=_counted(fwd, f"{name}.fwd"), backward=_counted(bwd, f"{name}.bwd"),
                                        priority=prio, device_types=("cpu",), dtypes=(torch.float32, torch.float64),
                                        features=feats, check=check))


@pytest.fixture
def pairs(tmp_path, monkeypatch):
    from opsadv.core import tuning
    from opsadv.registry import reset_registry
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))      # autotune's winners must not reach other tests
    tuning.reload()
    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    reg.register_plugin(Pairs(), name="pairs")
    dispatch.clear_cache()
    CALLS.clear()
    yield
    reset_registry()
    dispatch.clear_cache()
    monkeypatch.undo()
    tuning.reload()


def _dense(q, k, v):
    return opsadv.ops.flash_attention(q, k, v, causal=True)


WINDOW = SparseLayout.sliding_window(37, 9, causal=True, block_size=16)


def _sparse(q, k, v):
    return opsadv.ops.sparse_attention(q, k, v, WINDOW)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 37, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 37, 16, generator=g, dtype=torch.float64) for _ in range(2))
    go = torch.randn(2, 4, 37, 16, generator=g, dtype=torch.float64)
    return q, k, v, go


def _grads(fn, seed):
    q, k, v, go = _inputs(seed)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    (out * go).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("op", [_dense, _sparse], ids=["flash_attention", "sparse_attention"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_training_call_runs_one_impls_pair(pairs, op, mode):
    with opsadv.use_backend("reference"):
        want_out, want = _grads(op, 0)
    CALLS.clear()
    fn = op if mode == "eager" else torch.compile(op, backend="aot_eager", fullgraph=True)
    with opsadv.use_backend("pairs"):
        out, got = _grads(fn, 0)
        out2, got2 = _grads(fn, 1)         # a second call: the memoized choice, same pair
    assert CALLS["b.bwd"] == 0 and CALLS["b.fwd"] == 0, CALLS
    assert CALLS["a.fwd"] == 2 and CALLS["a.bwd"] == 2, CALLS
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with opsadv.use_backend("reference"):
        _, want2 = _grads(op, 1)
    for g, w in zip(got2, want2):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("op", [_dense, _sparse], ids=["flash_attention", "sparse_attention"])
def test_compiled_inference_call_stays_in_the_forward_bucket(pairs, op):
    q, k, v, _ = _inputs(2)
    with opsadv.use_backend("pairs"), torch.no_grad():
        out = torch.compile(op, backend="aot_eager", fullgraph=True)(q, k, v)
    assert CALLS == Counter({"a.fwd": 1}) and torch.isfinite(out).all()


@pytest.mark.parametrize("op", [_dense, _sparse], ids=["flash_attention", "sparse_attention"])
def test_compiled_training_call_autotunes_pairs(pairs, op):
    """With autotune on, a traced training call measures each impl's pair inside the compiled forward, where the
    tensors do not require grad and grad mode is off: the step differentiates detached leaves; no impl may
    fail there (a failed candidate times inf and would make the choice arbitrary)."""
    with opsadv.use_backend("reference"):
        _, want = _grads(op, 3)
    with opsadv.use_backend("pairs", autotune=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        _, got = _grads(torch.compile(op, backend="aot_eager", fullgraph=True), 3)
    assert CALLS["a.bwd"] >= 1 and CALLS["b.bwd"] >= 1      # both pairs were timed with their backward
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@requires_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_compiled_training_runs_one_pair(tmp_path, monkeypatch, d):
    """On a GPU with every impl measured: a compiled training step's forward and backward count the same impl
    (one pair), and its gradients match the reference in float32."""
    from opsadv.core import tuning
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    dispatch.clear_cache()
    g = torch.Generator(device="cuda").manual_seed(d)
    q, go = (torch.randn(2, 8, 1000, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 1000, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    fn = torch.compile(_dense, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # all_threads: a compiled graph's backward runs on autograd's CUDA thread, outside this thread's trace
    with opsadv.use_backend("cuda", autotune=True), opsadv.trace(all_threads=True) as t:
        (fn(*leaves) * go).sum().backward()
    assert len(t.counts) == 1 and list(t.counts.values()) == [2], str(t)
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    with opsadv.use_backend("reference"):
        (_dense(*ref) * go.float()).sum().backward()
    for got, want in zip(leaves, ref):
        assert rel_err(got.grad.float(), want.grad) < 2e-2
    tuning.reload()
