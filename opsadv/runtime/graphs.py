"""CUDA-graph replay of a (converted) model's forward for inference.

A converted model spends most of an eager forward on the host (Python, dispatch, launches); a
captured graph replays all of its kernels with one launch.  `CudaGraphRunner(fn)` keeps one graph
per input signature: the pytree structure of (args, kwargs), each tensor's shape, strides, dtype
and device, every non-tensor value, the dispatch policy in force, and an optional `hint` key
(e.g. the bucket of real tokens of a padded batch, see opsadv.convert.packing).  A new signature
is warmed up eagerly on a side stream (Triton compiles, tuners decide, caches fill), then
captured; later calls copy their tensors into the graph's static inputs and replay.  At most
`max_graphs` graphs are kept (least recently used evicted; each has its own memory pool).

Outputs are fresh tensors (cloned from the graph's static outputs) unless `clone_outputs=False`:
then they are the graph's own buffers, overwritten by the next replay of that graph (as
torch.compile's "reduce-overhead" mode documents).

Static state: a transformers StaticCache (any argument declaring `is_compileable`) is keyed by
identity and updated in place by each replay, so a decode step with a static KV cache replays as
one graph (each warm-up's counter advances are undone, so warm-ups repeat the same step and the first
replay is the call's own); `generate(..., cache_implementation="static")` runs as two graphs.

Graph state: an argument with a `graph_step` method (opsadv.PagedKVCache(static=True)) decides each call
itself (GraphStep): which calls run eagerly (a paged cache's prefill: its prompt shapes change per call and a
padded prompt's compaction reads the padding on the host), the canonical arguments a replayed call is keyed
and captured on (e.g. only the new tokens' padding columns of a growing 2-D mask), and the host bookkeeping
a replay skips (Python does not run: `graph_replayed` advances the host counters once per replay).  Its
warm-ups and capture are bracketed by `graph_snapshot` / `graph_restore` and run under `graph_view()`.

Refused, with the reason (InvalidArgumentError), never silently run another way: gradients
enabled (replay is inference only; use torch.no_grad() or torch.inference_mode()), a module in
training mode, tensors on another device, a growing cache (DynamicCache: use a StaticCache or
use_cache=False), other non-tensor arguments that are not hashable constants.
Whatever the forward does must be capturable: no host reads of device values (the converted
attention and packing take device-only paths while a stream is captured)."""
from __future__ import annotations

import contextlib
import inspect
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from opsadv.core import dispatch
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.policy import current_policy

OP = "cuda_graphs"
_CONST = (type(None), bool, int, float, str, torch.dtype, torch.device)


def is_static_state(x) -> bool:
    """A stateful argument whose tensors keep their storage across calls and are updated in place
    (transformers' StaticCache and other caches that declare `is_compileable`): a graph can replay
    it, keyed by the object's identity.  A DynamicCache grows (new tensors every step): it cannot."""
    return getattr(x, "is_compileable", False) is True


def graph_state(x):
    """`x` when it is an argument that plans its own graph calls (has `graph_step`, see GraphStep), else None."""
    return x if callable(getattr(type(x), "graph_step", None)) else None


@dataclass
class GraphStep:
    """A graph state's plan for one call (its `graph_step(args, kwargs)` returns it or raises the reason the call
    cannot run under graphs).  eager: why this call runs the eager forward (None: it replays a graph).  args /
    kwargs: what the graph is keyed on, captured with and fed (the state's canonical form of the call).  key: an
    extra key part (what the captured step depends on beyond tensor shapes).  info: handed back to
    `graph_replayed(step)` after each replay."""
    eager: str | None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    key: Any = None
    info: Any = None


def signature(leaves: list) -> tuple:
    """Hashable description of flattened call arguments (what a graph is specialized on)."""
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append(("T", tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad))
        elif isinstance(x, _CONST):
            sig.append(("V", type(x), x))
        elif is_static_state(x) or graph_state(x) is not None:
            sig.append(("I", type(x).__qualname__, id(x)))
        elif hasattr(x, "get_seq_length"):        # a transformers Cache that is not static
            raise InvalidArgumentError(OP, "cache", "a StaticCache (transformers.StaticCache(config=..., "
                                       "max_cache_len=...)): its tensors stay in place, so a graph can replay the "
                                       "step; this cache allocates new tensors as it grows (or pass use_cache=False)",
                                       type(x).__name__)
        else:
            raise InvalidArgumentError(OP, "inputs", "tensors, constants (None, bool, int, float, str, dtype, "
                                       "device) and static caches only: a graph is specialized on every non-tensor "
                                       "value", type(x).__name__)
    return tuple(sig)


SMALL_STATE_NUMEL = 64       # counters (e.g. a StaticCache layer's cumulative_length), not the K/V buffers


def small_state(obj, depth: int = 3) -> list[torch.Tensor]:
    """The small tensors inside a static-state object (attributes, and lists / tuples / dicts of
    objects, `depth` levels down): the counters its updates advance in place."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(x, d):
        if id(x) in seen or d < 0:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.numel() <= SMALL_STATE_NUMEL:
                out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, d - 1)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, d - 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)):
            for y in vars(x).values():
                walk(y, d - 1)
    walk(obj, depth)
    return out


@dataclass
class _Graph:
    graph: Any                     # torch.cuda.CUDAGraph
    inputs: list                   # static tensors, in the order of the tensor leaves
    out_leaves: list
    out_spec: Any
    replays: int = 0
    impls: dict = field(default_factory=dict)   # opsadv impl calls captured in the graph (each replay runs them)
    states: list = field(default_factory=list)  # static-state arguments (held: their id is part of the key)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager: int = 0            # calls a graph state ran eagerly by its rule (a paged cache's prefill)

    def __str__(self) -> str:
        return (f"{self.captures} captured, {self.replays} replays, {self.evictions} evicted"
                + (f", {self.eager} eager (graph state's rule)" if self.eager else ""))


class CudaGraphRunner:
    """Callable replacing `fn` (same arguments).  `module`: checked for training mode on each call.
    `hint(args, kwargs) -> (key, context manager | None)`: an extra key part and a context the
    warm-up and capture run under (for values the forward must know statically)."""

    def __init__(self, fn: Callable, *, device: torch.device, module: torch.nn.Module | None = None,
                 max_graphs: int = 8, warmup: int = 2, clone_outputs: bool = True,
                 hint: Callable | None = None, name: str = "forward"):
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise InvalidArgumentError(OP, "max_graphs", "an int >= 1", repr(max_graphs))
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise InvalidArgumentError(OP, "warmup", "an int >= 1 (Triton compiles and tuners must run before capture)",
                                       repr(warmup))
        device = torch.device(device)
        if device.type != "cuda":
            raise InvalidArgumentError(OP, "device", "a CUDA device (graphs are a CUDA feature)", str(device))
        self.fn, self.module, self.device, self.name = fn, module, device, name
        self.max_graphs, self.warmup, self.clone_outputs, self.hint = max_graphs, warmup, clone_outputs, hint
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.stats = GraphStats()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CudaGraphRunner({self.name}, {len(self.graphs)}/{self.max_graphs} graphs, {self.stats})"

    # ---- checks -------------------------------------------------------------------------------
    def check_mode(self) -> None:
        if torch.is_grad_enabled():
            raise InvalidArgumentError(OP, "grad mode", "torch.no_grad() or torch.inference_mode(): CUDA graphs "
                                       "replay inference only (convert without cuda_graphs to train)",
                                       "gradients enabled")
        if self.module is not None and any(m.training for m in self.module.modules()):
            raise InvalidArgumentError(OP, "model", "eval mode (model.eval()): CUDA graphs replay inference only",
                                       "a module in training mode")

    def _check_devices(self, tensors: list) -> None:
        for t in tensors:
            if t.device != self.device:
                raise InvalidArgumentError(OP, "inputs", f"tensors on {self.device} (the graphs' device)", str(t.device))

    # ---- call ---------------------------------------------------------------------------------
    def key(self, args: tuple, kwargs: dict) -> tuple[tuple, Any, list, Any]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        extra, ctx = self.hint(args, kwargs) if self.hint is not None else (None, None)
        return (str(spec), signature(leaves), extra, current_policy().serial), ctx, leaves, spec

    def _plan(self, args: tuple, kwargs: dict) -> GraphStep | None:
        """The graph state's plan of this call (None without a graph state among the arguments)."""
        found = [x for x in pytree.tree_leaves((args, kwargs)) if graph_state(x) is not None]
        if not found:
            return None
        if len({id(x) for x in found}) > 1:
            raise InvalidArgumentError(OP, "inputs", "at most one graph state (cache) per call",
                                       f"{len(found)}: {', '.join(type(x).__name__ for x in found)}")
        step = found[0].graph_step(args, kwargs)
        if not isinstance(step, GraphStep):
            raise TypeError(f"{type(found[0]).__name__}.graph_step returned {type(step).__name__}, not a GraphStep")
        return step

    def __call__(self, *args, **kwargs):
        self.check_mode()
        step = self._plan(args, kwargs)
        if step is not None:
            if step.eager is not None:            # the state's rule (e.g. a paged cache's prefill), counted in stats
                self.stats.eager += 1
                return self.fn(*args, **kwargs)
            args, kwargs = step.args, step.kwargs
        key, ctx, leaves, spec = self.key(args, kwargs)
        if step is not None:
            key = key + (step.key,)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self._check_devices(tensors)
        with self._lock:
            g = self.graphs.get(key)
            if g is None:
                g = self._capture(key, leaves, spec, ctx)
            else:
                self.graphs.move_to_end(key)
            for static, x in zip(g.inputs, tensors):
                if static.data_ptr() != x.data_ptr():
                    static.copy_(x)
            g.graph.replay()
            for st in g.states:                   # host bookkeeping a replay skips (Python did not run)
                if graph_state(st) is not None:
                    st.graph_replayed(step)
            _record_replay(g.impls)
            g.replays += 1
            self.stats.replays += 1
            outs = [t.clone() if self.clone_outputs and isinstance(t, torch.Tensor) else t for t in g.out_leaves]
        return pytree.tree_unflatten(outs, g.out_spec)

    def _capture(self, key, leaves, spec, ctx) -> _Graph:
        static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        ctx = ctx if ctx is not None else contextlib.nullcontext()
        # static-state arguments (a StaticCache) are passed as themselves: the graph updates their tensors in
        # place.  The warm-up calls advance their counters (a cache's write position) as real steps would:
        # those are put back afterwards, so the first replay is the call's own step (what the warm-up wrote
        # past the position stays masked until a later step overwrites it).
        states = [x for x in leaves if is_static_state(x)]
        saved = [t.clone() for st in states for t in small_state(st)]
        planned = [x for x in leaves if graph_state(x) is not None]      # they snapshot themselves (host and device)
        snaps = [st.graph_snapshot() for st in planned]

        def restore():
            # collected again each time: a cache's first update may replace its counters (lazy
            # initialization moves them to the device); the walk visits them in the same order
            with torch.no_grad():
                for t, v in zip([t for st in states for t in small_state(st)], saved):
                    t.copy_(v)
                for st, snap in zip(planned, snaps):
                    st.graph_restore(snap)
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with contextlib.ExitStack() as stack:
            stack.enter_context(ctx)
            for st in planned:
                stack.enter_context(st.graph_view())
            try:
                with torch.cuda.stream(side):
                    for _ in range(self.warmup):
                        self.fn(*args, **kwargs)
                        restore()               # each warm-up is the same step again, not the next one
            except Exception:
                if planned:                     # the call did not happen: the state is as before it
                    restore()
                raise
            cur.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph), dispatch.Trace() as captured:
                    out = self.fn(*args, **kwargs)
            except Exception as e:
                if planned:
                    restore()
                raise InvalidArgumentError(OP, self.name, "a forward that CUDA graphs can capture (no host reads of "
                                           "device values, no CPU tensors, no synchronization)",
                                           f"{type(e).__name__}: {e}") from e
        restore()
        out_leaves, out_spec = pytree.tree_flatten(out)
        g = _Graph(graph, [x for x in static if isinstance(x, torch.Tensor)], out_leaves, out_spec,
                   impls=dict(captured.counts), states=states + planned)
        self.graphs[key] = g
        self.stats.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats.evictions += 1
        return g

    def reset(self) -> None:
        """Drop every graph (and its memory pool)."""
        with self._lock:
            self.graphs.clear()


def _record_replay(impls: dict) -> None:
    """A replay runs the impls captured in the graph: opsadv.trace() counts them as if the eager
    forward had run (which kernel ran stays answerable under graphs)."""
    if dispatch._tracers and impls:
        for impl, n in impls.items():
            dispatch.record(impl, n)


class GraphedForward:
    """Installed as a module instance's `forward`: `module(...)` runs hooks as usual and replays
    through the runner.  `del module.forward` (or Undo.revert) restores the eager forward."""

    def __init__(self, runner: CudaGraphRunner):
        self.runner = runner
        try:                      # generate inspects forward's parameters (position_ids, logits_to_keep, ...)
            self.__signature__ = inspect.signature(runner.fn)
        except (TypeError, ValueError):
            pass

    def __call__(self, *args, **kwargs):
        return self.runner(*args, **kwargs)

    def __reduce__(self):          # deepcopy / pickle of the model: graphs are per process, not copied
        raise TypeError("a model with CUDA graphs cannot be copied or pickled; convert a copy of the original")


def install(module: torch.nn.Module, *, max_graphs: int = 8, clone_outputs: bool = True,
            hint: Callable | None = None) -> CudaGraphRunner:
    """Replace `module.forward` (on the instance) with a CUDA-graph runner over the eager forward."""
    dev = next((p.device for p in module.parameters()), None)
    if dev is None or dev.type != "cuda":
        raise InvalidArgumentError(OP, "model", "a model on a CUDA device", str(dev))
    eager = module.forward
    runner = CudaGraphRunner(eager, device=dev, module=module, max_graphs=max_graphs, clone_outputs=clone_outputs,
                             hint=hint, name=f"{type(module).__name__}.forward")
    module.forward = GraphedForward(runner)
    return runner


__all__ = ["CudaGraphRunner", "GraphedForward", "GraphStats", "GraphStep", "graph_state", "install",
           "is_static_state", "signature", "small_state"]
