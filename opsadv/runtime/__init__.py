"""The memory-aware runtime: memory policy levels and batch chunking within a memory budget.

    import opsadv
    opsadv.runtime.apply_memory_policy("balanced")            # or 0-3 (mem_opt)
    out = opsadv.runtime.run_batched(model, inputs, memory_budget="2GiB", max_streams=1)

Loaded lazily (`opsadv.runtime` on first attribute access); nothing here runs at import opsadv."""
from .batched import MAX_STREAMS, default_budget, run_batched
from .memory import (LEVEL_NAMES, MemoryPolicy, apply_memory_policy, current_memory_policy, parse_bytes,
                     parse_level)

__all__ = ["run_batched", "apply_memory_policy", "current_memory_policy", "MemoryPolicy", "parse_bytes",
           "parse_level", "default_budget", "LEVEL_NAMES", "MAX_STREAMS"]
