"""A config tuner compiles its configs on worker threads before it times any (utils.precompile): every config
launched once off the caller's thread, in the caller's context (tuning.deferred), a nested tuner taking its
default instead of tuning inside a worker, errors left to the caller's own launch.  CUDA is faked: CI has none."""
import contextlib
import threading

import pytest

pytest.importorskip("triton")

from opsadv.backends.triton_common import utils as U  # noqa: E402
from opsadv.core import tuning  # noqa: E402

from conftest import requires_gpu  # noqa: E402


class _Stream:
    def __init__(self):
        self.synced = 0

    def synchronize(self):
        self.synced += 1


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    stream, devices = _Stream(), []
    cuda = U.torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cuda, "current_device", lambda: 3)
    monkeypatch.setattr(cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(cuda, "set_device", devices.append)
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setenv("OPSADV_COMPILE_THREADS", "4")
    return stream, devices


def test_every_config_launches_on_a_worker_in_the_callers_context(fake_cuda):
    stream, devices = fake_cuda
    seen, main = [], threading.get_ident()

    def launch(cfg):
        if cfg["BM"] == 256:
            raise RuntimeError("out of shared memory")      # left to the caller's launch
        seen.append((cfg["BM"], threading.get_ident() != main, tuning.is_deferred(), U._PRECOMPILING.get()))
    configs = [{"BM": b} for b in (64, 128, 256, 32, 16)]
    with tuning.deferred():
        assert U.precompile(configs, launch) == 5
    assert sorted(seen) == [(b, True, True, True) for b in (16, 32, 64, 128)]
    assert devices == [3] * 5 and stream.synced == 1
    assert not U._PRECOMPILING.get()          # the flag lives in the workers' contexts only


def test_a_tuner_reached_from_a_worker_takes_its_default(fake_cuda):
    inner = U.ConfigTuner("t.inner")
    picked = []

    def launch(cfg):
        picked.append(inner.pick(("k",), [{"X": 1}, {"X": 2}], lambda c: 1 / 0, autotune=True))
    assert U.precompile([{"v": 1}, {"v": 2}], launch) == 2
    assert picked == [{"X": 1}, {"X": 1}] and inner.best == {}        # nothing tuned, nothing kept


def test_tune_compiles_on_workers_then_launches_and_times_on_the_caller(fake_cuda, monkeypatch):
    events, main = [], threading.get_ident()
    monkeypatch.setattr(tuning, "_device_present", lambda device_type: False)     # no spin-up / sync
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), {64: 2.0, 128: 1.0}[events[-1][0]])[1])

    def launch(cfg):
        events.append((cfg["BM"], threading.get_ident() == main))
    best = U.ConfigTuner("t.pre").pick(("k", 9), [{"BM": 64}, {"BM": 128}], launch, autotune=True)
    assert best == {"BM": 128}
    assert sorted(events[:2]) == [(64, False), (128, False)]          # compiled side by side
    assert events[2:4] == [(64, True), (128, True)]                   # the caller's warm launch, in order
    assert all(on_main for _, on_main in events[2:])                  # every timed launch on the caller


@pytest.mark.parametrize("value, want", [("1", 0), ("0", 0), ("", 2)])
def test_compile_threads_setting(fake_cuda, monkeypatch, value, want):
    monkeypatch.setenv("OPSADV_COMPILE_THREADS", value)
    monkeypatch.setattr(U.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert U.precompile([{"a": 1}, {"a": 2}], lambda c: None) == want


def test_compile_threads_refuses_garbage(monkeypatch):
    monkeypatch.setenv("OPSADV_COMPILE_THREADS", "many")
    with pytest.raises(ValueError, match="OPSADV_COMPILE_THREADS.*many"):
        U.compile_threads()


def test_no_threads_without_cuda_or_under_capture(fake_cuda, monkeypatch):
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert U.precompile([{"a": 1}, {"a": 2}], lambda c: 1 / 0) == 0
    monkeypatch.setattr(U.torch.cuda, "is_available", lambda: False)
    assert U.precompile([{"a": 1}, {"a": 2}], lambda c: 1 / 0) == 0


@requires_gpu
def test_gpu_configs_compile_on_threads_and_the_winner_computes(tmp_path, monkeypatch):
    """On a GPU: a real Triton kernel's configs compile on worker threads (each config a distinct specialization),
    then the caller times them and the chosen config's output is right (poisoned first)."""
    import triton
    import triton.language as tl

    @triton.jit
    def scale_add(x, y, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out + offs, 2.0 * tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)

    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setenv("OPSADV_COMPILE_THREADS", "4")
    n = 100_003
    x, y = (U.torch.randn(n, device="cuda") for _ in range(2))
    out = U.torch.full_like(x, float("nan"))
    threads = set()

    def launch(cfg):
        threads.add(threading.get_ident())
        scale_add[(triton.cdiv(n, cfg["BLOCK"]),)](x, y, out, n, BLOCK=cfg["BLOCK"])
    best = U.ConfigTuner("t.gpu").pick(("k",), [{"BLOCK": b} for b in (128, 256, 512, 1024)], launch, True)
    assert best["BLOCK"] in (128, 256, 512, 1024) and len(threads) >= 2
    out.fill_(float("nan"))
    launch(best)
    U.torch.testing.assert_close(out, 2 * x + y)
