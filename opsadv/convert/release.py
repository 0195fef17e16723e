"""mem_opt=3: free a norm's output as soon as its last reader has run (inference only).

In a pre-norm transformer block the normed hidden state is read by the q, k and v projections and then
stays referenced by transformers' frames (the decoder layer's local, the attention's argument) until the
attention returns.  At Llama-1.1B b1 s8192 that is 32 MiB held through the rotary step, the activation
peak of the converted model.  Its memory can go back to the allocator once nothing will read it again:
`Tensor.set_()` points the tensor at an empty storage, so the old one is freed when no view of it is
alive (a view keeps it, and stays valid).  A read the probe below did not foresee then meets a tensor of
shape (0,) and fails with a shape error; it never reads freed memory (`untyped_storage().resize_(0)`,
FSDP's way, would: a segfault on CPU, an illegal address on a GPU).

Which module reads a norm's output last is measured, not assumed: one probe forward of the example inputs
records every touch of the output's storage, by torch functions (a TorchFunctionMode) and by module calls
that receive it (global forward hooks), with the module stack at that moment.  The output is released
after the module call that holds the last touch (the innermost module on the stack that received the
storage), at the same call count, provided that call does not return the storage and the storage is not
part of the model's output.  A norm whose last touch is outside such a module (e.g. read by an add after
the projections, as parallel attention+MLP blocks do) or whose output is returned is left alone, and the
conversion report says why.

At run time the release happens only with gradients disabled (autograd would have saved the tensor),
outside CUDA-graph capture and torch.compile / export, and only if the norm's output reached that module
as often as in the probe; any other pattern keeps the memory (never a read of freed memory by a path the
probe saw).  A path the probe did not see (other forward arguments that make the model read the normed
state again) is the risk this level accepts; it is why only mem_opt=3 ("aggressive") does it."""
from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .modules import OpsadvNorm, _exporting

RELEASE_MEM_OPT = 3


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


class _Probe(TorchFunctionMode):
    """Records, per tracked storage, the touch events of one forward: ("fn", stack) for a torch function
    call that gets the storage, ("call", module, n) for entry into / exit from a module that received it."""

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[nn.Module, set[int]]] = []   # (module, tracked storages among its inputs)
        self.tracked: dict[int, tuple[OpsadvNorm, torch.Tensor]] = {}  # storage -> (norm, output kept alive)
        self.touches: dict[int, list[tuple[nn.Module | None, int]]] = defaultdict(list)  # (holder, call n)
        self.calls: dict[tuple[int, int], int] = defaultdict(int)    # (storage, id(module)) -> calls so far
        self.returns_storage: set[tuple[int, int]] = set()           # (storage, id(module)) returned it
        self.norm_calls: dict[int, int] = defaultdict(int)

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
        mod, keys = self.stack.pop()
        for key in keys:
            if _opaque(module):     # its reads may be kernels the mode cannot see: the whole call is a read
                self.touches[key].append((module, self.calls[(key, id(module))]))
            if key in _storage_keys(output):
                self.returns_storage.add((key, id(module)))
        if isinstance(module, OpsadvNorm) and isinstance(output, torch.Tensor):
            self.norm_calls[id(module)] += 1
            key = output.untyped_storage().data_ptr()
            if key:
                self.tracked[key] = (module, output)   # kept alive: its address cannot be reused in the probe


def _opaque(module: nn.Module) -> bool:
    """A module whose reads of its inputs the TorchFunctionMode may not see (a leaf such as nn.Linear, or an
    opsadv module launching Triton kernels).  Others (transformers' attention, a decoder layer) read their
    inputs through torch functions and child modules, which the probe records one by one."""
    return not any(True for _ in module.children()) or type(module).__module__.startswith("opsadv.")


class _Release:
    """Run-time state of one released norm output: the module call after which it is freed."""

    def __init__(self, norm: OpsadvNorm, reader: nn.Module, calls: int):
        self.norm, self.reader, self.calls = norm, reader, calls
        self.out: weakref.ref | None = None
        self.key = 0
        self.seen = 0
        self.released = 0                        # how many outputs were freed (tests and the report)

    def on_norm(self, module, args, output):
        self.out = None
        if (isinstance(output, torch.Tensor) and not torch.is_grad_enabled() and not _capturing()
                and not _exporting()):
            self.out, self.key, self.seen = weakref.ref(output), output.untyped_storage().data_ptr(), 0

    def on_reader(self, module, args, kwargs, output):
        if self.out is None or self.key not in _storage_keys((args, kwargs)):
            return
        self.seen += 1
        if self.seen == self.calls:
            out = self.out()
            self.out = None
            if out is not None and out._base is None and out.untyped_storage().data_ptr() == self.key \
                    and self.key not in _storage_keys(output) and not torch.is_grad_enabled():
                out.set_()                       # empty; the storage goes unless a view holds it
                self.released += 1


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def release_pass(model: nn.Module, report, undo, inputs, run) -> list[_Release]:
    """Probe one forward of `inputs` (run(model, inputs)), then hook the norms whose output can be freed
    after its last reader.  Returns the installed releases (their counters feed tests)."""
    norms = [m for m in model.modules() if isinstance(m, OpsadvNorm)]
    if not norms:
        return []
    if inputs is None:
        report.add("skipped", "<norms>", "free norm outputs after their last reader",
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
    installed, refused = [], []
    for key, (norm, _) in probe.tracked.items():
        where = paths.get(id(norm), "?")
        reader, n = probe.touches[key][-1] if probe.touches[key] else (None, 0)
        why = ("called more than once per forward" if probe.norm_calls[id(norm)] != 1 else
               "its output is part of the model's output" if key in out_keys else
               "never read" if not probe.touches[key] else
               "last read outside a module that receives it (e.g. by an add after the projections)"
               if reader is None else
               f"its last reader {paths.get(id(reader), type(reader).__name__)} returns it"
               if (key, id(reader)) in probe.returns_storage else "")
        if why:
            refused.append((where, why))
            continue
        rel = _Release(norm, reader, n)
        undo.hooks += [norm.register_forward_hook(rel.on_norm),
                       reader.register_forward_hook(rel.on_reader, with_kwargs=True)]
        installed.append((where, paths.get(id(reader), type(reader).__name__), rel))
    if installed:
        readers = sorted({r for _, r, _ in installed})
        report.add("memory", "<norms>", f"norm outputs freed after their last reader (mem_opt=3, no-grad calls): "
                   f"{len(installed)} norms, last readers e.g. {', '.join(readers[:3])}"
                   f"{' ...' if len(readers) > 3 else ''}")
    for where, why in refused:
        report.add("skipped", where, "free the norm output after its last reader", why)
    return [rel for _, _, rel in installed]


__all__ = ["release_pass", "RELEASE_MEM_OPT"]
