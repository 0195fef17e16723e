"""mem_opt=3: free activations as soon as their last reader has run (inference only).

transformers' frames keep activations referenced long after their last use.  In a Llama decoder the
normed hidden state is read by the q, k and v projections and then stays referenced (the decoder
layer's local, the attention's argument) until the attention returns; the embedding output stays
referenced by the model's forward through all layers although layer 0 reads it last.  At Llama-1.1B b1
s8192 each is 32 MiB, held through the rotary step that is the converted model's activation peak.

The memory goes back to the allocator with `Tensor.set_()`: the tensor is pointed at an empty storage
and the old storage is freed unless a view of it is alive (the view keeps it and stays valid).  A read
nobody foresaw meets a tensor of shape (0,) and fails with a shape error; nothing ever reads freed
memory (`untyped_storage().resize_(0)`, FSDP's way, would: a segfault on CPU, an illegal address on a
GPU).

Which module reads an output last is measured, not assumed: one probe forward of the example inputs
records every touch of the output's storage (torch functions through a TorchFunctionMode; module calls
that receive it, through hooks) with the module stack at that moment.  Outputs of norms (OpsadvNorm) and
embeddings (nn.Embedding) are candidates.  One is released after the module call that holds its last
touch (the innermost module on the stack that received the storage), at the same call count, unless
that call returns the storage, the storage is part of the model's output, or the last touch is outside
any module that received it (e.g. a parallel attention+MLP block adding the normed state after the
projections); the conversion report gives the reason for each one left alone.

At run time the release happens only with gradients disabled (autograd would have saved the tensor),
outside CUDA-graph capture and torch.compile / export, after the reader ran as often as in the probe,
and only if no more Python references hold the tensor than in the probe: a caller path the probe did
not take that keeps the tensor (transformers' output_hidden_states collects the final norm's output,
for example) holds one more and keeps it whole."""
from __future__ import annotations

import sys
import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .modules import OpsadvNorm, _exporting

RELEASE_MEM_OPT = 3
PRODUCERS = (OpsadvNorm, nn.Embedding)     # modules whose outputs may be released
# smaller outputs are not worth the hook work (a decode step's (b, 1, hidden) states): their reader hook
# returns at its first test
MIN_RELEASE_BYTES = 1 << 20


def _storage_keys(obj) -> set[int]:
    keys = set()
    for t in pytree.tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            try:
                keys.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):   # e.g. a tensor subclass without storage
                pass
    keys.discard(0)
    return keys


def _refs(t: torch.Tensor) -> int:
    """Python references to t beyond the caller's one binding (and getrefcount's argument)."""
    return sys.getrefcount(t) - 3


def _opaque(module: nn.Module) -> bool:
    """A module whose reads of its inputs the TorchFunctionMode may not see (a leaf such as nn.Linear, or an
    opsadv module launching Triton kernels): the whole call counts as a read.  Others (transformers'
    attention, a decoder layer) read through torch functions and child modules, recorded one by one."""
    return not any(True for _ in module.children()) or type(module).__module__.startswith("opsadv.")


class _Probe(TorchFunctionMode):
    """One forward's touches of the tracked outputs' storages: per storage, a list of (holder, call n),
    holder = the innermost module on the stack that received the storage (None: none did)."""

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[nn.Module, set[int]]] = []   # (module, tracked storages among its inputs)
        self.tracked: dict[int, tuple[nn.Module, torch.Tensor]] = {}  # storage -> (producer, output kept)
        self.touches: dict[int, list[tuple[nn.Module | None, int]]] = defaultdict(list)
        self.calls: dict[tuple[int, int], int] = defaultdict(int)    # (storage, id(module)) -> calls so far
        self.returns_storage: set[tuple[int, int]] = set()           # (storage, id(module)) returned it
        self.produced: dict[int, int] = defaultdict(int)             # id(producer) -> calls

    def _holder(self, key: int) -> tuple[nn.Module | None, int]:
        for mod, keys in reversed(self.stack):
            if key in keys:
                return mod, self.calls[(key, id(mod))]
        return None, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tracked:
            for key in _storage_keys((args, kwargs)) & self.tracked.keys():
                self.touches[key].append(self._holder(key))
        return func(*args, **kwargs)

    def pre_hook(self, module, args, kwargs):
        keys = _storage_keys((args, kwargs)) & self.tracked.keys() if self.tracked else set()
        for key in keys:
            self.calls[(key, id(module))] += 1
            if _opaque(module):
                self.touches[key].append((module, self.calls[(key, id(module))]))
        self.stack.append((module, keys))

    def post_hook(self, module, args, kwargs, output):
        _, keys = self.stack.pop()
        for key in keys:
            n = self.calls[(key, id(module))]
            if _opaque(module):
                self.touches[key].append((module, n))
            if key in _storage_keys(output):
                self.returns_storage.add((key, id(module)))
        if isinstance(module, PRODUCERS) and isinstance(output, torch.Tensor):
            self.produced[id(module)] += 1
            key = output.untyped_storage().data_ptr()
            if key:
                self.tracked[key] = (module, output)   # kept alive: its address cannot be reused in the probe


class _Release:
    """Run-time state of one releasable output: the reader call after which it is emptied."""

    def __init__(self, producer: nn.Module, reader: nn.Module, calls: int):
        self.producer, self.reader, self.calls = producer, reader, calls
        self.max_refs: int | None = None         # set by the calibration forward (release_pass)
        self.out: weakref.ref | None = None
        self.key = 0
        self.seen = 0
        self.released = 0                        # outputs emptied (tests, benchmarks)
        self.kept = 0                            # reached the reader but held by more references
        self.hook_id: int | None = None          # the reader hook's key in reader._forward_hooks
        self.min_bytes = MIN_RELEASE_BYTES

    def on_output(self, module, args, output):
        self.out = None
        if (isinstance(output, torch.Tensor) and output._base is None and not torch.is_grad_enabled()
                and output.numel() * output.element_size() >= self.min_bytes and not _capturing()
                and not _exporting()):
            self.out, self.key, self.seen = weakref.ref(output), output.untyped_storage().data_ptr(), 0
            # the reader's other forward hooks must run before the check (they may keep the tensor:
            # transformers' output_hidden_states hook on layer 0 stores its input), including hooks
            # installed after ours: keep ours last
            hooks = self.reader._forward_hooks
            if self.hook_id in hooks and next(reversed(hooks)) != self.hook_id:
                hooks.move_to_end(self.hook_id)

    def on_reader(self, module, args, kwargs, output):
        if self.out is None or self.key not in _storage_keys((args, kwargs)):
            return
        self.seen += 1
        if self.seen < self.calls:
            return
        out = self.out()
        self.out = None
        if out is None or out.untyped_storage().data_ptr() != self.key or self.key in _storage_keys(output) \
                or torch.is_grad_enabled():
            return
        refs = _refs(out)
        if self.max_refs is None:                # the calibration forward: count, keep
            self.max_refs = refs
            return
        if refs > self.max_refs:
            self.kept += 1
            return
        out.set_()                               # empty; the storage goes unless a view holds it
        self.released += 1


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _why_not(probe: _Probe, key: int, producer, out_keys, paths) -> str:
    touches = probe.touches[key]
    reader = touches[-1][0] if touches else None
    return ("called more than once per forward" if probe.produced[id(producer)] != 1 else
            "its output is part of the model's output" if key in out_keys else
            "never read" if not touches else
            "last read outside a module that receives it (e.g. by an add after the projections)" if reader is None
            else f"its last reader {paths.get(id(reader), type(reader).__name__)} returns it"
            if (key, id(reader)) in probe.returns_storage else "")


def release_pass(model: nn.Module, report, undo, inputs, run) -> list[_Release]:
    """Probe one forward of `inputs` (run(model, inputs)), then hook the norm and embedding outputs that
    can be emptied after their last reader.  Returns the installed releases."""
    if not any(isinstance(m, PRODUCERS) for m in model.modules()):
        return []
    if inputs is None:
        report.add("skipped", "<activations>", "free activations after their last reader",
                   "no example inputs to find the readers with (pass example_inputs)")
        return []
    probe = _Probe()
    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(probe.pre_hook, with_kwargs=True),
                                                    m.register_forward_hook(probe.post_hook, with_kwargs=True))]
    try:
        with probe:
            result = run(model, inputs)
    finally:
        for h in handles:
            h.remove()
    out_keys = _storage_keys(result)
    paths = {id(m): p for p, m in model.named_modules()}
    candidates, refused = [], []
    for key, (producer, _) in probe.tracked.items():
        where = paths.get(id(producer), "?")
        why = _why_not(probe, key, producer, out_keys, paths)
        if why:
            refused.append((where, why))
            continue
        reader, n = probe.touches[key][-1]
        rel = _Release(producer, reader, n)
        hooks = [producer.register_forward_hook(rel.on_output),
                 reader.register_forward_hook(rel.on_reader, with_kwargs=True)]
        rel.hook_id = hooks[1].id
        undo.hooks += hooks                      # a failing calibration forward is undone with the rest
        candidates.append((where, paths.get(id(reader), type(reader).__name__), rel, hooks))
    del probe, result
    # calibration: the same forward with only these hooks, as at run time; each release learns how many
    # references hold its tensor at its reader's exit on this path (the probe's own hooks add some).
    # Example inputs are small: the size floor does not apply to this forward
    for _, _, rel, _ in candidates:
        rel.min_bytes = 0
    try:
        run(model, inputs)
    finally:
        for _, _, rel, _ in candidates:
            rel.min_bytes = MIN_RELEASE_BYTES
    installed = []
    for where, reader_path, rel, hooks in candidates:
        if rel.max_refs is None:
            refused.append((where, "its reader was not reached again in the calibration forward"))
            for h in hooks:
                h.remove()
                undo.hooks.remove(h)
            continue
        installed.append((where, reader_path, rel))
    if installed:
        kinds = sorted({type(r.producer).__name__ for _, _, r in installed})
        readers = sorted({r for _, r, _ in installed})
        report.add("memory", "<activations>", f"outputs freed after their last reader (mem_opt=3, no-grad calls): "
                   f"{len(installed)} ({', '.join(kinds)}), last readers e.g. {', '.join(readers[:3])}"
                   f"{' ...' if len(readers) > 3 else ''}")
    for where, why in refused:
        report.add("skipped", where, "free the output after its last reader", why)
    return [rel for _, _, rel in installed]


def releases(model: nn.Module) -> list[_Release]:
    """The releases installed on a converted model (their `released` / `kept` counters)."""
    found = []
    for m in model.modules():
        for hook in m._forward_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, _Release) and owner.producer is m:
                found.append(owner)
    return found


__all__ = ["release_pass", "releases", "RELEASE_MEM_OPT", "PRODUCERS"]
