"""The contract between bench suites and the runner.

A suite module `opsadv/bench/suite_<name>.py` exposes `cases(quick: bool) -> Iterable[BenchCase]`.
The runner warms up, verifies opsadv's output against the best peer's (rel_err), times each
callable with triton.testing.do_bench (median), and writes the JSON schema of benchmarks/README.md."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class BenchCase:
    suite: str                                  # "attention", "sparse", "gemm", "norm", "e2e"
    case: str                                   # "fwd bf16 b4 h32 s4096 d128 causal"
    opsadv: Callable[[], Any]                   # runs opsadv's op (through the dispatcher)
    peers: dict[str, Callable[[], Any]]         # peer key (benchmarks/README.md) -> callable
    work: float                                 # FLOPs or bytes of one call
    unit: str = "TFLOP/s"                       # or "TB/s"
    impl: Callable[[], str] | None = None       # which impl the dispatcher chose (after a call)
    compare: Callable[[Any, Any], float] | None = None   # rel err of (opsadv_out, peer_out); default: norm ratio
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. peak_act_mib, launches_per_layer
    setup: Callable[[], None] | None = None     # called once before timing (e.g. autotune)
    rounds: int | None = None                   # interleaved timing rounds (None: the runner's ROUNDS);
                                                # more for host-bound cases whose time moves between rounds
    baseline: str | None = None                 # peer key the speedup is against (None: the fastest peer);
                                                # the row also gets `ratios`: every peer's paired ratio
    calls: int | None = None                    # calls per contender and round, each timed on its own (CUDA
                                                # events, the median taken), instead of a do_bench window: for
                                                # calls of 0.1 s and more (generate, a model's training step)


RECOMPILE_LIMIT = 256


def peak_mib(fn) -> float | None:
    """MiB that one call of fn allocates beyond what was allocated before it (torch.cuda.max_memory_allocated);
    None off CUDA.  Call fn once before (compilation and autotuning stay out of the peak)."""
    import torch
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return round(peak / 2 ** 20, 1)


def allow_recompiles() -> None:
    """Lift dynamo's recompile limit (8 per code object) for the compiled peers: every case (shape, grad mode)
    is one more compile of the same function, and past the limit dynamo runs it eagerly, silently (the norm
    suite's torch_compile peer read the eager time in its last 14 rows, 0.2041 vs 0.2040 ms)."""
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))


def compiled_peer(fn):
    """torch.compile(fn, dynamic=False) as a bench peer, with the recompile limit lifted (allow_recompiles) and
    no donated buffers (the backward-only rows call autograd.grad(retain_graph=True), which a compiled backward
    with donated buffers refuses; donation only saves memory)."""
    import torch
    import torch._functorch.config as functorch_config
    allow_recompiles()
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(fn, dynamic=False)


@functools.lru_cache(maxsize=1)
def flex_peer():
    """(compiled flex_attention, create_block_mask), or (None, None) where FlexAttention is missing.
    Compiled once per process and shared by the suites that use it as a peer."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None, None
    import torch._functorch.config as functorch_config

    # past dynamo's recompile limit flex runs unfused, 200x slower (seen in the sparse window series)
    allow_recompiles()
    # the backward-only rows call autograd.grad(retain_graph=True), which a compiled backward with donated
    # buffers refuses; donation only saves memory
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(flex_attention), create_block_mask
