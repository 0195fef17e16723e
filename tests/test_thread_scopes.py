"""`with use_backend(...)` and opsadv.trace() are per thread / context (issue 37 item 2)."""
import sys
import threading
import time

import pytest
import torch

import opsadv
from opsadv.core import policy as _policy


@pytest.fixture
def fast_switching():
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)           # interleave the threads as finely as the GIL allows
    yield
    sys.setswitchinterval(was)


def test_backend_scopes_do_not_leak_across_threads(fast_switching):
    default = _policy._global
    before = opsadv.current_policy()
    stop = threading.Event()
    seen, errors, started = [], [], threading.Event()

    def scoped():
        try:
            while not stop.is_set():
                started.set()
                with opsadv.use_backend("reference") as b:
                    if opsadv.current_policy() is not b.policy:
                        errors.append("a scope saw another policy than its own")
        except Exception as e:        # noqa: BLE001  (reported by the main thread)
            errors.append(repr(e))

    def watcher():
        started.wait(10)
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            p = opsadv.current_policy()
            if p is not before:
                seen.append(p.describe())
        stop.set()

    threads = [threading.Thread(target=scoped) for _ in range(4)] + [threading.Thread(target=watcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    assert not errors, errors[:3]
    assert not seen, f"a thread without a scope saw {len(seen)} foreign policies, e.g. {seen[0]}"
    assert _policy._global is default and opsadv.current_policy() is before


def test_with_scope_never_sets_the_process_default_even_before_enter(monkeypatch):
    """Deterministic form of the race above: between `use_backend(...)` returning and `__enter__`, another
    thread reads the process default; a with-statement's call must leave it as it was."""
    default, during = _policy._global, []

    class Spy(_policy.Backend):
        def __init__(self, *a, **kw):
            during.append(_policy._global)      # what other threads see between the call and __enter__
            super().__init__(*a, **kw)

    monkeypatch.setattr(_policy, "Backend", Spy)
    with opsadv.use_backend("reference"):
        during.append(_policy._global)
    assert during == [default, default] and _policy._global is default


def test_bare_call_still_sets_the_process_default():
    default = _policy._global
    try:
        b = opsadv.use_backend("reference")
        assert _policy._global is b.policy
        got = []
        t = threading.Thread(target=lambda: got.append(opsadv.current_policy()))
        t.start()
        t.join()
        assert got == [b.policy]            # other threads see a process default
    finally:
        _policy._set_global(default)


def test_bare_call_then_with_scopes_it():
    default = _policy._global
    b = opsadv.use_backend("reference")
    with b:
        assert _policy._global is default and opsadv.current_policy() is b.policy
    assert _policy._global is default


def _traced_calls(n, barrier, out, all_threads=False):
    x, w = torch.randn(4, 8), torch.ones(8)
    with opsadv.use_backend("reference"), opsadv.trace(all_threads=all_threads) as t:
        barrier.wait()
        for _ in range(n):
            opsadv.ops.rms_norm(x, w)
        barrier.wait()
    out.append(t)


def test_trace_counts_only_its_own_threads_calls():
    barrier, out = threading.Barrier(2), {}
    threads = [threading.Thread(target=_traced_calls, args=(n, barrier, out.setdefault(n, []))) for n in (3, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(out[3][0].counts.values()) == 3
    assert sum(out[7][0].counts.values()) == 7


def test_trace_all_threads_counts_every_thread():
    barrier, out = threading.Barrier(2), {}
    with opsadv.trace(all_threads=True) as every, opsadv.trace() as mine:
        threads = [threading.Thread(target=_traced_calls, args=(n, barrier, out.setdefault(n, [])))
                   for n in (3, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sum(every.counts.values()) == 10
    assert sum(mine.counts.values()) == 0          # this thread made no calls
    assert sum(out[3][0].counts.values()) == 3 and sum(out[7][0].counts.values()) == 7


def test_backward_on_another_thread_counts_in_the_forward_trace():
    """Autograd runs CUDA backwards on its own thread: the forward's trace still counts them."""
    from opsadv.ops.norm import _rms_bwd, _rms_setup

    class Ctx:
        def save_for_backward(self, *t):
            self.saved_tensors = t

    x, w = torch.randn(3, 16), torch.randn(16)
    ctx = Ctx()
    with opsadv.use_backend("reference"), opsadv.trace() as t:
        y, xsum, rstd = torch.ops.opsadv.rms_norm(x, w, 1e-6, None, 0.0)
        _rms_setup(ctx, (x, w, 1e-6, None, 0.0), (y, xsum, rstd))
        th = threading.Thread(target=_rms_bwd, args=(ctx, torch.ones_like(y), None, None))
        th.start()
        th.join()
        assert t.counts["reference.rms_norm"] == 2      # the forward and its backward
    th = threading.Thread(target=_rms_bwd, args=(ctx, torch.ones_like(y), None, None))
    th.start()
    th.join()
    assert t.counts["reference.rms_norm"] == 2          # a closed trace counts nothing more
