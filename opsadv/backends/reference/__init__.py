"""The reference backend: plain torch on any device, every op forward and backward.  It is the
oracle the conformance kit compares every other impl with.  Implements exactly the hooks a
third-party plugin implements: its kernels are the reference impls the ops' OpDefs carry
(opsadv/ops/<op>/reference.py), so an op defined anywhere, a plugin's included, has one."""
from __future__ import annotations

from opsadv import ops as _ops  # noqa: F401  (the built-in ops register their OpDefs)
from opsadv.core.opdef import REFERENCE_BACKEND, REFERENCE_DEVICE_TYPES, op_defs
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

NAME = REFERENCE_BACKEND


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="opsadv", device_types=REFERENCE_DEVICE_TYPES, version="1.0",
                       auto_priority=0, description="plain torch; the numerical oracle")


@hookimpl
def opsadv_probe(env):
    return ProbeResult(True, ("always available",))


@hookimpl
def opsadv_register_kernels(registry, env):
    for d in op_defs():
        registry.add(d.reference_impl())


@hookimpl
def opsadv_profiles():
    return []
