"""run_batched: run a function or model over a batch in chunks that fit a memory budget.

The batch is split along dim 0 of every input tensor whose first dim is the batch size (a tensor,
a tuple of positional tensors, or a dict of keyword tensors such as a Hugging Face BatchEncoding;
other values are passed whole to every chunk).  On a GPU the chunk size is PREDICTED from the
first chunk(s) — a linear fit of the peak allocated bytes (torch.cuda.max_memory_allocated minus
what was allocated before the chunk) against the chunk size — so that the memory allocated above
the call's starting point stays within the budget.  An out-of-memory error (torch.OutOfMemoryError,
or a plain RuntimeError saying "out of memory" as older builds raise) halves the chunk and retries it;
results are committed only after a chunk succeeds, so nothing is lost, duplicated or reordered.
Every chunk must return the first chunk's dtypes (raised, never cast).  The result is what the
unbatched call returns: tensors, tuples, dicts and transformers ModelOutputs are merged field by
field into preallocated outputs (no 2x copy at the end).  run_batched resets CUDA peak-memory statistics per chunk; `stats` reports the peak."""
from __future__ import annotations

import gc
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import Tensor

from ..core.env import current_env
from ..core.errors import InvalidArgumentError
from ..core.policy import current_policy
from .memory import _read_mem_available, current_memory_policy, format_bytes, parse_bytes

OP = "run_batched"
MAX_STREAMS = 8
SAFETY = 0.85          # plan chunks to use at most this share of what is left of the budget
                      # (0.95 let a 2-point fit overshoot a 67 MiB budget by 1% on the H200)


# ---- inputs ----------------------------------------------------------------------------------
def _batch_size(inputs) -> tuple[str, int]:
    """('tensor'|'args'|'kwargs', batch size): the first tensor's dim 0 sets the batch size."""
    if isinstance(inputs, Tensor):
        kind, values = "tensor", [inputs]
    elif isinstance(inputs, Mapping):
        kind, values = "kwargs", list(inputs.values())
        if "input_ids" in inputs and isinstance(inputs["input_ids"], Tensor):
            values = [inputs["input_ids"]] + values
    elif isinstance(inputs, (tuple, list)):
        kind, values = "args", list(inputs)
    else:
        raise InvalidArgumentError(OP, "inputs", "a tensor, a tuple/list of positional arguments or a dict of "
                                   "keyword arguments", type(inputs).__name__)
    for v in values:
        if isinstance(v, Tensor) and v.dim() >= 1:
            if v.shape[0] == 0:
                raise InvalidArgumentError(OP, "inputs", "a non-empty batch", f"batch size 0 ({tuple(v.shape)})")
            return kind, v.shape[0]
    raise InvalidArgumentError(OP, "inputs", "at least one tensor of rank >= 1 (its dim 0 is the batch)",
                               "no such tensor")


def _slice(v, batch: int, a: int, b: int):
    return v[a:b] if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == batch else v


def _call_chunk(fn, inputs, kind: str, batch: int, a: int, b: int):
    if kind == "tensor":
        return fn(inputs[a:b])
    if kind == "args":
        return fn(*[_slice(v, batch, a, b) for v in inputs])
    return fn(**{k: _slice(v, batch, a, b) for k, v in inputs.items()})


def _input_device(inputs, kind: str) -> torch.device:
    vals = [inputs] if kind == "tensor" else list(inputs.values() if kind == "kwargs" else inputs)
    for v in vals:
        if isinstance(v, Tensor):
            return v.device
    return torch.device("cpu")


# ---- outputs ---------------------------------------------------------------------------------
_SCALARS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _leaves(obj, path: str = "output") -> list[tuple[str, Any]]:
    """Flatten an output into (path, leaf) pairs in a fixed order."""
    if isinstance(obj, Tensor) or isinstance(obj, _SCALARS):
        return [(path, obj)]
    if isinstance(obj, Mapping):
        return [x for k, v in obj.items() for x in _leaves(v, f"{path}[{k!r}]")]
    if isinstance(obj, (tuple, list)):
        return [x for i, v in enumerate(obj) for x in _leaves(v, f"{path}[{i}]")]
    hint = " (for a transformers model pass use_cache=False: a KV cache cannot be merged)" \
        if "Cache" in type(obj).__name__ else ""
    raise InvalidArgumentError(OP, "fn", "a function returning tensors, tuples, lists, dicts or ModelOutputs"
                               + hint, f"{path} is a {type(obj).__name__}")


def _rebuild(template, it):
    if isinstance(template, Tensor) or isinstance(template, _SCALARS):
        return next(it)
    if isinstance(template, Mapping):
        items = {k: _rebuild(v, it) for k, v in template.items()}
        try:
            return type(template)(**items) if hasattr(template, "to_tuple") else type(template)(items)
        except TypeError:
            return dict(items)
    items = [_rebuild(v, it) for v in template]
    if isinstance(template, tuple) and hasattr(template, "_fields"):   # namedtuple
        return type(template)(*items)
    return type(template)(items)


class _Merger:
    """Preallocated full-batch outputs, filled chunk by chunk (no concatenation copy at the end)."""

    def __init__(self, first, n: int, batch: int, stream=None):
        self.template = first
        self.batch = batch
        self.paths, self.slots = [], []
        leaves = _leaves(first)
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:   # allocate on the caller's stream: side streams only write into these
            for path, leaf in leaves:
                self.paths.append(path)
                if isinstance(leaf, Tensor):
                    if leaf.dim() == 0 or leaf.shape[0] != n:
                        raise InvalidArgumentError(
                            OP, "fn", f"batch-major tensor outputs (dim 0 = the chunk's {n} samples), so chunks "
                            "can be concatenated", f"{path} has shape {tuple(leaf.shape)}"
                            + (" (a batch reduction such as a loss: drop labels)" if leaf.dim() == 0 else ""))
                    self.slots.append(leaf.new_empty((batch,) + tuple(leaf.shape[1:])))
                else:
                    self.slots.append(leaf)

    def commit(self, out, a: int, b: int) -> None:
        leaves = _leaves(out)
        if [p for p, _ in leaves] != self.paths:
            raise InvalidArgumentError(OP, "fn", "the same output structure for every chunk",
                                       f"{[p for p, _ in leaves]} after {self.paths}")
        for (path, leaf), slot in zip(leaves, self.slots):
            if isinstance(slot, Tensor):
                if not isinstance(leaf, Tensor) or tuple(leaf.shape) != (b - a,) + tuple(slot.shape[1:]):
                    got = tuple(leaf.shape) if isinstance(leaf, Tensor) else type(leaf).__name__
                    raise InvalidArgumentError(OP, "fn", f"{path} shaped {(b - a,) + tuple(slot.shape[1:])} for a "
                                               f"chunk of {b - a}", got)
                if leaf.dtype != slot.dtype:
                    # copy_ would cast it to the first chunk's dtype without a word
                    raise InvalidArgumentError(OP, "fn", f"{path} of dtype {_dt(slot.dtype)} in every chunk (as in "
                                               f"the first)", f"{_dt(leaf.dtype)} for samples {a}:{b}")
                slot[a:b].copy_(leaf)
            elif not _same(slot, leaf):
                raise InvalidArgumentError(OP, "fn", f"non-tensor output {path} equal in every chunk",
                                           f"{slot!r} then {leaf!r}")

    def result(self):
        return _rebuild(self.template, iter(self.slots))


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_oom(e: BaseException) -> bool:
    """torch.OutOfMemoryError, or the plain RuntimeError older torch builds and some extensions raise for it
    ("CUDA out of memory. Tried to allocate ...", "CUDA error: out of memory", HIP / NPU alike)."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- the memory model -------------------------------------------------------------------------
class _Model:
    """peak(n) ≈ fixed + per_sample · n, fitted from measured chunks (bytes above the chunk's start)."""

    def __init__(self, bytes_per_sample: int | None):
        self.points: dict[int, int] = {}
        self.given = bytes_per_sample

    def add(self, n: int, peak: int) -> None:
        self.points[n] = max(peak, self.points.get(n, 0))

    def coef(self) -> tuple[float, float] | None:
        if self.given is not None:
            return 0.0, float(self.given)
        if not self.points:
            return None
        ns = sorted(self.points)
        if len(ns) == 1:   # one point: attribute everything to the samples (over-estimates: safe)
            return 0.0, self.points[ns[0]] / ns[0]
        lo, hi = ns[0], ns[-1]
        per = (self.points[hi] - self.points[lo]) / (hi - lo)
        if per <= 0:       # noise or a warm-up-heavy first chunk: attribute everything to the samples
            per = max(self.points.values()) / lo
        fixed = max(0.0, max(self.points[n] - per * n for n in ns))   # every measured point under the line
        return fixed, per

    def largest(self, room: float) -> int | None:
        c = self.coef()
        if c is None:
            return None
        fixed, per = c
        if per <= 0:
            return None
        return int((room * SAFETY - fixed) // per)


def _validate(fn, max_streams, chunk_size, bytes_per_sample):
    if not callable(fn):
        raise InvalidArgumentError(OP, "fn_or_model", "a callable (function or torch.nn.Module)", type(fn).__name__)
    if isinstance(max_streams, bool) or not isinstance(max_streams, int) or not 1 <= max_streams <= MAX_STREAMS:
        raise InvalidArgumentError(OP, "max_streams", f"an int in 1..{MAX_STREAMS}", repr(max_streams))
    for name, v in (("chunk_size", chunk_size), ("bytes_per_sample", bytes_per_sample)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InvalidArgumentError(OP, name, "None or a positive int", repr(v))


def default_budget(device: torch.device) -> tuple[int | None, str]:
    """The budget when none is given: the jetson policy option, else what is free on the device
    (MemAvailable on a Jetson: unified memory), 90% of it.  (None, why) on CPU."""
    opts = current_policy().option_dict
    opt = opts.get("memory_budget")
    if isinstance(opt, int) and "use_backend" in str(opts.get("memory_budget_source", "use_backend")):
        return opt, "use_backend(memory_budget=...)"      # given by the user (not the MemAvailable snapshot)
    if device.type != "cuda":
        return None, "no prediction on CPU without bytes_per_sample"
    env = current_env()
    if env.is_jetson:
        avail = _read_mem_available()
        if avail is not None:
            return int(avail * 0.9), "90% of /proc/meminfo MemAvailable"
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int((free + cached) * 0.9), "90% of free device memory (cudaMemGetInfo + allocator cache)"


class CudaMeter:
    """Allocated-memory accounting of one CUDA device (what run_batched measures chunks with)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def after_oom(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def meter_for(device: torch.device):
    """The meter for the inputs' device: CudaMeter on a GPU, None (nothing measured) on CPU."""
    return CudaMeter(device) if device.type == "cuda" and torch.cuda.is_available() else None


def _default_streams(fn_or_model) -> int:
    """max_streams when not given: the converted model's seed option (convert_model(max_streams=)),
    else the current policy's option (use_backend(..., max_streams=)), else 1."""
    st = getattr(fn_or_model, "_opsadv_state", None)
    pol = st.effective() if st is not None else None
    for p in (pol, current_policy()):
        if p is not None and p.option_dict.get("max_streams"):
            return int(p.option_dict["max_streams"])
    return 1


def run_batched(fn_or_model: Callable, inputs, *, memory_budget=None, max_streams: int | None = None,
                bytes_per_sample: int | None = None, chunk_size: int | None = None,
                stats: dict | None = None):
    """Call `fn_or_model` on `inputs` in batch chunks so that peak memory stays within
    `memory_budget` (bytes or "2GiB"; default: see default_budget) and return what the
    unbatched call returns.

    inputs          a tensor (fn(x)), a tuple/list (fn(*args)) or a dict (fn(**kwargs)); every tensor whose
                    dim 0 is the batch size is split, everything else is passed whole.
    max_streams     1-8: chunks run round-robin on that many CUDA streams (budget split between them);
                    None: the converted model's / current policy's max_streams option, else 1.
    bytes_per_sample  the memory one sample needs, when it is known (the only prediction on CPU).
    chunk_size      the first chunk's size (default 1 on a GPU with a budget: the probe run).
    stats           a dict to fill with chunk sizes, retries, fitted model and measured peak."""
    if max_streams is None:
        max_streams = _default_streams(fn_or_model)
    _validate(fn_or_model, max_streams, chunk_size, bytes_per_sample)
    kind, batch = _batch_size(inputs)
    device = _input_device(inputs, kind)
    meter = meter_for(device)
    if memory_budget is not None:
        budget, source = parse_bytes(memory_budget, op=OP), "memory_budget argument"
    else:
        budget, source = default_budget(device)
    model = _Model(bytes_per_sample)
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    streams = [torch.cuda.Stream(device) for _ in range(max_streams)] if on_cuda and max_streams > 1 else None
    nstreams = len(streams) if streams else 1
    share = None if budget is None else budget / nstreams          # each stream's in-flight chunk
    main = torch.cuda.current_stream(device) if streams else None
    base = meter.allocated() if meter else 0
    empty_cache = meter is not None and bool(getattr(current_memory_policy(), "empty_cache_between_chunks", False))
    predict = budget is not None and (meter is not None or bytes_per_sample is not None)

    if chunk_size is not None:
        n = min(chunk_size, batch)
    elif predict:                      # a GPU probe run on one sample, or what bytes_per_sample allows
        n = 1 if bytes_per_sample is None else max(1, min(batch, model.largest(share) or 1))
    else:
        n = batch                      # nothing to predict with: one chunk, still retried on OOM
    ceiling = batch if predict else n  # after an OOM at n: never above n // 2 (nor above the size asked for)
    merger: _Merger | None = None
    chunks: list[int] = []
    retries, peak_abs, warned, pos, i = 0, base, False, 0, 0
    if streams:
        for s in streams:
            s.wait_stream(main)        # inputs were produced on the caller's stream
    while pos < batch:
        n = max(1, min(n, batch - pos, ceiling))
        stream = streams[i % nstreams] if streams else None
        oom = False
        try:
            if meter:
                meter.reset_peak()
                before = meter.allocated()
            with torch.cuda.stream(stream) if stream is not None else _nullctx():
                out = _call_chunk(fn_or_model, inputs, kind, batch, pos, pos + n)
            if meter:
                transient = meter.peak() - before
            if merger is None:
                merger = _Merger(out, n, batch, main)
                if streams:
                    for s in streams:
                        s.wait_stream(main)   # the output buffers exist before side streams write them
            with torch.cuda.stream(stream) if stream is not None else _nullctx():
                merger.commit(out, pos, pos + n)
            del out
            if meter:
                peak_abs = max(peak_abs, meter.peak())
                model.add(n, transient)
        except RuntimeError as e:
            if not _is_oom(e) or n == 1:
                raise
            oom = True
        if oom:                        # outside the except block: the traceback no longer pins tensors
            out = None
            gc.collect()
            if meter:
                meter.after_oom()
            retries += 1
            n = ceiling = max(1, n // 2)
            continue
        chunks.append(n)
        pos += n
        i += 1
        if empty_cache:
            meter.empty_cache()
        fit = None
        if predict:
            used = (meter.allocated() - base) if meter else 0
            fit = model.largest(share - used / nstreams)
        if fit is None:
            n = min(ceiling, 2 * n)    # nothing to predict with: back up to the ceiling
            continue
        if fit < 1 and streams:
            # one sample per stream does not fit the budget's per-stream share: go serial (one stream,
            # the whole budget) rather than exceed it
            for s in streams:
                main.wait_stream(s)
            streams, nstreams, share = None, 1, budget
            used = (meter.allocated() - base) if meter else 0
            fit = model.largest(share - used)
            if fit is None:
                n = min(ceiling, 2 * n)
                continue
        if fit < 1 and not warned:
            warned = True
            fixed, per = model.coef()
            warnings.warn(f"opsadv.run_batched: even one sample is predicted to need {format_bytes(fixed + per)} "
                          f"of the {format_bytes(share)} budget; running one sample at a time, which will exceed "
                          "the budget", RuntimeWarning, stacklevel=2)
        n = max(1, fit)
    if streams:
        for s in streams:
            main.wait_stream(s)
    if stats is not None:
        coef = model.coef()
        stats.update(batch=batch, chunks=chunks, retries=retries, streams=nstreams, device=str(device),
                     budget_bytes=budget, budget_source=source,
                     fixed_bytes=None if coef is None else coef[0],
                     bytes_per_sample=None if coef is None else coef[1],
                     peak_bytes=(peak_abs - base) if meter else None)
    return merger.result()
