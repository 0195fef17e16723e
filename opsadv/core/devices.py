"""Several GPUs in one process: a kernel launches on its inputs' GPU (Triton launches on the current device,
which a rank or a pipeline stage may not have set), and a node of mixed GPUs resolves, tunes and picks its
profile per device.  On a machine of one GPU none of this runs: the hot path stays as it is."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from . import hooks
from .resolved import Resolved

_state: list = []           # [several_gpus, mixed_gpus], read from the registry's env on first use


def _flags() -> list:
    if not _state:
        try:
            env = hooks.get_registry().env
            _state[:] = [env.device_type == "cuda" and env.device_count > 1, env.mixed_devices]
        except RuntimeError:        # no registry yet (core used on its own): one device
            return [False, False]
    return _state


hooks.on_registry_reset(_state.clear)


def several_gpus() -> bool:
    return _flags()[0]


def mixed_gpus() -> bool:
    return _flags()[1]


def device_key(t: torch.Tensor):
    """The device part of a resolution key: the device type, or the device itself where GPUs differ."""
    d = t.device
    return d if _flags()[1] and d.type == "cuda" else d.type


def device_index(t: torch.Tensor) -> int | None:
    """The GPU a call's spec resolves for (None: the node's device 0 facts serve)."""
    d = t.device
    return d.index if _flags()[1] and d.type == "cuda" else None


def _first_cuda_index(args) -> int | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.index if a.is_cuda else None
    return None


def on_input_device(fn):
    """fn run with its first tensor argument's GPU current (a no-op switch when it already is)."""
    def run(ctx, *args):
        idx = _first_cuda_index(args)
        if idx is None or idx == torch.cuda.current_device():
            return fn(ctx, *args)
        with torch.cuda.device(idx):
            return fn(ctx, *args)
    run.__wrapped__ = fn
    return run


def guarded(r: Resolved) -> Resolved:
    """r with its run / infer launching on the inputs' GPU, on a process that sees several GPUs."""
    if not _flags()[0] or getattr(r.run, "__wrapped__", None) is not None:
        return r
    return dataclasses.replace(r, run=on_input_device(r.run), infer=on_input_device(r.infer))


def inputs_device(args):
    """A context with the first tensor argument's GPU current (autotune times every candidate there)."""
    idx = _first_cuda_index(args) if _flags()[0] else None
    return contextlib.nullcontext() if idx is None else torch.cuda.device(idx)
