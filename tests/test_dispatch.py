"""Resolution with reasons, explain, trace, policy scoping, strictness and fallback warnings."""
import importlib
import logging
import threading
import warnings

import pytest
import torch

import opsadv
from opsadv import KernelImpl
from opsadv.core import dispatch
from opsadv.errors import NoKernelError
from opsadv.registry import BackendInfo, ProbeResult, hookimpl


class Widget:
    """A device-less test backend: fp16-only rms_norm at a priority above the reference."""

    calls = 0

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="widget", device_types=("cpu",), auto_priority=50)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @staticmethod
    def rms(ctx, x, weight, eps, residual, offset):
        Widget.calls += 1
        from opsadv.ops.norm.reference import rms_norm_fwd
        return rms_norm_fwd(ctx, x, weight, eps, residual, offset)

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        registry.add(KernelImpl(id="widget.rms_norm", op="rms_norm", backend="widget", fn=self.rms,
                                priority=150, device_types=("cpu",), dtypes=(torch.float16,),
                                features=frozenset({"weight"}),
                                check=lambda spec, env: ["hidden > 64"] if spec.shapes[0][-1] > 64 else []))


@pytest.fixture
def widget():
    """A fresh registry without the interpreter (so only reference + widget serve CPU tensors)."""
    import dataclasses

    from opsadv.registry import reset_registry
    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    rec = reg.register_plugin(Widget(), name="widget")
    yield rec
    reset_registry()


def test_explain_lists_every_candidate_with_reasons(widget):
    x, w = torch.randn(4, 32, dtype=torch.float16), torch.randn(32, dtype=torch.float16)
    with opsadv.use_backend("auto"):
        exp = opsadv.explain("rms_norm", x, w, 1e-6)
        assert exp.chosen == "widget.rms_norm"
        exp = opsadv.explain("rms_norm", x.float(), w.float(), 1e-6)
        assert exp.chosen == "reference.rms_norm"
        rej = next(c for c in exp.candidates if c.impl.id == "widget.rms_norm")
        assert not rej.accepted and "dtype float32 not in ['float16']" in rej.reasons[0]
        exp = opsadv.explain("rms_norm", torch.randn(4, 100, dtype=torch.float16), None, 1e-6,
                             residual=torch.randn(4, 100, dtype=torch.float16))
        rej = next(c for c in exp.candidates if c.impl.id == "widget.rms_norm")
        assert "does not support residual" in rej.reasons[0]
        text = str(exp)
        assert "-> reference.rms_norm" in text and "rejected" in text


def test_dynamic_check_reasons(widget):
    x = torch.randn(2, 100, dtype=torch.float16)
    exp = opsadv.explain("rms_norm", x, torch.randn(100, dtype=torch.float16), 1e-6)
    assert next(c for c in exp.candidates if c.impl.id == "widget.rms_norm").reasons == ("hidden > 64",)


def test_trace_counts_and_routes(widget):
    x, w = torch.randn(4, 32, dtype=torch.float16), torch.randn(32, dtype=torch.float16)
    before = Widget.calls
    with opsadv.trace() as t:
        for _ in range(3):
            opsadv.ops.rms_norm(x, w)
        opsadv.ops.rms_norm(x.float(), w.float())
    assert t.counts == {"widget.rms_norm": 3, "reference.rms_norm": 1}
    assert Widget.calls - before == 3 and "widget.rms_norm" in str(t)


def test_explicit_backend_never_falls_back(widget):
    with opsadv.use_backend("widget"):
        with pytest.raises(NoKernelError) as ei:
            opsadv.ops.rms_norm(torch.randn(4, 32), torch.randn(32))
    msg = str(ei.value)
    assert "widget.rms_norm: dtype float32 not in ['float16']" in msg
    assert "reference.rms_norm: backend 'reference' not selected by policy" in msg


def test_fallback_to_reference_warns_once_while_device_backend_present(widget):
    dispatch._logged_fallback.discard("rms_norm")
    with opsadv.use_backend("auto"):
        with pytest.warns(RuntimeWarning, match="falls back to the reference backend"):
            opsadv.ops.rms_norm(torch.randn(3, 33), torch.randn(33))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opsadv.ops.rms_norm(torch.randn(3, 34), torch.randn(34))   # same op: no second warning


def test_first_resolution_logs_one_line(caplog):
    dispatch.clear_cache()
    with opsadv.use_backend("reference"), caplog.at_level(logging.INFO, logger="opsadv.dispatch"):
        opsadv.ops.layer_norm(torch.randn(5, 24))
        opsadv.ops.layer_norm(torch.randn(5, 24))
    lines = [r.message for r in caplog.records if "layer_norm" in r.message]
    assert len(lines) == 1 and "-> reference.layer_norm" in lines[0]


def test_scoped_policy_is_per_thread():
    seen = {}
    opsadv.use_backend("reference")
    with opsadv.use_backend("auto", strict=True):
        t = threading.Thread(target=lambda: seen.setdefault("other", opsadv.current_policy().describe()))
        t.start(); t.join()
        inside = opsadv.current_policy().describe()
    assert "strict" in inside and seen["other"] == "backend='reference'"
    assert opsadv.current_policy().describe() == "backend='reference'"


def test_use_backend_repr_and_global_default():
    b = opsadv.use_backend("reference")
    assert repr(b) == "Backend('reference')"
    assert opsadv.current_policy().backend == "reference"


def test_memo_hot_path_is_a_dict_hit():
    with opsadv.use_backend("reference"):
        x = torch.randn(8, 16)
        opsadv.ops.rms_norm(x)
        n = len(dispatch._memo)
        for _ in range(5):
            opsadv.ops.rms_norm(torch.randn(8, 16))
        assert len(dispatch._memo) == n


def test_fully_masked_rows_give_zeros():
    q = torch.randn(1, 2, 6, 8)
    k = torch.randn(1, 2, 3, 8)
    with opsadv.use_backend("reference"):
        out, lse = opsadv.ops.flash_attention(q, k, k, causal=True, return_lse=True)   # sq > sk: first 3 rows see nothing
    assert torch.isfinite(out).all() and (out[:, :, :3] == 0).all() and torch.isinf(lse[:, :, :3]).all()


def test_backward_resolves_under_forward_policy_on_another_thread():
    """Autograd may run backward on another thread (CUDA does): it must use the forward's policy."""
    from opsadv.ops.norm import _rms_bwd, _rms_setup

    class Ctx:
        def save_for_backward(self, *t):
            self.saved_tensors = t

    x, w = torch.randn(3, 16), torch.randn(16)
    ctx = Ctx()
    with opsadv.use_backend("reference", deterministic=True):
        y, xsum, rstd = torch.ops.opsadv.rms_norm(x, w, 1e-6, None, 0.0)
        _rms_setup(ctx, (x, w, 1e-6, None, 0.0), (y, xsum, rstd))
    seen = {}

    def run():
        with opsadv.trace() as t:
            _rms_bwd(ctx, torch.ones_like(y), None, None)
        seen["policy"] = ctx.opsadv_policy.deterministic
        seen["calls"] = dict(t.counts)
    th = threading.Thread(target=run)
    th.start(); th.join()
    assert seen == {"policy": True, "calls": {"reference.rms_norm": 1}}


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_fork_safe():
    """A forked child (e.g. a DataLoader worker) can switch backends and run ops: locks are re-made."""
    import os
    opsadv.use_backend("reference")
    opsadv.ops.rms_norm(torch.randn(2, 8))
    pid = os.fork()
    if pid == 0:                                   # child: never return into pytest
        code = 1
        try:
            with opsadv.use_backend("reference", deterministic=True):
                y = opsadv.ops.rms_norm(torch.ones(2, 8))
            code = 0 if torch.allclose(y, torch.ones(2, 8)) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_explain_names_the_bucket_entries():
    """explain() says what each bucket entry is (a power-of-two bound or an exact value); the names are not
    part of the spec's identity (memo / tuning keys stay as they were)."""
    import dataclasses
    q = torch.randn(1, 2, 300, 64)
    with opsadv.use_backend("reference"):
        text = str(opsadv.explain("flash_attention", q, q, q, causal=True))
        assert "bucket=(s_q<=512, s_k<=512, batch*heads<=16)" in text
        x, w = torch.randn(5, 64), torch.randn(64, 32)
        assert "bucket=(rows<=16, K=64, N=32)" in str(opsadv.explain("gemm", x, w))
    A = importlib.import_module("opsadv.ops.flash_attention")
    spec = A._spec(q, q, None, True, False)
    assert spec == dataclasses.replace(spec, bucket_names=()) and hash(spec) == hash(dataclasses.replace(spec, bucket_names=()))
    assert dataclasses.replace(spec, bucket_names=("a",)).bucket_text() == str(spec.bucket)   # names must match


class Ranker:
    """A second device-less backend: an rms_norm impl at priority 100 (below widget's 150) whose rank() puts it at
    200 for rows wider than 40, and one whose rank() raises."""

    ranked: list = []

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="ranker", device_types=("cpu",), auto_priority=40)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @staticmethod
    def _rank(spec, env):
        Ranker.ranked.append(spec.shapes[0][-1])
        return (200, "measured faster on wide rows") if spec.shapes[0][-1] > 40 else None

    @staticmethod
    def _broken_rank(spec, env):
        raise RuntimeError("boom")

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        common = dict(op="rms_norm", backend="ranker", fn=Widget.rms, device_types=("cpu",), dtypes=(torch.float16,),
                      features=frozenset({"weight"}))
        registry.add(KernelImpl(id="ranker.rms_norm", priority=100, rank=self._rank, **common))
        registry.add(KernelImpl(id="ranker.broken_rank", priority=90, rank=self._broken_rank, **common))


def test_rank_orders_candidates_per_call_and_explains_it(widget):
    from opsadv.registry import get_registry
    get_registry().register_plugin(Ranker(), name="ranker")
    dispatch.clear_cache()
    w = torch.randn(48, dtype=torch.float16)
    with opsadv.use_backend("auto"):
        narrow = opsadv.explain("rms_norm", torch.randn(4, 32, dtype=torch.float16), w[:32], 1e-6)
        assert narrow.chosen == "widget.rms_norm" and "highest priority (150)" in narrow.why
        wide = opsadv.explain("rms_norm", torch.randn(4, 48, dtype=torch.float16), w, 1e-6)
        assert wide.chosen == "ranker.rms_norm"
        assert wide.why == "highest priority (200: measured faster on wide rows) of 4 accepted"
        text = str(wide)
        assert "-> ranker.rms_norm" in text and "[priority 200 here, 100 static: measured faster on wide rows]" in text
        row = next(c for c in wide.to_dict()["candidates"] if c["impl"] == "ranker.rms_norm")
        assert (row["priority"], row["static_priority"], row["ranked"]) == (200, 100, "measured faster on wide rows")
        assert [c.impl.id for c in wide.candidates][:2] == ["ranker.rms_norm", "widget.rms_norm"]
        broken = next(c for c in wide.candidates if c.impl.id == "ranker.broken_rank")
        assert broken.accepted and broken.rank_priority == 90 and "rank() raised RuntimeError: boom" in broken.ranked
        # a rejected impl's rank() is not consulted (float32: every fp16-only impl rejected)
        Ranker.ranked.clear()
        opsadv.explain("rms_norm", torch.randn(4, 48), w.float(), 1e-6)
        assert Ranker.ranked == []
        # the call runs what the explanation chose
        before = Widget.calls
        with opsadv.trace() as t:
            opsadv.ops.rms_norm(torch.randn(4, 48, dtype=torch.float16), w, 1e-6)
        assert t.counts["ranker.rms_norm"] == 1 and Widget.calls == before + 1


def test_memo_does_not_grow_with_backend_switches():
    """The memo is keyed on the policy's content: 61k use_backend() switches between two policies once grew it by
    one entry per switch and bucket (61,001 entries); now a few."""
    import dataclasses

    from opsadv.core import policy as P
    x = torch.randn(8, 16)
    try:
        dispatch.clear_cache()
        for i in range(2000):
            opsadv.use_backend("reference", strict=bool(i % 2))
            opsadv.ops.rms_norm(x)
            with opsadv.use_backend("reference", deterministic=True):
                opsadv.ops.rms_norm(x)
        assert len(dispatch._memo) <= 3, len(dispatch._memo)
    finally:
        opsadv.use_backend("auto")
    a, b = P.Policy(backend="reference"), P.Policy(backend="reference")
    assert a.serial == b.serial and P.Policy(backend="reference", strict=True).serial != a.serial
    assert dataclasses.replace(a, strict=True).serial == P.Policy(backend="reference", strict=True).serial
    # options read differently stay apart although they compare equal
    assert P.Policy(options=(("x", 1),)).serial != P.Policy(options=(("x", True),)).serial


def test_memo_is_bounded_over_distinct_policies(monkeypatch):
    from opsadv.core import policy as P
    monkeypatch.setattr(dispatch, "MEMO_MAX", 64)
    x = torch.randn(8, 16)
    dispatch.clear_cache()
    for i in range(300):            # 300 distinct policies (an option the reference backend ignores)
        token = P._scoped.set(P.Policy(backend="reference", options=(("n", i),)))
        try:
            torch.testing.assert_close(opsadv.ops.rms_norm(x), torch.nn.functional.rms_norm(x, (16,), eps=1e-6))
        finally:
            P._scoped.reset(token)
        assert len(dispatch._memo) <= 64
