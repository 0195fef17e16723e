"""The backend plugin contract: small hooks that return data; opsadv's core decides.

A backend is one pluggy plugin (a module or object) that implements these hooks.  Built-in
backends implement exactly these hooks too.  pluggy runs only at discovery time, never per op."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pluggy

PROJECT = "opsadv"
API_VERSION = "1.0"          # a plugin written for another major version is refused

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendInfo:
    name: str                               # "cuda", "reference", "mycorp"
    vendor: str = ""
    device_types: tuple[str, ...] = ()      # torch device types its kernels take
    version: str = "0"
    api_version: str = API_VERSION          # the opsadv plugin API it was written for
    auto_priority: int = 0                  # which backend "auto" names as primary (highest wins)
    description: str = ""


@dataclass(frozen=True)
class ProbeResult:
    available: bool
    reasons: tuple[str, ...] = ()           # why not, or notes such as "interpreter mode"
    capabilities: dict[str, Any] = field(default_factory=dict)


class BackendSpec:
    @hookspec
    def opsadv_backend_info(self) -> BackendInfo:
        """Name, vendor, device types, versions. Must not touch a device."""

    @hookspec
    def opsadv_probe(self, env) -> ProbeResult:
        """Can this backend run here?  Cheap: no device or NPU initialization."""

    @hookspec
    def opsadv_register_ops(self) -> list:
        """Optional: new ops this plugin defines, as opsadv.core.opdef.OpDef (name, public function, reference impl,
        spec builder, conformance cases).  Collected at discovery whether or not the probe says available, before
        the kernels, so this plugin's impls (and any other's) may serve them; the reference backend serves each with
        the OpDef's reference and the conformance kit covers it.  A name that another definition holds is refused."""

    @hookspec
    def opsadv_register_kernels(self, registry, env) -> None:
        """Add KernelImpls with `registry.add(impl)`.  Called only if the probe said available."""

    @hookspec
    def opsadv_profiles(self) -> list:
        """Named Profiles (data) with a matches(env) predicate.  A profile whose `backend` names another
        backend is offered to that one (jetson's memory-frugal profile for use_backend("cuda", profile="jetson"))."""

    @hookspec
    def opsadv_device_timer(self, device_type: str):
        """Optional: an opsadv.core.tuning.DeviceTimer (synchronize, timing events) for this device type, used by
        autotune when this backend is available; None or absent: the default for the device type."""

    @hookspec
    def opsadv_activate(self, options: dict, env) -> dict:
        """Called when a policy selects this backend with backend-specific options (e.g.
        aoe_mode, memory_budget).  Validate them (raise InvalidArgumentError), apply side
        effects, return the normalized options.  Optional."""

    @hookspec
    def opsadv_tune(self, op: str, spec, mode: str) -> dict | None:
        """Optional tuning (autotune sweep, AOE); returns results to persist."""
