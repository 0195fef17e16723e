"""Measured impl choice per shape bucket, persisted as JSON so a second process pays nothing.

The cache file lives in cache_dir() ($OPSADV_CACHE_DIR, else $XDG_CACHE_HOME/opsadv, else ~/.cache/opsadv) and
is keyed by device name and library versions, opsadv's included: a new driver stack, GPU or opsadv release
never reuses stale measurements.  How the file is validated, locked and merged: core/cachefile.py."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

from .cachefile import JsonCache, cache_dir, json_depth_ok
from .env import EnvInfo
from .kernel import CallSpec
from .resolved import Resolved
from .train_steps import train_step
from .version import __version__


@dataclass(frozen=True)
class DeviceTimer:
    """How to time work on one torch device type.  A backend declares one through the optional hook
    `opsadv_device_timer(device_type)`; otherwise default_timer(device_type) applies.

    synchronize: waits for the device's queued work (None: calls return when done, as on the CPU).
    event: makes a timing event with record() / synchronize() / elapsed_time(other) in ms, like
    torch.cuda.Event(enable_timing=True) (None: the host clock around a synchronize).
    triton_bench: triton.testing.do_bench / do_bench_cudagraph can time this device (CUDA and ROCm)."""

    device_type: str
    synchronize: Callable[[], None] | None = None
    event: Callable[[], Any] | None = None
    triton_bench: bool = False
    available: Callable[[], bool] | None = None     # is a device of this type present (None: assume so)

    def sync(self) -> None:
        if self.synchronize is not None:
            self.synchronize()


def _torch_device_module(name: str):
    import torch
    return getattr(torch, name, None)


def _module_timer(device_type: str, triton_bench: bool = False) -> DeviceTimer:
    # looked up at call time (torch.npu appears only once torch_npu is imported; tests patch synchronize)
    def sync():
        _torch_device_module(device_type).synchronize()

    def event():
        return _torch_device_module(device_type).Event(enable_timing=True)

    def available():
        mod = _torch_device_module(device_type)
        try:
            return mod is not None and bool(mod.is_available())
        except Exception:   # a broken driver: nothing to time on
            return False
    return DeviceTimer(device_type, sync, event, triton_bench, available)


def default_timer(device_type: str) -> DeviceTimer:
    """torch.cuda (NVIDIA and ROCm), torch.xpu or torch.npu synchronize and events; none on the CPU."""
    if device_type in ("cuda", "xpu", "npu"):
        return _module_timer(device_type, triton_bench=device_type == "cuda")
    return DeviceTimer(device_type)


_DECLARED_TIMERS: dict[str, DeviceTimer] = {}


def declare_timers(timers: dict[str, DeviceTimer]) -> None:
    """The timers the available backends declared, by device type (the registry sets them at discovery)."""
    global _DECLARED_TIMERS
    _DECLARED_TIMERS = dict(timers)


def timer_for(device_type: str) -> DeviceTimer:
    """The declared timer of an available backend for this device type, else the default."""
    return _DECLARED_TIMERS.get(device_type) or default_timer(device_type)

log = logging.getLogger("opsadv.tuning")


def _device_key(env: EnvInfo) -> str:
    # opsadv's version too: another release's kernels (or their configs) may have other winners
    return (f"{env.device_name or env.device_type}|torch {env.torch_version}|triton {env.triton_version}"
            f"|opsadv {__version__}")


def spec_key(spec: CallSpec) -> str:
    # the head dim is part of the key: d64 and d128 calls of one (s_q, s_k, batch*heads) bucket have
    # different winners (on the H200 a d64 measurement once served d128 calls, 4-10% slower than the best)
    hd = "" if spec.head_dim is None else f"|d{spec.head_dim}"
    return (f"{spec.op}|{'bwd' if spec.backward else 'train' if spec.train else 'infer' if spec.inference else 'fwd'}|{str(spec.dtype).replace('torch.', '')}|"
            f"{spec.device_type}|{spec.bucket}|{','.join(sorted(spec.features))}{hd}")


def _measured_entry(v) -> str | None:
    """Why a tuning.json value is malformed (None: a winner with its times and shapes)."""
    if not isinstance(v, dict) or not isinstance(v.get("winner"), str):
        return "no 'winner' string"
    times = v.get("times_ms", {})
    if not isinstance(times, dict) or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                              for t in times.values()):
        return "'times_ms' is not an object of numbers"
    shapes = v.get("shapes", [])
    if not isinstance(shapes, list) or not all(isinstance(x, list) and all(isinstance(n, int) for n in x)
                                               for x in shapes):
        return "'shapes' is not a list of integer lists"
    return None


def kernel_config_entry(v) -> str | None:
    """Why a kernel_configs.json value is malformed: a config is a dict / tuple of scalars, at most {"cfg": (..)}
    deep; anything else is not one opsadv wrote."""
    return None if json_depth_ok(v, 3) else "not a kernel config (JSON scalars in lists / objects, 3 deep)"


_TUNING = JsonCache("tuning.json", _measured_entry)


def reload() -> None:
    _TUNING.reset()


def report(env: EnvInfo | None = None) -> str:
    """What measurement decided on this machine, as text: the impl winners (tuning.json, with their times) and the
    kernels' configs and variants (kernel_configs.json, e.g. the flash backward's "kernels" / "ds"), for the
    current device and library versions (every section when env is None or has none)."""
    lines = [f"opsadv tuning caches in {cache_dir()}"]
    for name, title in (("tuning.json", "impl measured fastest per shape bucket"),
                        ("kernel_configs.json", "kernel configs / variants measured per bucket")):
        data = _TUNING.sections() if name == _TUNING.name else JsonCache(name, kernel_config_entry).sections()
        sections = {k: v for k, v in data.items() if v and (env is None or k == _device_key(env))}
        lines.append(f"{name}: {title}" + ("" if sections else " -- nothing measured for this device yet"))
        for section, entries in sorted(sections.items()):
            lines.append(f"  [{section}] {len(entries)} entries")
            for key, val in sorted(entries.items()):
                if isinstance(val, dict) and "winner" in val:
                    times = ", ".join(f"{k} {v:.4g}" for k, v in sorted(val.get("times_ms", {}).items(),
                                                                          key=lambda kv: kv[1]))
                    lines.append(f"    {key}: {val['winner']} ({times} ms)")
                else:
                    lines.append(f"    {key}: {json.dumps(val, sort_keys=True)}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Measured:
    winner: str
    times_ms: dict[str, float]
    timing: str = "wall"
    shapes: tuple = ()              # the exact shapes it was measured at (a bucket spans other shapes too)
    call_shapes: tuple = ()         # the shapes of the call this measurement now decides (lookup)

    def describe(self) -> str:
        others = ", ".join(f"{k} {v:.4g} ms" for k, v in sorted(self.times_ms.items(), key=lambda kv: kv[1]))
        how = "GPU time of CUDA-graph replays: " if self.timing == "graph" else ""
        where = ""
        if self.shapes:
            where = " at shapes " + ", ".join(str(s) for s in self.shapes)
            if self.call_shapes and tuple(self.call_shapes) != tuple(self.shapes):
                # the winner can differ between shapes of one bucket (e.g. GEMM rows 12252 vs 16384)
                where += " (another shape of this call's bucket: tune on representative inputs)"
        return f"measured fastest{where} ({how}{others})"


def _entry_key(spec: CallSpec, timing: str) -> str:
    # graph-timed winners are kept apart: under graphs the host cost of a launch does not count
    return spec_key(spec) if timing == "wall" else f"{spec_key(spec)} timing={timing}"


def _timing_for(spec: CallSpec, timing: str) -> str:
    # a grad-recording call is never replayed under CUDA graphs (graph replay is inference only) and its
    # backward cannot be captured: it is timed, stored and looked up as back-to-back wall time
    return "wall" if spec.train else timing


def lookup(spec: CallSpec, accepted: list[str], env: EnvInfo, timing: str = "wall") -> Measured | None:
    if len(accepted) < 2:
        return None
    timing = _timing_for(spec, timing)
    key = _entry_key(spec, timing)
    entry = _TUNING.get(_device_key(env), key)
    if not entry or entry.get("winner") not in accepted:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("tuning cache miss: %s (%s)", key, "stored winner %s not accepted now" % entry.get("winner")
                      if entry else "nothing measured; priority decides unless autotune is on")
        return None
    log.debug("tuning cache hit: %s -> %s", key, entry["winner"])
    shapes = tuple(tuple(x) for x in entry.get("shapes", ()))
    return Measured(entry["winner"], dict(entry.get("times_ms", {})), timing, shapes, tuple(spec.shapes))


def store(spec: CallSpec, env: EnvInfo, measured: Measured) -> None:
    _TUNING.put(_device_key(env), _entry_key(spec, measured.timing), {
        "winner": measured.winner, "times_ms": measured.times_ms, "date": time.strftime("%Y-%m-%d"),
        "shapes": [list(x) for x in measured.shapes]})


def time_fn(fn, device_type: str, reps: int = 10, timing: str = "wall") -> float:
    """Median milliseconds of fn(): on devices Triton can bench (CUDA, ROCm) do_bench around back-to-back calls
    (timing="wall"), or the GPU time of CUDA-graph replays (timing="graph": the host cost of launching is not
    counted, as under graphs; a function that cannot be captured raises); elsewhere perf_counter around each
    call and the device's synchronize (timer_for(device_type): an xpu / npu call is not timed as its launch)."""
    timer = timer_for(device_type)
    if timer.triton_bench and timing == "graph":
        from triton.testing import do_bench_cudagraph
        return float(do_bench_cudagraph(fn, rep=40, return_mode="median"))
    if timer.triton_bench:
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            # >= MIN_CALLS calls in the window: do_bench runs rep / (its estimate) calls, so a fixed 40 ms
            # timed a 15 ms training step two or three times
            warmup, rep = sample_window(one_call_ms(fn, device_type))
            return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        timer.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


TUNE_ROUNDS = 5   # on a device: interleaved rounds, median per impl (see time_rounds)
MIN_CALLS = 8     # calls per timed sample on a GPU (time_fn)


def sample_window(est_ms: float) -> tuple[float, float]:
    """(warmup, rep) in ms for do_bench around a call of about est_ms: do_bench runs rep / est calls, so a
    fixed 40 ms window times a 29 ms fwd+bwd once (the same cuDNN kernel then read 0.951-1.000x its peer over
    five such rounds); at least MIN_CALLS calls, warm-up >= one call.  The tuner's samples and the
    bench runner's rounds both use it."""
    est = max(float(est_ms), 0.0)
    return max(10.0, est), max(40.0, MIN_CALLS * est)


def one_call_ms(fn, device_type: str = "cuda") -> float:
    """One call of fn on the GPU, timed with its device's events (fn has run before: compiled, warm); 0 without a
    device (tests that stand in a fake do_bench: the default window)."""
    timer = timer_for(device_type)
    if timer.event is None or not _device_present(device_type):
        return 0.0
    start, end = timer.event(), timer.event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
OUT_OF_RACE = 1.5   # after the first round, candidates this much slower than the fastest are not timed again


def _warn_failed(impl_id: str, e: Exception) -> None:
    log.warning("autotune: %s failed: %s", impl_id, e)


SPIN_UP_MS = 250    # GPU time run before a tuning's first round (see _spin_up)


def _gpu_present() -> bool:
    import torch
    return torch.cuda.is_available()


def _device_present(device_type: str) -> bool:
    if device_type == "cuda":
        return _gpu_present()
    timer = timer_for(device_type)
    return timer.synchronize is not None and (timer.available is None or timer.available())


def _spin_up(step, ms: float = SPIN_UP_MS, device_type: str = "cuda") -> None:
    """Run step back to back for about `ms` before anything is timed: the candidates were just compiled (seconds
    of host work with the GPU idle), and the clocks ramp back up over the next ~100 ms.  Without it, on the
    H200, three rotated rounds straight after the compiles timed the Gluon forward 11% slower than the
    benchmark did minutes later (fp16 b4 s4096 d128: 1.945 vs 1.754 ms), and cuDNN won that bucket."""
    timer = timer_for(device_type)
    start = time.perf_counter()
    while True:
        try:
            step()
        except Exception:       # time_rounds reports a failing candidate; spinning up needs no error of its own
            return
        timer.sync()
        if (time.perf_counter() - start) * 1e3 >= ms:
            return


def time_rounds(steps: dict, device_type: str, timing: str) -> dict[str, float]:
    """Median ms of each step over TUNE_ROUNDS interleaved rounds on a device (the order rotated per round),
    one round on a CPU.  Timed one after another once, the first candidate after a compile pause ran on
    ramping clocks: on the H200 that once made cuDNN "win" buckets where the Gluon kernel was 4-12% faster
    in the benchmark (which already times in rotated rounds).  A candidate over OUT_OF_RACE x the fastest in
    the first round keeps that one time (ramping clocks move times by percents, not by half): a training
    bucket's slowest candidates (memory-efficient attention: 160 ms per fwd+bwd at b4 s4096) are not re-run."""
    names = list(steps)
    rounds = 1 if device_type == "cpu" else TUNE_ROUNDS
    seen: dict[str, list[float]] = {n: [] for n in names}
    if device_type != "cpu" and names and _device_present(device_type):
        _spin_up(steps[names[0]], device_type=device_type)
    for r in range(rounds):
        if r == 1:      # (the one timed first may have run on ramping clocks: it always gets a second round)
            fastest = min((v[0] for v in seen.values() if v), default=float("inf"))
            names = [n for i, n in enumerate(names) if i == 0 or (seen[n] and seen[n][0] <= OUT_OF_RACE * fastest)]
        for n in names[r % len(names):] + names[:r % len(names)] if names else ():
            if seen[n] and seen[n][-1] == float("inf"):
                continue
            try:
                seen[n].append(time_fn(steps[n], device_type, timing=timing))
            except Exception as e:
                _warn_failed(n, e)
                seen[n].append(float("inf"))
    return {n: sorted(v)[len(v) // 2] for n, v in seen.items()}


_SPENT = {"s": 0.0, "depth": 0}
_DEFERRED: ContextVar[bool] = ContextVar("opsadv_tuning_deferred", default=False)


@contextlib.contextmanager
def deferred():
    """`with deferred():` calls in the block measure nothing new: impls and kernel configs come from the tuning
    caches where a bucket was measured, else from priority / the profile's default config, and that choice is not
    memoized, so the bucket's first call outside the block still tunes it.  convert_model validates under it:
    validation inputs are not the shapes the model will run, and tuning them cost most of a conversion."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def is_deferred() -> bool:
    return _DEFERRED.get()



def seconds_spent() -> float:
    """Wall seconds this process has spent autotuning (impls and kernel configs: compiles and timing)."""
    return _SPENT["s"]


class spending:
    """`with spending():` counts the block's wall time in seconds_spent() (nested blocks count once)."""

    def __enter__(self):
        if _SPENT["depth"] == 0:
            self.t0 = time.perf_counter()
        _SPENT["depth"] += 1

    def __exit__(self, *exc):
        _SPENT["depth"] -= 1
        if _SPENT["depth"] == 0:
            _SPENT["s"] += time.perf_counter() - self.t0


def autotune(exp, resolved, args: tuple, timing: str = "wall"):
    """Time every accepted impl on the real arguments (on a device, not the reference backend's);
    persist and return the winner."""
    with spending():
        return _autotune(exp, resolved, args, timing)


def _autotune(exp, resolved, args: tuple, timing: str):
    accepted = [c.impl for c in exp.candidates if c.accepted]
    if exp.spec.device_type != "cpu" and any(i.backend != "reference" for i in accepted):
        # the reference backend is the oracle (plain torch, e.g. dense masking for sparse attention):
        # never the fastest on a device that has kernels, and timing it there can take tens of GiB
        accepted = [i for i in accepted if i.backend != "reference"]
    if len(accepted) < 2 or exp.why.startswith("measured"):
        return None
    log.debug("autotune %s: timing %s", spec_key(exp.spec), ", ".join(i.id for i in accepted))
    timing = _timing_for(exp.spec, timing)
    steps: dict[str, Any] = {}
    for impl in accepted:
        run = impl.backward if exp.spec.backward else \
            (impl.inference or impl.fn) if exp.spec.inference else impl.fn     # what the call will run
        try:
            if exp.spec.train:      # a grad-recording call: time forward + backward, as the caller pays
                step = train_step(exp.spec.op, impl, resolved.ctx, args)
            else:
                step = (lambda run=run: run(resolved.ctx, *args))
            step()                  # compile / plan / config-tune every candidate before any is timed
            steps[impl.id] = step
        except Exception as e:  # an impl that fails on the real data is not a candidate
            _warn_failed(impl.id, e)
    times = time_rounds(steps, exp.spec.device_type, timing)
    times.update({i.id: float("inf") for i in accepted if i.id not in times})
    winner = min(times, key=times.get)
    measured = Measured(winner, {k: v for k, v in times.items() if v != float("inf")}, timing,
                        tuple(tuple(x) for x in exp.spec.shapes))
    store(exp.spec, resolved.ctx.env, measured)
    log.debug("autotune %s: %s wins (%s ms; stored in %s)", spec_key(exp.spec), winner, ", ".join(
        f"{k} {v:.4g}" for k, v in sorted(measured.times_ms.items(), key=lambda kv: kv[1])), _TUNING.path())
    impl = next(i for i in accepted if i.id == winner)
    return Resolved(impl, resolved.ctx, impl.backward if exp.spec.backward else impl.fn,
                    why="autotune: " + measured.describe())


def per_call_ms(fn, calls: int, cuda: bool, device_type: str | None = None) -> list[float]:
    """ms of each of `calls` calls of fn, timed on its own (device events after a sync, else perf_counter).
    device_type picks the device's timer (timer_for); without it `cuda` says cuda or cpu."""
    timer = timer_for(device_type or ("cuda" if cuda else "cpu"))
    times = []
    for _ in range(max(1, calls)):
        if timer.event is not None:
            timer.sync()
            a, b = timer.event(), timer.event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times
