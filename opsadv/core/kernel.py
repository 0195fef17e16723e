"""What a kernel impl declares, what a call asks for, and the context an impl runs in.

A backend plugin describes each kernel with a `KernelImpl`; the resolver compares the
impl's declaration with the `CallSpec` that the op's schema builds from the arguments and
collects a reason for every mismatch (xformers-style: the dispatcher, not the kernel, decides)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .env import EnvInfo

# Conventional priority levels; spaced so a third party can slot between them.
PRIORITY_VENDOR = 300
PRIORITY_TRITON = 200
PRIORITY_GENERIC = 100
PRIORITY_REFERENCE = 0

# Features that state a fact about a call rather than a need (sparse_attention's "dense_blocks": the
# block mask is known all True; "max_seqlen_known": a host bound on packed segment lengths).  They are
# part of the spec (hence the shape bucket and the tuning key), an impl may require them in check(),
# but an impl that does not list them is not rejected for them.
HINT_FEATURES = frozenset({"dense_blocks", "max_seqlen_known"})


@dataclass(frozen=True)
class CallSpec:
    """What one call needs, built by the op's schema.  Hashable parts form the shape bucket."""

    op: str
    device_type: str
    dtype: torch.dtype
    features: frozenset[str]          # e.g. {"causal", "gqa", "attn_mask", "cross_length", "residual"}
    bucket: tuple                     # shape bucket: calls in one bucket resolve alike
    head_dim: int | None = None
    shapes: tuple = ()                # exact shapes, for impls' dynamic checks
    backward: bool = False
    train: bool = False               # an eager forward that records gradients (see KernelImpl.train)
    inference: bool = False           # an eager no-grad forward whose statistics nobody reads: autotune times
                                      # KernelImpl.inference (ops that give such calls a bucket of their own)
    # what each bucket entry is, with its relation ("s_q<=" for a power-of-two bound, "K=" for an exact
    # value): explain() and the dispatch log print `s_q<=512` instead of a bare number; not part of equality
    bucket_names: tuple[str, ...] = field(default=(), compare=False)
    device_index: int | None = None   # the GPU it resolves for, on a node of mixed GPUs only (devices.device_index)

    def bucket_text(self) -> str:
        if len(self.bucket_names) != len(self.bucket):
            return str(self.bucket)
        return "(" + ", ".join(f"{n}{v}" for n, v in zip(self.bucket_names, self.bucket)) + ")"


@dataclass(frozen=True)
class MemoryTraits:
    """Transient device memory an impl needs beyond its inputs and outputs, declared so that backends which
    bound workspace (jetson's chunking) read a fact instead of guessing from impl ids.

    kind: "flash" (attention that never holds a score matrix: O(s) extra), "materializes_scores" (attention
    holding bytes_per_score per query row x key per head: O(s_q x s_k)), "fused" (no temporaries, e.g. a GEMM
    with its epilogue in registers), "temporaries" (GEMM family: temp_factor x rows x N x 4 bytes of float32
    temporaries in the forward).  expands_kv: GQA copies K and V to every query head."""

    kind: str
    bytes_per_score: float = 0.0
    temp_factor: float = 0.0
    expands_kv: bool = False


MEMORY_FLASH = MemoryTraits("flash")
MEMORY_FUSED = MemoryTraits("fused")


def materializes_scores(bytes_per_score: float = 8.0, *, expands_kv: bool = False) -> MemoryTraits:
    return MemoryTraits("materializes_scores", bytes_per_score=bytes_per_score, expands_kv=expands_kv)


def temporaries(factor: float) -> MemoryTraits:
    return MemoryTraits("temporaries", temp_factor=factor)


# Which vendor a compute-capability range or an arch list speaks of (KernelImpl.cc_runtime).
CAPABILITY_VENDORS = {"cuda": "NVIDIA", "hip": "AMD", "xpu": "Intel", "npu": "Huawei"}


@dataclass(frozen=True)
class Profile:
    """Tuning data for a backend on a class of hardware.  Profiles are data, not code."""

    name: str
    backend: str
    description: str = ""
    tiles: Mapping[str, Any] = field(default_factory=dict)          # per-op tile choices
    num_stages: int = 2
    num_warps: int = 4
    autotune: bool = True                                           # run autotune sweeps at all
    autotune_space: Mapping[str, Any] = field(default_factory=dict)
    workspace_cap_bytes: int | None = None
    memory_policy: str = "balanced"                                  # conservative|balanced|aggressive
    priority: int = 0                                                # among matching profiles
    matches: Callable[[EnvInfo], bool] | None = None                 # which hardware it is for
    extra: Mapping[str, Any] = field(default_factory=dict)


def cap_tiles(configs, tile_size: int):
    """The seed's `tile_size`: keep the tile configs whose BLOCK_M and BLOCK_N are both <= tile_size;
    when none is, the first one with its blocks clipped to tile_size.  Works on a list of dicts
    (profile tiles) or of tuples whose first two entries are (BLOCK_M, BLOCK_N)."""
    def dims(c):
        return (c["BLOCK_M"], c["BLOCK_N"]) if isinstance(c, Mapping) else (c[0], c[1])

    kept = [c for c in configs if max(dims(c)) <= tile_size]
    if kept or not configs:
        return kept
    c = configs[0]
    if isinstance(c, Mapping):
        return [{**c, "BLOCK_M": min(c["BLOCK_M"], tile_size), "BLOCK_N": min(c["BLOCK_N"], tile_size)}]
    return [(min(c[0], tile_size), min(c[1], tile_size), *c[2:])]


def _cap_tree(node, tile_size: int):
    if isinstance(node, Mapping):
        return {k: _cap_tree(v, tile_size) for k, v in node.items()}
    if isinstance(node, (list, tuple)) and node and all(isinstance(c, Mapping) and "BLOCK_M" in c for c in node):
        return cap_tiles(node, tile_size)
    return node


def profile_with_tile_cap(profile: Profile, tile_size: int) -> Profile:
    """A copy of `profile` whose tile lists (every op, pass and class) are capped by `cap_tiles`;
    `extra["tile_size"]` tells kernels that keep config tables of their own (GEMM)."""
    from dataclasses import replace
    return replace(profile, name=f"{profile.name}[tile<={tile_size}]", tiles=_cap_tree(profile.tiles, tile_size),
                   extra={**profile.extra, "tile_size": tile_size})


@dataclass(frozen=True)
class ResolveContext:
    """Handed to every impl call as the first argument: the environment, the backend's active
    profile and the policy options.  Built once per resolution, never per call."""

    env: EnvInfo
    profile: Profile | None
    options: Mapping[str, Any]
    spec: CallSpec


@dataclass(frozen=True)
class KernelImpl:
    """One kernel for one op.  `fn(ctx, *op_args)` returns what the op returns; `backward`
    (optional) takes `(ctx, *backward_args)` as the op's backward schema lists them."""

    id: str                                   # unique, dotted: "cuda.triton.flash_attention"
    op: str
    backend: str
    fn: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    priority: int = PRIORITY_GENERIC
    device_types: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    head_dims: tuple[int, ...] | None = None  # exact supported head dims (None: any)
    max_head_dim: int | None = None
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    features: frozenset[str] = frozenset()    # features the impl supports
    deterministic: bool = False
    supports_compile: bool = True
    supports_export: bool = True
    experimental: bool = False                # gated behind policy experimental=True
    requires_interpret_or_cuda: bool = False  # Triton: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
    # dynamic limits -> reasons.  The verdict is memoized per shape bucket (the op's key), so a check
    # may only depend on what the key distinguishes (dtype, features, head dim, length buckets, ...).
    check: Callable[[CallSpec, EnvInfo], list[str]] | None = None
    # optional per-call priority: (priority, why) where the impl's measured standing against the other impls
    # differs from its static `priority` (a shape range where it was timed faster), None elsewhere.  Memoized
    # per shape bucket like `check`, so it may only depend on what the key distinguishes.  A measurement of
    # this machine (autotune / the tuning cache) still decides over it.
    rank: Callable[[CallSpec, EnvInfo], tuple[int, str] | None] | None = None
    description: str = ""
    # optional forward for eager calls nothing can differentiate or trace (no grad, plain tensors):
    # fn's arguments and output tuple, but outputs only the backward reads (saved statistics) and
    # absent outputs may be None, so the impl can skip computing and allocating them.  Ops with such
    # outputs (the norms) use it when the impl has one; fn serves every other call.
    inference: Callable[..., Any] | None = None
    # optional forward for eager calls that record gradients (CallSpec.train), built from PyTorch's
    # differentiable ops: its outputs carry torch's own autograd history, so the op runs it outside
    # opsadv's autograd Function and no opsadv backward is dispatched (vendor impls whose host cost in
    # fwd+bwd beats the Function's Python backward; fn's outputs, statistics may be None).
    train: Callable[..., Any] | None = None
    # the runtime whose capabilities min_cc / max_cc / archs describe ("cuda": NVIDIA compute capability;
    # "hip": AMD gfx names): on a device of another runtime the impl is refused with that reason, so an sm_90
    # requirement never claims (or silently refuses) an AMD GPU that also reports a "cc" through torch
    cc_runtime: str = "cuda"
    archs: tuple[str, ...] | None = None      # exact arch names (env.arch: "gfx942", "sm_90"); None: any
    memory: MemoryTraits | None = None        # transient memory (None: not declared; readers assume the worst)
    # the policy requests this impl applies (core.precision.requested): "tile_size" and the PrecisionPolicy fields
    # "matmul", "attention", "norm", "softmax".  Never a reason to refuse it: explain() lists per candidate which
    # requests of the call apply and which it ignores
    honours: frozenset[str] = frozenset()

    def priority_for(self, spec: CallSpec, env: EnvInfo) -> tuple[int, str]:
        """(priority, why) for this call: rank()'s answer where it has one, else (priority, "").  A rank() that
        raises leaves the static priority and says so (a buggy rank never breaks dispatch)."""
        if self.rank is None:
            return self.priority, ""
        try:
            ranked = self.rank(spec, env)
        except Exception as e:  # noqa: BLE001 -- reported in the explanation instead
            return self.priority, f"rank() raised {type(e).__name__}: {e}; static priority kept"
        if ranked is None:
            return self.priority, ""
        prio, why = ranked
        return int(prio), str(why)

    def capability_reasons(self, env: EnvInfo) -> list[str]:
        """Why the device's capability (compute capability range, arch names) does not fit, judged only for
        the runtime the impl declared them for (cc_runtime)."""
        runtime = env.runtime
        if runtime not in (self.cc_runtime, "cpu"):      # (no device seen: the checks below say "unknown")
            want = CAPABILITY_VENDORS.get(self.cc_runtime, self.cc_runtime)
            got = CAPABILITY_VENDORS.get(runtime, runtime)
            return [f"capability requirements are for {want} ({self.cc_runtime}) devices; this device is "
                    f"{got} ({runtime}{', ' + env.arch if env.arch else ''})"]
        why: list[str] = []
        if self.min_cc or self.max_cc:
            cc = env.compute_capability
            if cc is None:
                why.append("compute capability unknown")
            elif self.min_cc and cc < self.min_cc:
                why.append(f"needs compute capability >= {self.min_cc[0]}.{self.min_cc[1]}, device has {cc[0]}.{cc[1]}")
            elif self.max_cc and cc > self.max_cc:
                why.append(f"needs compute capability <= {self.max_cc[0]}.{self.max_cc[1]}, device has {cc[0]}.{cc[1]}")
        if self.archs is not None and env.arch not in self.archs:
            why.append(f"arch {env.arch or 'unknown'} not in {list(self.archs)}")
        return why

    def rejection_reasons(self, spec: CallSpec, env: EnvInfo, *, experimental_ok: bool,
                          deterministic: bool) -> list[str]:
        """Every reason this impl cannot serve `spec` (empty: it can)."""
        why: list[str] = []
        if spec.device_type not in self.device_types:
            why.append(f"device '{spec.device_type}' not in {list(self.device_types)}")
        if spec.dtype not in self.dtypes:
            why.append(f"dtype {str(spec.dtype).replace('torch.', '')} not in "
                       f"{[str(d).replace('torch.', '') for d in self.dtypes]}")
        if spec.head_dim is not None:
            if self.head_dims is not None and spec.head_dim not in self.head_dims:
                why.append(f"head_dim {spec.head_dim} not in {list(self.head_dims)}")
            if self.max_head_dim is not None and spec.head_dim > self.max_head_dim:
                why.append(f"head_dim {spec.head_dim} > {self.max_head_dim}")
        missing = spec.features - self.features - HINT_FEATURES
        if missing:
            why.append("does not support " + ", ".join(sorted(missing)))
        if spec.backward and self.backward is None:
            why.append("has no backward")
        # checked on cuda-type devices (NVIDIA and ROCm share it), and on any device for impls of another runtime
        if (spec.device_type == "cuda" or (spec.device_type != "cpu" and self.cc_runtime != "cuda")) and \
                (self.min_cc or self.max_cc or self.archs is not None):
            why.extend(self.capability_reasons(env))
        if self.experimental and not experimental_ok:
            why.append("experimental (enable with use_backend(..., experimental=True))")
        if deterministic and not self.deterministic:
            why.append("not deterministic (policy asks for deterministic kernels)")
        if self.check is not None and not why:
            try:
                why.extend(self.check(spec, env))
            except Exception as e:  # a buggy check rejects, it does not crash dispatch
                why.append(f"check() raised {type(e).__name__}: {e}")
        return why
