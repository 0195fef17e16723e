"""Eager grad-recording norm calls resolve in their own bucket (CallSpec.train): an impl with `train`
runs under torch's own autograd (no opsadv Function, no opsadv backward dispatch), others through
opsadv's Function; autotune times such buckets forward + backward.  A device-less test backend
stands in for cuda.aten.*_autograd (which needs CUDA)."""
import importlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv import KernelImpl
from opsadv.core import dispatch, tuning
norm_ops = importlib.import_module("opsadv.ops.norm")
from opsadv.core.op_common import train_step
from opsadv.registry import BackendInfo, ProbeResult, hookimpl


class Trainer:
    """rms_norm / layer_norm whose `train` forward is torch's differentiable functional op."""

    calls = {"rms": 0, "ln": 0}

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="trainer", device_types=("cpu",), auto_priority=50)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @staticmethod
    def rms_train(ctx, x, weight, eps, residual, offset):
        Trainer.calls["rms"] += 1
        s = x + residual if residual is not None else x
        return F.rms_norm(s, (x.shape[-1],), weight, eps), (s if residual is not None else None), None

    @staticmethod
    def ln_train(ctx, x, weight, bias, eps, residual):
        Trainer.calls["ln"] += 1
        s = x + residual if residual is not None else x
        return F.layer_norm(s, (x.shape[-1],), weight, bias, eps), (s if residual is not None else None), None, None

    @staticmethod
    def unused(ctx, *a):
        raise AssertionError("a train-only impl's fn must not run")

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        only_train = (lambda spec, env: [] if spec.train else ["grad-recording calls only"])
        common = dict(backend="trainer", priority=400, device_types=("cpu",), dtypes=(torch.float32, torch.float64),
                      check=only_train)
        registry.add(KernelImpl(id="trainer.rms_norm", op="rms_norm", fn=self.unused, train=self.rms_train,
                                features=frozenset({"weight", "residual"}), **common))
        registry.add(KernelImpl(id="trainer.layer_norm", op="layer_norm", fn=self.unused, train=self.ln_train,
                                features=frozenset({"weight", "bias", "residual"}), **common))


@pytest.fixture
def trainer():
    from opsadv.registry import reset_registry
    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    reg.register_plugin(Trainer(), name="trainer")
    Trainer.calls = {"rms": 0, "ln": 0}
    dispatch.clear_cache()
    yield
    reset_registry()
    dispatch.clear_cache()


def _inputs(rows, h, residual, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(h, generator=g, dtype=torch.float64)).requires_grad_()
    b = (0.1 * torch.randn(h, generator=g, dtype=torch.float64)).requires_grad_()
    r = torch.randn(rows, h, generator=g, dtype=torch.float64, requires_grad=True) if residual else None
    return x, w, b, r


def _ref_grads(op, x, w, b, r, gy, gs):
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    rs = r.detach().clone().requires_grad_() if r is not None else None
    s = xs[0] + rs if rs is not None else xs[0]
    y = F.rms_norm(s, (x.shape[-1],), xs[1], 1e-6) if op == "rms_norm" else F.layer_norm(s, (x.shape[-1],), xs[1], xs[2], 1e-5)
    outs, grads = ([y, s], [gy, gs]) if rs is not None else ([y], [gy])
    wrt = xs[:2] + ([xs[2]] if op == "layer_norm" else []) + ([rs] if rs is not None else [])
    return y.detach(), torch.autograd.grad(outs, wrt, grads)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,h", [(1, 3), (7, 127)])
def test_grad_calls_run_the_train_forward_under_torch_autograd(trainer, op, residual, rows, h):
    x, w, b, r = _inputs(rows, h, residual, seed=rows * 1000 + h + residual)
    with opsadv.trace() as t:
        if op == "rms_norm":
            out = opsadv.ops.rms_norm(x, w, 1e-6, residual=r)
        else:
            out = opsadv.ops.layer_norm(x, w, b, 1e-5, residual=r)
    y, s = (out if residual else (out, None))
    assert t.counts[f"trainer.{op}"] == 1
    assert Trainer.calls["rms" if op == "rms_norm" else "ln"] == 1
    assert y.grad_fn is not None and "opsadv" not in type(y.grad_fn).__name__.lower()   # torch's own node
    gy = torch.randn_like(y)
    gs = torch.randn_like(y) if residual else None
    ref_y, ref = _ref_grads(op, x, w, b, r, gy, gs)
    wrt = [x, w] + ([b] if op == "layer_norm" else []) + ([r] if residual else [])
    got = torch.autograd.grad([y, s] if residual else [y], wrt, [gy, gs] if residual else [gy])
    torch.testing.assert_close(y.detach(), ref_y)
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e)


def test_no_grad_calls_do_not_take_the_train_bucket(trainer):
    x, w, _, _ = _inputs(4, 16, False, seed=3)
    with torch.no_grad(), opsadv.trace() as t:
        opsadv.ops.rms_norm(x, w)
    assert "trainer.rms_norm" not in t.counts and Trainer.calls["rms"] == 0
    exp = opsadv.explain("rms_norm", x.detach(), w.detach())
    assert any(c.impl.id == "trainer.rms_norm" and "grad-recording calls only" in " ".join(c.reasons)
               for c in exp.candidates)


@pytest.mark.parametrize("residual", [False, True])
def test_train_step_times_forward_and_backward_for_both_routes(trainer, residual):
    """What autotune times in a train bucket: the native impl's forward + torch's backward, and (for an
    impl without `train`) opsadv's Function around impl.fn + opsadv's backward; both give the
    reference gradients."""
    x, w, _, r = _inputs(5, 33, residual, seed=11 + residual)
    res = norm_ops._rms_norm_train_resolve(x, w, 1e-6, r, 0.0)
    assert res.impl.id == "trainer.rms_norm"
    args = (x, w, 1e-6, r, 0.0)
    ref_impl = next(c.impl for c in dispatch.explain_spec(res.ctx.spec, opsadv.current_policy())[0].candidates
                    if c.impl.id == "reference.rms_norm")
    for impl in (res.impl, ref_impl):
        torch.manual_seed(0)
        step = train_step("rms_norm", impl, res.ctx, args)
        grads = step()
        assert len(grads) == (3 if residual else 2)
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
    before = Trainer.calls["rms"]
    train_step("rms_norm", res.impl, res.ctx, args)()
    assert Trainer.calls["rms"] > before


def test_autotune_of_a_train_bucket_times_train_steps_and_stores_a_train_key(trainer, tmp_path, monkeypatch):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning._TUNING.reset()
    timed = []

    def fake_time(fn, device_type, reps=10, timing="wall"):
        grads = fn()                         # the step runs forward + backward: it returns gradients
        timed.append(len(grads))
        return 1.0 if len(timed) == 1 else 2.0
    monkeypatch.setattr(tuning, "time_fn", fake_time)
    x, w, _, _ = _inputs(6, 40, False, seed=5)
    with opsadv.use_backend("auto", autotune=True):
        y = opsadv.ops.rms_norm(x, w)
    assert len(timed) >= 2 and all(n == 2 for n in timed)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    keys = [k for k in (tmp_path / "tuning.json").read_text().split('"') if k.startswith("rms_norm|")]
    assert any("|train|" in k for k in keys), keys
    tuning._TUNING.reset()


def test_explain_shows_the_train_bucket_of_a_grad_recording_call(trainer):
    x, w, _, _ = _inputs(3, 8, False, seed=7)
    exp = opsadv.explain("rms_norm", x, w)
    assert exp.spec.train and exp.chosen == "trainer.rms_norm" and "train (grad-recording" in str(exp)
    with torch.no_grad():
        exp = opsadv.explain("rms_norm", x, w)
    assert not exp.spec.train and exp.chosen != "trainer.rms_norm"
    assert not opsadv.explain("rms_norm", x, w, backward=True).spec.train


def test_train_buckets_are_timed_on_wall_time_under_graph_timing(trainer, tmp_path, monkeypatch):
    """A grad-recording call cannot run under CUDA graphs (its backward is not capturable, replay is
    inference only): under timing="graph" its bucket is still timed, stored and found on wall time."""
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning._TUNING.reset()
    seen = []

    def fake_time(fn, device_type, reps=10, timing="wall"):
        seen.append(timing)
        fn()
        return float(len(seen))
    monkeypatch.setattr(tuning, "time_fn", fake_time)
    x, w, _, _ = _inputs(6, 40, False, seed=9)
    with opsadv.use_backend("auto", autotune=True, timing="graph"):
        opsadv.ops.rms_norm(x, w).sum().backward()
        exp = opsadv.explain("rms_norm", x, w)
    assert seen and set(seen) == {"wall"}
    assert exp.why.startswith("measured") and "CUDA-graph" not in exp.why
    tuning._TUNING.reset()
