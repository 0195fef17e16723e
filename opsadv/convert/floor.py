"""The conversion floor: a rewrite is kept only where the model measures at least as fast with it.

convert_model applies its rewrites in steps of one kind each (attention, norms, residual+norm, MLP
epilogues, fused QKV, packing, graph rewrites).  With the floor on, each step is timed on the floor
inputs with and without it and undone where it is slower; the report says which kind was kept as it was and by how
much ("kept the model's own norms: measured 0.93x").  Greedy and in application order, so every undo is of the
last step applied (an undo log is LIFO).

The floor times the step in balanced blocks, with / without / without / with (B A A B): a drift of the machine
over the block (clocks, other tenants of the host's CPU, the allocator's state) cancels within it, and the block's
ratio is sum(without) / sum(with).  A model whose calls are host-bound (launch-bound eager forwards) swings by up to
2x for seconds at a time on a shared host, so one sample each way decides nothing: a step whose two pairs of a block
disagree on the side of 1 gets a second block, and the step is kept only when every block ratio is >= 1: blocks on
both sides of 1 are inconclusive, and an inconclusive rewrite is not applied (the promise is "never slower"; a rewrite
that the machine's noise can hide gains too little to risk).

What is timed (`mode`): "inference" = one no-grad forward; "train" = forward + backward of the loss
(labels = input_ids for causal LMs, else the sum of the primary output); "generate" = `model.generate`
of GENERATE_TOKENS new tokens (greedy, no early stop) from the inputs, for models that decode.  Times are medians over
repeated calls after a warm-up (CUDA events on a GPU, perf_counter elsewhere), so compilation and
first-call resolution stay out of them.  `timer` replaces the clock (tests, custom timing).

`compile` ("regional" or "full", None = eager): time the model as it will run under torch.compile, so a rewrite
that helps eager but loses to Inductor's own fusion is not applied to a model that will be compiled.  "regional"
compiles each repeated block (the model's _no_split_modules classes; transformers' recommendation) in place for
the measurement and removes the compilation after it; "full" times torch.compile(model).  The first sample with a
step compiles it (the rewrite changed the modules); the block's later samples of either side reuse dynamo's cached
graphs (its guards tell the two module structures apart), so the blocks cost timing, not compilation, and a compiled
step is judged against a "without" measured beside it, not one taken minutes and several compilations before.

Decisions are kept on disk (`floor_decisions.json` in the tuning cache directory, opsadv.core.cachefile), keyed by
the machine (device name; torch, triton, transformers and opsadv versions), the model as it was handed over (class,
config, every module's type, every parameter's name, shape, dtype and requires_grad), the floor inputs (shapes,
dtypes; the values of masks and position ids, which decide the kernels), the mode, the compile mode and its
arguments, the policy in effect, the decisions taken before this step and what this step changed.  Converting the
same model on the same machine again applies the measured decisions without timing (a compiled training floor
costs minutes); the report marks them "cached" with when they were measured.  `floor_cache=False` (or
OPSADV_CONVERT_FLOOR_CACHE=0) measures again and stores the new decisions; a custom `timer` never reads or
writes the file (its numbers describe no machine)."""
from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Callable

import torch

from opsadv.core.cachefile import JsonCache, json_depth_ok
from opsadv.core.envvars import env_bool
from opsadv.core.policy import current_policy
from opsadv.core.version import __version__
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.tuning import per_call_ms, seconds_spent

from . import validate as _val
from .hf_attention import is_transformers_model

MODES = ("inference", "train", "generate")
COMPILES = (None, "regional", "full")
COMPILE_KWARGS: dict = {}              # torch.compile's arguments for the floor's measurements (tests: a CPU backend)
RECOMPILE_LIMIT = 256                  # each step recompiles the same block code: past dynamo's limit it runs eager
GENERATE_TOKENS = 32                  # new tokens per timed generate call (floor_mode="generate")
ENV = "OPSADV_CONVERT_FLOOR"          # "0" turns the floor off by default, "1" on (the default)
CACHE_ENV = "OPSADV_CONVERT_FLOOR_CACHE"   # "0": floor_cache=False by default (measure every conversion)
TARGET_S = 0.1                        # seconds of timed calls per measurement (after the warm-up)
MIN_REPS, MAX_REPS = 3, 30
MAX_BLOCKS = 2                        # B A A B blocks per step at most: two that disagree are inconclusive

Timer = Callable[[Callable[[], Any]], float]     # fn -> ms of one call
# rewrite kinds that change only some modes' calls: timed in those modes, applied untimed in the others (they
# change nothing there); their gain elsewhere is measured by the bench (lm_loss: memory and time of a training step)
TIMED_MODES = {"lm_loss": ("train",)}
UNTIMED_WHY = {"lm_loss": "it changes only training calls with labels"}


def times(kind: str, mode: str) -> bool:
    """Whether the floor times rewrite `kind` in floor mode `mode`."""
    return mode in TIMED_MODES.get(kind, MODES)


@dataclass
class Decision:
    kind: str                 # the rewrite step ("attention", "norm", ...)
    label: str                # what the step is, for people ("the model's own norms")
    ms_without: float
    ms_with: float
    kept: bool                # True: the rewrite stays
    without_samples: tuple = ()   # eager floors: every sample of each side, in the order taken
    with_samples: tuple = ()
    block_ratios: tuple = ()      # eager floors: sum(without) / sum(with) of each B A A B block
    measured_at: float | None = None   # a decision read from the cache: when it was measured (unix seconds)

    @property
    def inconclusive(self) -> bool:
        """Eager floors: the blocks fall on both sides of 1 (the step is not applied whatever their median)."""
        return len({r >= 1.0 for r in self.block_ratios}) > 1

    @property
    def ratio(self) -> float:
        """Speed with the rewrite over speed without (> 1: the rewrite is faster): the median block ratio of an
        eager floor, else ms_without / ms_with."""
        if self.block_ratios:
            return statistics.median(self.block_ratios)
        return self.ms_without / self.ms_with if self.ms_with > 0 else float("inf")

    def to_dict(self) -> dict:
        r4 = lambda xs: [round(x, 4) for x in xs]      # noqa: E731
        return {"kind": self.kind, "kept": self.kept, "ratio": round(self.ratio, 4),
                **({"inconclusive": True} if self.inconclusive else {}),
                **({"cached": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.measured_at))}
                   if self.measured_at is not None else {}),
                "ms_without": round(self.ms_without, 4), "ms_with": round(self.ms_with, 4),
                **({"without_samples": r4(self.without_samples), "with_samples": r4(self.with_samples),
                    "block_ratios": r4(self.block_ratios)} if self.block_ratios else {})}


def block_ratio(without: list[float], with_: list[float]) -> float:
    s = sum(with_)
    return sum(without) / s if s > 0 else float("inf")


def blocks_disagree(pairs: list[tuple[float, float]]) -> bool:
    """Whether (without, with) pairs or block ratios fall on both sides of 1: the step needs another block."""
    sides = {a >= b for a, b in pairs}
    return len(sides) > 1


def default_enabled() -> bool:
    return env_bool(ENV, default=True)


def cache_default() -> bool:
    return env_bool(CACHE_ENV, default=True)


# ---- decisions kept across processes (the module docstring) -------------------------------------------------
def _decision_entry(v) -> str | None:
    """Why a floor_decisions.json value is malformed (None: a decision with its numbers)."""
    if not isinstance(v, dict) or not json_depth_ok(v, 2):
        return "not a JSON object of scalars and lists"
    if not isinstance(v.get("kept"), bool):
        return "no boolean 'kept'"
    for k in ("ms_without", "ms_with", "measured_at"):
        if isinstance(v.get(k), bool) or not isinstance(v.get(k), (int, float)):
            return f"no numeric {k!r}"
    br = v.get("block_ratios", [])
    if not isinstance(br, list) or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in br):
        return "'block_ratios' is not a list of numbers"
    return None


DECISIONS = JsonCache("floor_decisions.json", _decision_entry)
# integer inputs whose values change no kernel (token ids): their shapes count, their values do not
_VALUE_FREE = frozenset({"input_ids", "decoder_input_ids"})


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_section(device: torch.device) -> str:
    """The cache section of the machine the floor times on: the device and every version that changes kernels."""
    def _version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        name = f"cpu {_cpu_model()} ({os.cpu_count()} cpus, {torch.get_num_threads()} threads)"
    else:
        name = device.type
    return (f"{name}|torch {torch.__version__}|triton {_version('triton')}|transformers {_version('transformers')}"
            f"|opsadv {__version__}")


def report() -> str:
    """The stored floor decisions of this torch / triton / transformers / opsadv, per machine, as text (`opsadv info
    --tuning`): model, mode, rewrite kind, kept or not, the measured ratio and when."""
    here = machine_section(torch.device("cpu")).split("|", 1)[1]       # the versions part of a section name
    sections = {k: v for k, v in DECISIONS.sections().items() if v and k.split("|", 1)[-1] == here}
    lines = [f"{DECISIONS.name}: conversion floor decisions (convert_model's floor; reused by the next conversion "
             "of the same model, inputs and mode)" + ("" if sections else " -- none stored for these versions")]
    for section, entries in sorted(sections.items()):
        lines.append(f"  [{section}] {len(entries)} decisions")
        rows = sorted(entries.values(), key=lambda v: (str(v.get("model")), str(v.get("mode")),
                                                       str(v.get("compile")), v["measured_at"]))
        for v in rows:
            br = v.get("block_ratios") or []
            ratio = (statistics.median(br) if br else
                     v["ms_without"] / v["ms_with"] if v["ms_with"] > 0 else float("inf"))
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(v["measured_at"]))
            how = v.get("mode", "?") + (f", compiled {v['compile']}" if v.get("compile") else "")
            mixed = ", inconclusive" if br and min(br) < 1.0 <= max(br) else ""
            lines.append(f"    {v.get('model', '?')} [{how}] {v.get('kind', '?')}: "
                         f"{'kept' if v['kept'] else 'not applied'} ({ratio:.3f}x{mixed}; {when})")
    return "\n".join(lines)


def model_signature(model) -> str:
    """A digest of the model as handed over: class, config, module types, parameter and buffer shapes / dtypes
    (and which parameters train)."""
    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    cfg = getattr(model, "config", None)
    if cfg is not None:
        try:
            h.update(cfg.to_json_string(use_diff=False).encode())
        except Exception:           # a config that does not serialize: its repr
            h.update(repr(cfg).encode())
    for name, m in model.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__};".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.device.type}:{p.requires_grad};".encode())
    for name, b in model.named_buffers():
        h.update(f"{name}:{tuple(b.shape)}:{b.dtype};".encode())
    return h.hexdigest()


def inputs_signature(inputs) -> str:
    """A digest of the floor inputs: every tensor's name, shape, dtype and device; the values of integer and bool
    tensors (masks, position ids) except token ids, labels as their ignored (< 0) pattern."""
    h = hashlib.sha256()

    def walk(x, name: str) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"{name}:{tuple(x.shape)}:{x.dtype}:{x.device.type};".encode())
            if name == "labels":
                x = x < 0
            if not x.is_floating_point() and name not in _VALUE_FREE:
                h.update(x.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{name}[{i}]")
        else:
            h.update(f"{name}={x!r};".encode())

    walk(inputs, "")
    return h.hexdigest()


def compile_mode(value) -> str | None:
    """floor_compile as one of COMPILES (True = "regional")."""
    if value is True:
        return "regional"
    if value in (None, False):
        return None
    if value not in COMPILES:
        raise InvalidArgumentError("convert_model", "floor_compile", "None, False, True, 'regional' or 'full' (how the "
                                   "model will be compiled)", repr(value))
    return value


def repeated_blocks(model) -> list:
    """The model's repeated blocks (its _no_split_modules classes), the unit regional compilation compiles."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


@contextmanager
def _recompiles_allowed():
    import torch._dynamo.config as cfg
    saved = {}
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            saved[name] = getattr(cfg, name)
            setattr(cfg, name, max(saved[name], RECOMPILE_LIMIT))
    try:
        yield
    finally:
        for name, v in saved.items():
            setattr(cfg, name, v)


@contextmanager
def compiled(model, how: str | None):
    """The model as torch.compile runs it (see the module docstring); the model is left uncompiled after."""
    if how is None:
        yield model
        return
    blocks = repeated_blocks(model) if how == "regional" else []
    with _recompiles_allowed():
        if not blocks:
            yield torch.compile(model, **COMPILE_KWARGS)
            return
        for m in blocks:
            m.compile(**COMPILE_KWARGS)
        try:
            yield model
        finally:
            for m in blocks:
                m._compiled_call_impl = None


def check_args(floor, mode, timer, compile=None, cache=None) -> None:
    compile_mode(compile)
    if cache not in (None, True, False):
        raise InvalidArgumentError("convert_model", "floor_cache",
                                   f"True, False or None (None: on unless {CACHE_ENV}=0)", repr(cache))
    if floor not in (None, True, False):
        raise InvalidArgumentError("convert_model", "floor", "True, False or None (None: on unless "
                                   f"{ENV}=0)", repr(floor))
    if mode not in MODES:
        raise InvalidArgumentError("convert_model", "floor_mode", f"one of {list(MODES)}", repr(mode))
    if timer is not None and not callable(timer):
        raise InvalidArgumentError("convert_model", "floor_timer", "a callable fn -> ms, or None", repr(timer))


def _device_of(model) -> torch.device:
    p = next((p for p in model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def wall_timer(device: torch.device) -> Timer:
    """Median ms of one call: a warm-up, then as many calls as fit TARGET_S (MIN_REPS..MAX_REPS; one for a call
    longer than TARGET_S)."""
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timer(fn) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        one = max(time.perf_counter() - t0, 1e-6)
        # a call as long as the target window times once (a generate or a large step): three more would triple
        # conversion time while the blocks already repeat the measurement
        reps = 1 if one >= TARGET_S else max(MIN_REPS, min(MAX_REPS, int(TARGET_S / one)))
        collecting = gc.isenabled()
        gc.disable()                   # a collection inside a host-bound call reads as the rewrite's cost
        try:
            return statistics.median(per_call_ms(fn, reps, cuda))
        finally:
            if collecting:
                gc.enable()

    return timer


def _loss_of(out) -> torch.Tensor:
    loss = getattr(out, "loss", None) if not isinstance(out, dict) else out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    t, _ = _val.primary_output(out)
    if t is None:
        raise InvalidArgumentError("convert_model", "floor_mode", "a model whose output has a loss or a tensor "
                                   "(floor_mode='train')", type(out).__name__)
    return t.float().sum()


def _train_inputs(model, inputs):
    """Causal LMs get labels = input_ids (their loss is what a training step backpropagates)."""
    if isinstance(inputs, dict) and "labels" not in inputs and "input_ids" in inputs:
        if is_transformers_model(model) and getattr(model, "can_generate", lambda: False)():
            labels = inputs["input_ids"].clone()
            am = inputs.get("attention_mask")
            if am is not None:
                labels = labels.masked_fill(am == 0, -100)
            return {**inputs, "labels": labels}
    return inputs


def step_fn(model, inputs, mode: str) -> Callable[[], Any]:
    """The call the floor times: a no-grad forward, or forward + backward (grads cleared each call)."""
    if mode == "inference":
        return lambda: _val.run(model, inputs)
    if mode == "generate":
        if not callable(getattr(model, "generate", None)) or not isinstance(inputs, dict):
            raise InvalidArgumentError("convert_model", "floor_mode", "a model with .generate and dict floor inputs "
                                       "(floor_mode='generate')", type(model).__name__)

        def gen():
            with torch.no_grad():
                return model.generate(**inputs, max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS,
                                      do_sample=False)
        return gen
    tin = _train_inputs(model, inputs)
    params = [p for p in model.parameters() if p.requires_grad]

    def train():
        for p in params:
            p.grad = None
        with torch.enable_grad():
            out = (model(**tin) if isinstance(tin, dict) else model(*tin) if isinstance(tin, (tuple, list))
                   else model(tin))
            _loss_of(out).backward()
    return train


class Floor:
    """Times the model around each rewrite step and decides (see the module docstring)."""

    def __init__(self, inputs, mode: str = "inference", timer: Timer | None = None, compile: str | None = None,
                 *, model=None, cache: bool | None = None, context: str = "", model_name: str = ""):
        """model, cache, context: without a custom timer, measured decisions are written to DECISIONS under a key
        built here, before any rewrite, from the model, the inputs and `context` (what else decides the kernels:
        backend, precision, options); cache=True also reads them back instead of timing (False: measure again,
        None: neither read nor write); model_name: how the stored decisions name the model (the report's)."""
        self.inputs = inputs
        self.mode = mode
        self.timer = timer
        self.compile = compile
        self.decisions: list[Decision] = []
        self.seconds = 0.0                  # wall time spent timing (the report's "floor" phase) ...
        self.tuning = 0.0                   # ... of which autotuning the first calls of new buckets
        self.cache = cache is not None and timer is None and model is not None     # decisions are stored
        self.reuse = self.cache and cache is True                                  # ... and read back
        self.reused = 0                     # decisions taken from the cache
        if self.cache:
            self._section = machine_section(_device_of(model))
            self._model_name = model_name or type(model).__name__
            self._base = {"model": model_signature(model), "inputs": inputs_signature(inputs), "mode": mode,
                          "compile": compile, "compile_kwargs": repr(sorted(COMPILE_KWARGS.items())),
                          "context": context, "ambient": current_policy().describe()}

    def _key(self, kind: str, step: list[str]) -> str:
        path = [(d.kind, d.kept) for d in self.decisions]
        blob = json.dumps({**self._base, "path": path, "kind": kind, "step": step}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def recall(self, kind: str, label: str, step: list[str]) -> Decision | None:
        """The decision measured before for this step (None: not cached, or not read)."""
        if not self.reuse:
            return None
        v = DECISIONS.get(self._section, self._key(kind, step))
        if v is None:
            return None
        d = Decision(kind, label, float(v["ms_without"]), float(v["ms_with"]), v["kept"],
                     block_ratios=tuple(float(r) for r in v.get("block_ratios", ())),
                     measured_at=float(v["measured_at"]))
        self.decisions.append(d)
        self.reused += 1
        return d

    def time(self, model) -> float:
        t0, tune0 = time.perf_counter(), seconds_spent()
        try:
            return self._time(model)
        finally:
            self.seconds += time.perf_counter() - t0
            self.tuning += seconds_spent() - tune0

    def _time(self, model) -> float:
        modes = {m: m.training for m in model.modules()}
        grads = {p: p.grad for p in model.parameters()}
        if self.mode != "train":
            model.eval()
        else:
            model.train()
        try:
            timer = self.timer or wall_timer(_device_of(model))
            with compiled(model, self.compile) as run:
                return float(timer(step_fn(run, self.inputs, self.mode)))
        finally:
            for m, t in modes.items():
                m.training = t
            for p, g in grads.items():
                p.grad = g

    def decide_blocks(self, kind: str, label: str, without: list[float], with_: list[float],
                      step: list[str] = ()) -> Decision:
        """The decision from the step's B A A B blocks (samples in the order taken, 2 per side per block); with
        the cache on, stored under the step's key (`step`: what it changed, as the report lists it)."""
        ratios = tuple(block_ratio(without[i:i + 2], with_[i:i + 2]) for i in range(0, len(without), 2))
        d = Decision(kind, label, statistics.median(without), statistics.median(with_),
                     kept=min(ratios) >= 1.0, without_samples=tuple(without),
                     with_samples=tuple(with_), block_ratios=ratios)
        if self.cache:
            DECISIONS.put(self._section, self._key(kind, list(step)), {
                "kept": d.kept, "ms_without": d.ms_without, "ms_with": d.ms_with, "block_ratios": list(ratios),
                "measured_at": time.time(), "model": self._model_name, "kind": kind, "label": label,
                "mode": self.mode, "compile": self.compile})
        self.decisions.append(d)
        return d
