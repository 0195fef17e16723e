"""Memory policy: how hard opsadv squeezes the CUDA caching allocator, per level.

Levels (the seed parameter `mem_opt`, or the profile's `memory_policy` name):

| level | name           | allocator fraction | garbage collection threshold | empty cache between chunks |
|-------|----------------|--------------------|------------------------------|----------------------------|
| 0     | "off"          | 1.0 (restored)     | untouched                    | no                         |
| 1     | "conservative" | 0.95               | untouched                    | no                         |
| 2     | "balanced"     | 0.90               | 0.8                          | no                         |
| 3     | "aggressive"   | 0.85               | 0.6                          | yes                        |

The fraction caps `torch.cuda.set_per_process_memory_fraction` (a memory budget lowers it
further).  On a Jetson the GPU allocator eats the memory the CPU side needs too, so the cap also
respects /proc/meminfo MemAvailable, and `expandable_segments` is never enabled there (allocations
fail with it on Tegra); elsewhere level 3 turns it on to fight fragmentation."""
from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field

from ..core.env import _mem_available, current_env
from ..core.errors import InvalidArgumentError

LEVEL_NAMES = ("off", "conservative", "balanced", "aggressive")
_FRACTION = (1.0, 0.95, 0.90, 0.85)
_GC_THRESHOLD = (None, None, 0.8, 0.6)

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "g": 1024 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3, "t": 1024 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*|%)\s*$")


def parse_bytes(value, *, op: str = "runtime", arg: str = "memory_budget", available: int | None = None) -> int:
    """A byte count from an int (bytes) or a string: "3GiB", "512 MiB", "2GB" (decimal), "3G" (binary)
    or "60%" (of `available`, e.g. MemAvailable).  Must come out > 0."""
    expect = "a positive byte count: an int, or a string like '3GiB', '512MiB', '2GB' or '60%'"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgumentError(op, arg, expect, repr(value))
    if isinstance(value, int):
        n = value
    else:
        m = _BYTES_RE.match(value)
        if m is None:
            raise InvalidArgumentError(op, arg, expect, repr(value))
        num, unit = float(m.group(1)), m.group(2).lower()
        if unit == "%":
            if available is None:
                raise InvalidArgumentError(op, arg, "an absolute size: MemAvailable is unknown here, so a "
                                           "percentage has nothing to refer to", repr(value))
            if not 0 < num <= 100:
                raise InvalidArgumentError(op, arg, "a percentage in (0, 100]", repr(value))
            n = int(available * num / 100)
        elif unit in _UNITS:
            n = int(num * _UNITS[unit])
        else:
            raise InvalidArgumentError(op, arg, expect + f" (unit {m.group(2)!r} unknown)", repr(value))
    if n <= 0:
        raise InvalidArgumentError(op, arg, expect, repr(value))
    return n


def parse_level(level, *, op: str = "apply_memory_policy", arg: str = "level") -> int:
    """mem_opt 0-3 or a name: "off", "conservative", "balanced", "aggressive"."""
    if isinstance(level, str) and level.lower() in LEVEL_NAMES:
        return LEVEL_NAMES.index(level.lower())
    if isinstance(level, int) and not isinstance(level, bool) and 0 <= level <= 3:
        return level
    raise InvalidArgumentError(op, arg, f"an int 0-3 or one of {list(LEVEL_NAMES)}", repr(level))


@dataclass(frozen=True)
class MemoryPolicy:
    """What one apply_memory_policy call decided and did (`applied`) or had to skip (`skipped`)."""

    level: int
    name: str
    device: str | None
    allocator_fraction: float | None           # the cap passed to set_per_process_memory_fraction
    gc_threshold: float | None
    expandable_segments: bool
    empty_cache_between_chunks: bool
    budget_bytes: int | None
    applied: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        rows = [f"MemoryPolicy(level={self.level} {self.name!r}, device={self.device})"]
        rows += [f"  applied: {a}" for a in self.applied] + [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(rows)


_current: MemoryPolicy | None = None


def current_memory_policy() -> MemoryPolicy | None:
    """The last policy apply_memory_policy applied in this process (None: never called)."""
    return _current


def _read_mem_available() -> int | None:
    from pathlib import Path
    return _mem_available(Path("/proc/meminfo"))     # fresh read: MemAvailable changes as memory is used


def _set_allocator(setting: str, applied: list[str], skipped: list[str]) -> None:
    import torch
    fn = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if fn is None:
        skipped.append(f"allocator setting {setting}: torch {torch.__version__} cannot change it at run time")
        return
    try:
        fn(setting)
        applied.append(f"allocator setting {setting}")
    except Exception as e:  # an allocator backend that refuses it (e.g. cudaMallocAsync)
        skipped.append(f"allocator setting {setting}: {type(e).__name__}: {e}")


def apply_memory_policy(level=2, device=None, *, memory_budget=None) -> MemoryPolicy:
    """Apply memory level `level` (0-3 or a name) to CUDA `device` (default: the current one).
    `memory_budget` (bytes or "3GiB") lowers the allocator cap to budget / device memory.
    On a machine without CUDA nothing is touched; the returned policy says what was skipped."""
    global _current
    import torch

    lvl = parse_level(level)
    env = current_env()
    budget = None if memory_budget is None else parse_bytes(memory_budget, op="apply_memory_policy",
                                                           available=env.mem_available)
    applied: list[str] = []
    skipped: list[str] = []
    fraction = _FRACTION[lvl]
    gc = _GC_THRESHOLD[lvl]
    expandable = lvl == 3 and not env.is_jetson
    extra: dict = {}
    dev_name = None
    if not torch.cuda.is_available():
        skipped.append("no CUDA device: allocator settings not applied")
        fraction = None if lvl == 0 else fraction
    else:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise InvalidArgumentError("apply_memory_policy", "device", "a CUDA device (or None)", str(device))
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        dev_name = f"cuda:{idx}"
        total = torch.cuda.get_device_properties(idx).total_memory
        if budget is not None:
            fraction = min(fraction, budget / total)
            extra["budget_fraction"] = budget / total
        if env.is_jetson and lvl > 0:
            # Unified memory: what this process may still take is MemAvailable plus what its allocator holds.
            avail = _read_mem_available()
            if avail is not None:
                cap = (torch.cuda.memory_reserved(idx) + avail * _FRACTION[lvl]) / total
                extra["mem_available"] = avail
                fraction = min(fraction, cap)
        fraction = max(min(fraction, 1.0), 1e-3)
        torch.cuda.set_per_process_memory_fraction(fraction, idx)
        applied.append(f"set_per_process_memory_fraction({fraction:.3f}) on {dev_name}"
                       f" = {fraction * total / 2 ** 20:.0f} MiB of {total / 2 ** 20:.0f} MiB")
        if gc is not None:
            _set_allocator(f"garbage_collection_threshold:{gc}", applied, skipped)
        if env.is_jetson:
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
            if re.search(r"expandable_segments\s*:\s*true", conf, re.I):
                warnings.warn("opsadv: expandable_segments is enabled in PYTORCH_CUDA_ALLOC_CONF on a Jetson, "
                              "where allocations fail with it; opsadv turns it off", RuntimeWarning, stacklevel=2)
                _set_allocator("expandable_segments:False", applied, skipped)
            if lvl == 3:
                skipped.append("expandable_segments: never on a Jetson (allocations fail with it)")
        elif expandable:
            _set_allocator("expandable_segments:True", applied, skipped)
    pol = MemoryPolicy(level=lvl, name=LEVEL_NAMES[lvl], device=dev_name, allocator_fraction=fraction,
                       gc_threshold=gc, expandable_segments=expandable and any("expandable_segments:True" in a
                                                                               for a in applied),
                       empty_cache_between_chunks=lvl == 3, budget_bytes=budget, applied=tuple(applied),
                       skipped=tuple(skipped), extra=extra)
    _current = pol
    return pol


def format_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "?"
    return f"{n / 2 ** 20:.1f} MiB"
