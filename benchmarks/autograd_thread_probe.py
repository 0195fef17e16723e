"""Why the Python of a backward runs slower on autograd's CUDA device thread (GPU host probe).

Session 3 measured a LayerNorm fwd+bwd at 523 us of host time with autograd multithreading on and
230 us with it off (eager: 174 / 110), and a backward whose kernels were stubbed out at 410 / 241 us.
This probe separates the hypotheses, in one process:

  A. the backward body is slow because the thread is not running (blocked / descheduled): its thread
     CPU time (time.thread_time_ns) is far below its wall time;
  B. the thread runs, but slowly (cold caches on another core, a slow-clocked core): CPU ~= wall, and a
     fixed pure-Python loop and a torch.empty inside the backward take longer there than on the main
     thread (multithreading off runs the same backward on the caller's thread);
  C. cross-core placement: pinning the caller and the device thread to one core (or to two fixed cores)
     changes the fwd+bwd host time.
Also records the CPU model, idle driver and the thread's CPU placement (from /proc).

  PYTHONPATH=. python3 benchmarks/autograd_thread_probe.py OUT.txt
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from host_cost import host_us  # noqa: E402

import opsadv  # noqa: E402
from opsadv.backends.cuda import norm as N  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "autograd_thread_probe.txt"
LINES: list[str] = []


def say(s: str) -> None:
    LINES.append(s)
    print(s, flush=True)


def cpu_of_thread() -> int:
    """The CPU the calling thread last ran on (field 39 of /proc/self/task/TID/stat)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def py_loop() -> int:
    s = 0
    for i in range(300):                    # fixed pure-Python work (~10 us on a desktop core)
        s += i * i
    return s


SAMPLES: dict[str, list] = {}
PIN: dict = {"cpus": None}


def instrumented_backward(real):
    def wrapper(*a, **k):
        name = "main" if threading.current_thread() is threading.main_thread() else "worker"
        if PIN["cpus"] is not None and name == "worker":
            os.sched_setaffinity(0, PIN["cpus"])       # pins this (device) thread only
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        py_loop()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        e = torch.empty(16, device="cuda")
        w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        out = real(*a, **k)
        w3, c3 = time.perf_counter_ns(), time.thread_time_ns()
        del e
        SAMPLES.setdefault(name, []).append((w1 - w0, c1 - c0, w2 - w1, c2 - c1, w3 - w2, c3 - c2, cpu_of_thread()))
        return out
    return wrapper


def summary(tag: str) -> None:
    for name, rows in sorted(SAMPLES.items()):
        rows = rows[5:] or rows                                     # skip warm-up
        med = [statistics.median(c) / 1e3 for c in list(zip(*rows))[:6]]
        cpus = sorted({r[6] for r in rows})
        say(f"  {tag:28s} {name:6s} n={len(rows):3d}  py loop wall {med[0]:6.1f} cpu {med[1]:6.1f} | "
            f"torch.empty wall {med[2]:6.1f} cpu {med[3]:6.1f} | _backward wall {med[4]:6.1f} cpu {med[5]:6.1f} us"
            f"  cpus {cpus[:6]}")
    SAMPLES.clear()


def main() -> None:
    say(f"cpu: {read('/proc/cpuinfo').split('model name')[1].split(chr(10))[0].strip(': ') if 'model name' in read('/proc/cpuinfo') else '?'}")
    say(f"nproc {os.cpu_count()}, affinity {sorted(os.sched_getaffinity(0))[:16]}, idle driver "
        f"{read('/sys/devices/system/cpu/cpuidle/current_driver')}, governor "
        f"{read('/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor')}, switchinterval {sys.getswitchinterval()}")
    say(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    N._backward = instrumented_backward(N._backward)
    t, h = 4096, 4096
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    b = torch.randn(h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    gy = torch.randn_like(x)
    xs = torch.randn(65536, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ws = torch.randn(1024, device="cuda", dtype=torch.bfloat16).requires_grad_()
    gys = torch.randn_like(xs)
    cases = {
        "LN 4096x4096": lambda: torch.autograd.grad(opsadv.ops.layer_norm(x, w, b, 1e-5), (x, w, b), gy),
        "RMS 65536x1024": lambda: torch.autograd.grad(opsadv.ops.rms_norm(xs, ws, 1e-6), (xs, ws), gys),
    }
    main_cpu = cpu_of_thread()
    all_cpus = sorted(os.sched_getaffinity(0))
    other = next((c for c in all_cpus if c != main_cpu), main_cpu)
    with opsadv.use_backend("cuda"):
        for name, fn in cases.items():
            for mt in (True, False):
                with torch.autograd.set_multithreading_enabled(mt):
                    us = host_us(fn)
                say(f"{name:16s} fwd+bwd host {us:7.1f} us  multithreading={'on' if mt else 'off'}")
                summary(f"{name} mt={'on' if mt else 'off'}")
        fn = cases["LN 4096x4096"]
        for label, main_set, worker_set in (("pinned same core", {main_cpu}, {main_cpu}),
                                            ("pinned two cores", {main_cpu}, {other}),
                                            ("unpinned again", set(all_cpus), set(all_cpus))):
            os.sched_setaffinity(0, main_set)
            PIN["cpus"] = worker_set
            us = host_us(fn)
            say(f"LN 4096x4096     fwd+bwd host {us:7.1f} us  {label} (main {sorted(main_set)[:4]}, worker "
                f"{sorted(worker_set)[:4]})")
            summary(label)
    with open(OUT, "w") as f:
        f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
