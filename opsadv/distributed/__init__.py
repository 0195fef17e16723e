"""opsadv on torch.distributed: sharding rules so every opsadv op runs on DTensors (docs/distributed.md).

The rules (rules.py, through strategy.py) are registered with DTensor's sharding propagator as soon as
torch.distributed.tensor is loaded, or at once where it already is: `import opsadv` never imports it (about 0.6 s),
and no DTensor can exist before it is.  shard_gate_up builds swiglu_gemm's column-parallel weight.  ring_attention
(context parallelism) and its zig-zag helpers load on first use."""
from __future__ import annotations

import sys

from .._import_hook import when_imported

TARGET = "torch.distributed.tensor"
_registered = False


def register() -> None:
    """Register every op's rule with DTensor (idempotent; loads torch.distributed.tensor)."""
    global _registered
    if _registered or _submodule_initializing():
        return
    _registered = True
    try:
        from . import explain, rules, vocab_parallel
        rules.register_all()
        explain.install()
        vocab_parallel.install()
    except Exception as e:  # noqa: BLE001 - another torch's DTensor internals must not break importing it
        import warnings
        warnings.warn(f"opsadv: DTensor sharding rules not registered ({type(e).__name__}: {e}); opsadv ops on "
                      "DTensors will fail with DTensor's own error", RuntimeWarning, stacklevel=2)


def _submodule_initializing() -> bool:
    """One of this package's rule modules is mid-import (it imported torch.distributed.tensor first): registering
    now would import it half-done; its importer calls register() (or the next DTensor load does)."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for n, m in list(sys.modules.items()) if n.startswith(__name__ + "."))


def install() -> None:
    """Called by `import opsadv`: register now if DTensor is loaded, else when it loads."""
    when_imported(TARGET, register)


def shard_gate_up(w_gate_up, mesh, mesh_dim: int = 0):
    """swiglu_gemm's [W_g | W_u] (K, 2N) as a column-parallel DTensor on `mesh`: placement
    _StridedShard(1, split_factor=2) on mesh_dim (Replicate on the others), so each rank holds its W_g columns and
    the matching W_u columns, [W_g,r | W_u,r], which its local swiglu_gemm / swiglu pair correctly.  A plain
    Shard(1) would give one rank gate columns and another up columns, and is refused.  The DTensor's global value is
    the unsharded [W_g | W_u] (full_tensor() and state dicts are unchanged)."""
    from .gate_up import shard_gate_up as impl
    return impl(w_gate_up, mesh, mesh_dim)


_LAZY = {"ring_attention": "ring_attention", "zigzag_shard": "ring_layout", "zigzag_unshard": "ring_layout"}


def __getattr__(name: str):
    """ring_attention, zigzag_shard, zigzag_unshard: imported on first use (`import opsadv` stays light)."""
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value     # importing the submodule ring_attention bound that name to the module
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
