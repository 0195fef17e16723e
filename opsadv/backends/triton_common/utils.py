"""Helpers shared by the Triton kernel modules (and the cuda backend's Gluon hosts): masked tile loads/stores and a
small per-shape-bucket config autotuner (GPU only; the interpreter always takes the profile's
first config)."""
from __future__ import annotations

import contextvars
import inspect
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
from triton import knobs

from opsadv.core.op_common import empty_bshd
from opsadv.core.cachefile import JsonCache
from opsadv.core.env import current_env
from opsadv.core.envvars import env_bool
from opsadv.core.errors import EnvVarError
from opsadv.core.tuning import _device_key, kernel_config_entry
from opsadv.core.tuning import is_deferred, spending, time_rounds

log = logging.getLogger("opsadv.cuda.autotune")


# ---- launch fast path -------------------------------------------------------------------------------
def _arg_key(a):
    """What Triton specializes a runtime argument on, as a hashable key part: a tensor's dtype and
    16-byte alignment; an int's value == 1, divisibility by 16 and 32- vs 64-bit type; the type of
    anything else.  None: an argument kind the fast path does not handle."""
    if isinstance(a, torch.Tensor):
        return a.dtype, (a.data_ptr() & 15) == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return int, a == 1, (a & 15) == 0, -0x80000000 <= a <= 0x7FFFFFFF
    if isinstance(a, float):
        return float
    if a is None:
        return type(None)
    return None


_Tensor = torch.Tensor


def _on_gpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda


def _current_device() -> int:
    return torch._C._cuda_getDevice()         # what Triton's launch path keys and launches on


def _raw_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


class FastLaunch:
    """`FastLaunch(kernel)[grid](*args, **constexprs_and_options)` launches like `kernel[grid](...)`
    but, once a signature has compiled, skips JITFunction.run's per-call Python (binding into a dict,
    knob and hook lookups, launch metadata): measured 25.6 µs per launch of the norm kernel on the
    H200 host vs 14 µs for a 3-argument kernel, paid by every norm in a
    decode step.  The first launch of a key goes through Triton itself (compile, cache); the key holds
    the device, every keyword (constexprs, num_warps, ...) and what Triton specializes each positional
    argument on (`_arg_key`), so a kernel compiled under other assumptions (alignment, int width,
    value 1) is never reused.  Launch hooks (profilers), CPU tensors (the interpreter) and argument
    kinds the key does not cover take Triton's own path."""

    def __init__(self, fn):
        self.fn = fn
        self.names = list(fn.arg_names)
        params = getattr(fn, "params", None) or []
        self.defaults = {p.name: p.default for p in params
                         if getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty}
        self.constexprs = {p.name for p in params if getattr(p, "is_constexpr", False)}
        self._cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid, args: tuple, kw: dict, kw_items: tuple | None = None):
        """kw_items: tuple(kw.items()), where the caller keeps it (it is part of the key)."""
        first = args[0]
        if not _on_gpu(first) or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls:
            return self.fn[grid](*args, **kw)
        # _arg_key of each argument, its two common kinds inline (a call per argument cost ~1.5 us of ~4 for the
        # norm kernel's 16 arguments); anything else (bool, float, None, a subclass) goes through _arg_key
        parts = tuple([(a.dtype, (a.data_ptr() & 15) == 0) if (t := type(a)) is _Tensor
                       else (int, a == 1, (a & 15) == 0, -0x80000000 <= a <= 0x7FFFFFFF) if t is int
                       else _arg_key(a) for a in args])
        dev = _current_device()
        key = (dev, tuple(kw.items()) if kw_items is None else kw_items, parts)
        hit = self._cache.get(key)
        if hit is None:
            kernel = self.fn[grid](*args, **kw)          # Triton's path: compiles or finds the kernel
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            rest = self.names[len(args):]
            # cached only when every non-positional parameter is a constexpr (its value is in the key)
            if kernel is not None and None not in parts and all(n in self.constexprs for n in rest):
                # constexprs / defaulted params after the positional ones, in signature order
                tail = tuple(kw[n] if n in kw else self.defaults[n] for n in rest)
                self._cache[key] = (kernel.run, kernel.function, kernel.packed_metadata, tail)
            return kernel
        run, function, packed, tail = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, _raw_stream(dev), function, packed, None, None, None, *args, *tail)
        return None


@triton.jit
def load_tile(ptrs, offs_r, n_r, offs_c, n_c, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """Load a 2-D tile, masking rows >= n_r and/or columns >= n_c (zeros there)."""
    if MASK_R and MASK_C:
        x = tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c), other=0.0)
    elif MASK_R:
        x = tl.load(ptrs, mask=offs_r[:, None] < n_r, other=0.0)
    elif MASK_C:
        x = tl.load(ptrs, mask=offs_c[None, :] < n_c, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def store_tile(ptrs, x, offs_r, n_r, offs_c, n_c, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """Store a 2-D tile, skipping rows >= n_r and/or columns >= n_c."""
    if MASK_R and MASK_C:
        tl.store(ptrs, x, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c))
    elif MASK_R:
        tl.store(ptrs, x, mask=offs_r[:, None] < n_r)
    elif MASK_C:
        tl.store(ptrs, x, mask=offs_c[None, :] < n_c)
    else:
        tl.store(ptrs, x)


def bucket(n: int) -> int:
    """Next power of two (min 16): lengths in one bucket share a tuned config."""
    return 16 if n <= 16 else 1 << (n - 1).bit_length()


class ConfigTuner:
    """Picks one config per key among `configs` by timing `launch(cfg)` with do_bench, in TUNE_ROUNDS
    interleaved rounds with the order rotated (opsadv.core.tuning.time_rounds; ~0.3 s per config and key).

    `configs[0]` is the profile's default: taken without timing when autotuning is off
    (interpreter, jetson, CUDA-graph capture).  A config that fails to compile or launch is
    dropped with a log line; if all fail, the last error is raised (never a silent fallback).
    Winners persist in kernel_configs.json in the cache directory (core/cachefile.py), keyed by device and library
    versions, so a second process pays no tuning."""

    def __init__(self, name: str):
        self.name = name
        self.best: dict[tuple, dict] = {}
        self.times: dict[tuple, dict[int, float]] = {}
        self._lock = threading.Lock()

    def _disk_key(self, key: tuple) -> str:
        return f"{self.name}|{key!r}"

    def pick(self, key: tuple, configs: list[dict], launch, autotune: bool) -> dict:
        cfg = self.best.get(key)
        if cfg is not None and cfg in configs:      # the space may have been capped since (tile_size)
            return cfg
        if not autotune or len(configs) == 1 or _PRECOMPILING.get() or torch.cuda.is_current_stream_capturing():
            return configs[0]
        stored = _disk_load().get(self._disk_key(key))
        # JSON turns tuples into lists: compare in that form, return the offered config itself
        offered = next((c for c in configs if _as_json(c) == stored), None) if stored is not None else None
        if offered is not None:                              # a config the current profile still offers
            log.debug("%s %s: config cache hit -> %s", self.name, key, offered)
            with self._lock:
                self.best[key] = offered
            return offered
        if is_deferred():               # (tuning.deferred: the default now, not kept: a later call tunes the key)
            return configs[0]
        log.debug("%s %s: config cache miss (%s): timing %d configs", self.name, key,
                  "stored config no longer offered" if stored is not None else "nothing stored", len(configs))
        with spending():
            return self._tune(key, configs, launch)

    def _tune(self, key: tuple, configs: list[dict], launch) -> dict:
        err: Exception | None = None
        ok = []
        precompile(configs, launch)
        for i, c in enumerate(configs):     # compile (and launch once) every config before timing any: a
            try:                            # compile pause in between would leave the next one on idle clocks
                launch(c)
                ok.append(i)
            except Exception as e:  # e.g. out of shared memory for this tile shape
                err = e
                log.info("%s: config %s failed: %s", self.name, c, str(e).splitlines()[0] if str(e) else e)
        # interleaved rounds, the order rotated (as the impl-level autotune does): timed once each, in order,
        # the first config after the compiles runs on ramping clocks, and one short sample per config is at the
        # mercy of the H200's run-to-run swing (GEMM times moved 5-15% between rounds); a config
        # that fails here times inf
        times = {i: t for i, t in time_rounds({i: (lambda c=configs[i]: launch(c)) for i in ok}, "cuda",
                                               "wall").items() if t != float("inf")}
        if not times:
            raise err or RuntimeError(f"{self.name}: every config failed")
        best = configs[min(times, key=times.get)]
        with self._lock:
            self.best[key] = best
            self.times[key] = times
        _disk_store(self._disk_key(key), best)
        log.info("%s %s -> %s", self.name, key, best)
        return best


_PRECOMPILING: contextvars.ContextVar[bool] = contextvars.ContextVar("opsadv_precompiling", default=False)


def compile_threads() -> int:
    """Threads that compile a tuner's configs side by side: OPSADV_COMPILE_THREADS, else one per CPU core up to 16
    (0 or 1: one after another)."""
    v = os.environ.get("OPSADV_COMPILE_THREADS", "").strip()
    if v:
        try:
            n = int(v)
        except ValueError:
            raise EnvVarError("OPSADV_COMPILE_THREADS", v, "a whole number of threads (0 or 1: no threads)") from None
        return max(n, 1)
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def precompile(configs: list[dict], launch) -> int:
    """Launch every config once on worker threads, so their kernels compile side by side: Triton's compile
    spends most of its time outside the GIL (MLIR passes, LLVM, ptxas), and a tuner's configs (8-16 variants of one
    GEMM or attention kernel) otherwise compile one after another, most of a cold conversion's tuning time.
    Workers launch on the caller's device and stream with its grad / inference mode; a tuner reached from a worker
    (a variant that runs a whole backward) takes its default config instead of tuning inside the thread (timing
    there would overlap).  Errors are left to the caller's own launch, which follows and decides; returns the
    number of configs launched on threads (0: one thread, a CPU tensor world, or under CUDA-graph capture)."""
    n = min(compile_threads(), len(configs))
    if n < 2 or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return 0
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def one(cfg):
        torch.cuda.set_device(device)
        with torch.cuda.stream(stream), torch.inference_mode(inference), torch.set_grad_enabled(grad):
            try:
                launch(cfg)
            except Exception as e:      # (the caller's own launch of this config reports it)
                log.debug("precompile %s: %s", cfg, str(e).splitlines()[0] if str(e) else type(e).__name__)

    token = _PRECOMPILING.set(True)
    try:        # each worker runs in a copy of the caller's context (tuning.deferred and the flag above)
        ctxs = [contextvars.copy_context() for _ in configs]
    finally:
        _PRECOMPILING.reset(token)
    with ThreadPoolExecutor(n, thread_name_prefix="opsadv-compile") as ex:
        list(ex.map(lambda c, cfg: c.run(one, cfg), ctxs, configs))
    stream.synchronize()
    return len(configs)


def _as_json(cfg):
    """cfg as it reads back from kernel_configs.json (tuples become lists)."""
    return json.loads(json.dumps(cfg))


def _configs():
    """The stored config winners (kernel_configs.json in the cache dir, read once per process)."""
    global _CONFIGS
    if _CONFIGS is None:
        _CONFIGS = JsonCache("kernel_configs.json", kernel_config_entry)
    return _CONFIGS


_CONFIGS = None


def _device_section() -> str:
    return _device_key(current_env())


def _disk_load() -> dict:
    """This device's stored winners."""
    return _configs().section(_device_section())


def _disk_store(key: str, cfg: dict) -> None:
    _configs().put(_device_section(), key, cfg)


def poison_enabled() -> bool:
    """OPSADV_POISON_OUTPUTS=1 (tests): output buffers start as NaN so an unwritten element shows."""
    return env_bool("OPSADV_POISON_OUTPUTS")


def new_output(shape, dtype, device) -> torch.Tensor:
    if poison_enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_output_bshd(shape, dtype, device) -> torch.Tensor:
    """A (b, h, s, d) output over contiguous (b, s, h, d) memory: the layout the attention ops promise
    at the torch.library boundary and transformers transposes back to for free; NaN-filled under
    OPSADV_POISON_OUTPUTS=1."""
    out = empty_bshd(shape, dtype, device)
    return out.fill_(float("nan")) if poison_enabled() else out
