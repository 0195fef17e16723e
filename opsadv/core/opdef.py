"""OpDef: everything opsadv knows about one op, registered in one place.

An op folder (opsadv/ops/<op>/, or a third-party plugin's `opsadv_register_ops` hook) builds an `OpDef` and calls
`register_op`.  Everything that lists ops reads the registry instead of a list of its own: `OPS` (the names),
`opsadv.explain` (the spec builder), the registry's unknown-op check, the reference backend (the reference impls),
the conformance catalogue (the cases and tolerances) and `opsadv demo` (the demo inputs).  Core knows no op by name.

The op's torch.library custom ops, fakes and autograd stay where the op defines them; `custom_ops` names them."""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from .kernel import PRIORITY_REFERENCE, CallSpec, KernelImpl

# The conformance rule (after FlashAttention-3's test suite): against the float64 oracle, an impl's error may be at
# most BASELINE_FACTOR x the error of the reference backend run on the same low-precision inputs (plain torch,
# float32 accumulation, outputs stored in the input dtype), plus a floor relative to the oracle's norm:
#     ||impl - oracle|| <= k * ||baseline - oracle|| + floor * ||oracle||      (forward outputs, then gradients)
# The floors stay below 1% so a 1% error fails in every dtype; the "tf32" row holds float32 cells computed in tf32
# under a precision policy (precision="tf32"), float32's own row true float32 kernels.
BASELINE_FACTOR = (3.0, 3.0)            # (forward, backward)
TOLERANCE: Mapping[torch.dtype | str, tuple[float, float]] = {   # floor (forward, backward), relative to ||oracle||
    torch.float64: (1e-9, 1e-8),
    torch.float32: (1e-5, 2e-5),
    "tf32": (2e-3, 3e-3),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (2e-3, 3e-3),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# what the reference impl of every op declares: plain torch on any device, every float dtype, deterministic
REFERENCE_BACKEND = "reference"
REFERENCE_DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu", "mps", "privateuseone")
REFERENCE_DTYPES = DTYPES

# what explain() hands an op's spec builder: (args, kwargs, backward) -> CallSpec, or (CallSpec, note) where the
# call runs differently from what its arguments say (a grad-recording GEMM that runs its epilogue as torch ops)
SpecBuilder = Callable[[tuple, dict, bool], "CallSpec | tuple[CallSpec, str]"]
# demo inputs: (device, dtype, generator, big) -> (args, kwargs); big: GPU-sized shapes
DemoInputs = Callable[[str, torch.dtype, torch.Generator, bool], tuple[tuple, dict]]


@dataclass(frozen=True)
class Case:
    """One conformance case: fresh random inputs from a seed, the public op called on them, and the inputs that
    receive gradients.  The conformance runner compares every impl with the reference backend in float64."""

    op: str
    shape_class: str
    build: Callable[[torch.dtype, str, torch.Generator], tuple[tuple, dict]]   # -> (args, kwargs)
    grad_args: tuple[int, ...]                    # positional args that get gradients
    quick: bool = True                            # part of --quick
    multi_output: bool = False                    # op returns (y, sum) (norms with residual)
    tags: frozenset[str] = field(default_factory=frozenset)
    # positional indices and keyword names every call gets as built, never cast to the compared dtypes: data
    # in a storage format and its scales (an fp8 cache and its float32 scales are the format, not a precision)
    kept: frozenset = field(default_factory=frozenset)
    # positional indices of the arguments the op writes in place (attention_merge_'s accumulators): every call of
    # the case gets fresh copies of them, same strides and storage offset, so each run starts from the built values
    mutates: tuple[int, ...] = ()
    # outputs that are logarithms (a log-sum-exp): their error is absolute (exp carries it as a relative one), so
    # it counts against an RMS of at least 1, not against a value that may sit near 0
    log_outputs: frozenset[int] = field(default_factory=frozenset)

    @property
    def name(self) -> str:
        return f"{self.op}/{self.shape_class}"


@dataclass(frozen=True)
class Reference:
    """The op's plain-torch oracle: fn(ctx, *op args) and backward(ctx, *backward args) as the op's impl contract
    says, and the call features it serves (an impl is refused for a feature it does not list)."""

    fn: Callable[..., Any]
    backward: Callable[..., Any] | None
    features: frozenset[str] = frozenset()


@dataclass(frozen=True)
class OpDef:
    """One op: its name, the public function, the torch.library ops it defines, the reference impl, the spec builder
    `opsadv.explain` uses, demo inputs, conformance cases and tolerances."""

    name: str
    fn: Callable[..., Any]                        # the public function (opsadv.ops.<name>)
    reference: Reference
    spec: SpecBuilder                             # the CallSpec a call dispatches with (explain)
    custom_ops: tuple[Any, ...] = ()              # its torch.library ops (torch.ops.<ns>.<name>...)
    cases: tuple[Case, ...] = ()                  # the conformance catalogue's cases for this op
    demo: DemoInputs | None = None                # inputs for `opsadv demo` (None: not in the demo)
    # the conformance floors per dtype (and "tf32"); see TOLERANCE and BASELINE_FACTOR
    tolerance: Mapping[torch.dtype | str, tuple[float, float]] = field(default_factory=lambda: TOLERANCE)
    # the PrecisionPolicy field that governs the op's products ("attention", "matmul"), None for ops without dot
    # products: float32 cells computed in a lower precision are held to that precision's floors, with a baseline run
    # on the inputs rounded to it
    precision: str | None = None
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"OpDef name must be an identifier, got {self.name!r}")
        if not callable(self.fn):
            raise TypeError(f"OpDef {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if not isinstance(self.reference, Reference):
            raise TypeError(f"OpDef {self.name!r}: reference must be a Reference, got {type(self.reference).__name__}")
        if not callable(self.spec):
            raise TypeError(f"OpDef {self.name!r}: spec must be callable, got {type(self.spec).__name__}")
        bad = [c for c in self.cases if not isinstance(c, Case) or c.op != self.name]
        if bad:
            raise ValueError(f"OpDef {self.name!r}: cases must be Cases of op {self.name!r}, got {bad[0]!r}")
        if self.precision not in (None, "attention", "matmul"):
            raise ValueError(f"OpDef {self.name!r}: precision must be None, 'attention' or 'matmul', "
                             f"got {self.precision!r}")

    def reference_impl(self) -> KernelImpl:
        """The reference backend's KernelImpl of this op (reference.<name>)."""
        r = self.reference
        return KernelImpl(id=f"{REFERENCE_BACKEND}.{self.name}", op=self.name, backend=REFERENCE_BACKEND,
                          fn=without_autocast(r.fn), backward=without_autocast(r.backward),
                          priority=PRIORITY_REFERENCE, device_types=REFERENCE_DEVICE_TYPES,
                          dtypes=REFERENCE_DTYPES, features=r.features, deterministic=True,
                          honours=frozenset({"matmul", "attention", "norm", "softmax"}),
                          description="plain torch (float32 accumulation; float64 stays float64)")


def without_autocast(fn):
    """fn(ctx, *args) run with the ambient torch.autocast off on its inputs' device: an op computes as it states
    (float32 accumulation, outputs in its own dtypes) whatever autocast region calls it; autocast would otherwise
    recast the reference's float32 arithmetic to bf16 inside it (a bf16 loss from linear_cross_entropy)."""
    if fn is None:
        return None

    @functools.wraps(fn)
    def run(ctx, *args, **kwargs):
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
        if dev is None or not torch.is_autocast_enabled(dev):
            return fn(ctx, *args, **kwargs)
        with torch.autocast(dev, enabled=False):
            return fn(ctx, *args, **kwargs)
    return run


def arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """A spec builder's argument: positional i, else keyword `name`, else default."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def rand(shape, dtype: torch.dtype, device, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """A case's random tensor: drawn in float64 on the CPU from g (the same values on every device and dtype)."""
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


# ---- the registry ---------------------------------------------------------------------------------------------
_lock = threading.Lock()
_defs: dict[str, OpDef] = {}
_sources: dict[str, str] = {}


def register_op(d: OpDef, source: str = "") -> bool:
    """Add op `d` (True), or nothing when this definition (the same public function) is registered already (False:
    a registry rebuild asks plugins again).  Another definition under a taken name raises ValueError naming both sources."""
    if not isinstance(d, OpDef):
        raise TypeError(f"register_op expects an OpDef, got {type(d).__name__}")
    with _lock:
        old = _defs.get(d.name)
        if old is not None:
            if old == d or old.fn is d.fn:
                return False
            raise ValueError(f"op {d.name!r} is already defined by {_sources[d.name]}; "
                             f"{source or 'this definition'} cannot define it again")
        _defs[d.name] = d
        _sources[d.name] = source or getattr(d.fn, "__module__", "?")
        return True


def op_defs() -> tuple[OpDef, ...]:
    """Every registered op, in registration order (built-in ops first)."""
    return tuple(_defs.values())


def get_op(name: str) -> OpDef | None:
    return _defs.get(name)


def op_source(name: str) -> str:
    """Who defined the op (its module, or the plugin that registered it)."""
    return _sources.get(name, "")


class _OpNames(Sequence):
    """The registered op names, read at each use (a plugin's op counts once discovery registered it)."""

    def __getitem__(self, i):
        return tuple(_defs)[i]

    def __len__(self) -> int:
        return len(_defs)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_defs))

    def __contains__(self, name) -> bool:
        return name in _defs

    def __repr__(self) -> str:
        return repr(tuple(_defs))


OPS: Sequence[str] = _OpNames()
