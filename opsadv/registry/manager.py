"""Loads backend plugins one by one, isolating failures, and collects their kernel impls.

Built-in backends are loaded from a fixed module list (so a checkout on PYTHONPATH works);
third-party backends from the "opsadv.backends" entry-point group.  Nothing else differs."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import math
import os
import threading
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pluggy
import torch

from ..core import hooks, tuning
from ..core.env import EnvInfo, current_env
from ..core.envvars import env_bool
from ..core.errors import EnvVarError, PluginError
from ..core.kernel import KernelImpl, Profile
from ..core.opdef import OPS, OpDef, get_op, op_source, register_op
from . import hookspecs
from .hookspecs import API_VERSION, BackendInfo, ProbeResult

log = logging.getLogger("opsadv.registry")

BUILTIN_BACKENDS = (
    "opsadv.backends.reference",
    "opsadv.backends.cuda",
    "opsadv.backends.jetson",
    "opsadv.backends.rocm",
    "opsadv.backends.ascend",
)
ENTRY_POINT_GROUP = "opsadv.backends"


@dataclass
class PluginFailure:
    name: str
    version: str
    stage: str          # "import", "info", "probe", "profiles", "ops", "register", "timer"
    error: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name} {self.version} failed at {self.stage}: {self.error}"


@dataclass
class BackendRecord:
    name: str
    info: BackendInfo
    probe: ProbeResult
    source: str                       # "builtin" or "entry point <dist>"
    plugin: Any
    impls: list[KernelImpl] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)     # its own, then those other backends offer it
    timers: dict[str, Any] = field(default_factory=dict)      # device type -> DeviceTimer it declared
    ops: list[str] = field(default_factory=list)               # the ops it defines (opsadv_register_ops)

    @property
    def available(self) -> bool:
        return self.probe.available

    def call(self, hook: str, **kwargs) -> Any:
        """Call one optional hook on this backend only; None if it does not implement it.  A plugin that exits
        (SystemExit) or raises another BaseException here raises PluginError instead of ending the program."""
        fn = getattr(self.plugin, hook, None)
        if fn is None:
            return None
        try:
            return fn(**kwargs)          # (not guarded: opsadv_activate configures the process on purpose)
        except (KeyboardInterrupt, Exception):
            raise
        except BaseException as e:          # SystemExit, GeneratorExit, ...: never the plugin's call to make
            raise PluginError(f"opsadv plugin {self.name}: {hook} raised {type(e).__name__}: {e}") from e


class _ImplSink:
    """What `opsadv_register_kernels` receives: collects impls of one backend and checks them."""

    def __init__(self, backend: str, taken: set[str], own_ops: set[str] = frozenset()):
        self.backend, self._taken, self.impls = backend, taken, []
        self._own_ops = own_ops           # ops this plugin defines (opsadv_register_ops)

    def add(self, impl: KernelImpl) -> None:
        if not isinstance(impl, KernelImpl):
            raise TypeError(f"registry.add expects a KernelImpl, got {type(impl).__name__}")
        if impl.op not in OPS and impl.op not in self._own_ops:
            raise ValueError(f"impl {impl.id!r}: unknown op {impl.op!r}; ops are {[*OPS, *sorted(self._own_ops)]}")
        if impl.backend != self.backend:
            raise ValueError(f"impl {impl.id!r} says backend {impl.backend!r} but is registered by {self.backend!r}")
        if impl.id in self._taken:
            raise ValueError(f"impl id {impl.id!r} is registered twice")
        self._taken.add(impl.id)
        self.impls.append(impl)


def _process_globals() -> dict[str, Any]:
    return {"default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
            "threads": torch.get_num_threads(), "environment": dict(os.environ),
            "warning filters": list(warnings.filters)}


def _restore(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Put back torch's globals and the environment variables that existed before (a user's settings); what a
    plugin added (variables, warning filters: vendor stacks set their own at import) stays, and is reported."""
    torch.set_default_dtype(saved["default dtype"])
    torch.set_grad_enabled(saved["grad mode"])
    if now["threads"] != saved["threads"]:
        torch.set_num_threads(saved["threads"])
    env, old = now["environment"], saved["environment"]
    for k, v in old.items():
        if env.get(k) != v:
            os.environ[k] = v
    notes = [k for k in ("default dtype", "grad mode", "threads") if now[k] != saved[k]]
    if any(env.get(k) != v for k, v in old.items()):
        notes.append("environment (restored)")
    added = sorted(set(env) - set(old))
    if added:
        notes.append(f"environment: added {', '.join(added)} (kept)")
    if now["warning filters"] != saved["warning filters"]:
        notes.append("warning filters (kept)")
    return notes


_side_effects: list[str] = []            # "plugin: what it changed", in load order


@contextmanager
def _guarded_globals(plugin: str, stage: str):
    """Process globals a plugin must not change while it loads: torch's default dtype, grad mode and thread count
    and the user's environment variables are put back; every change is recorded and warned about."""
    saved = _process_globals()
    try:
        yield
    finally:
        now = _process_globals()
        if any(now[k] != saved[k] for k in saved):
            notes = _restore(saved, now)
            what = f"{plugin}: {stage} changed {'; '.join(notes)}"
            _side_effects.append(what)
            if any("kept" not in n for n in notes):      # something was put back: the plugin misbehaved
                warnings.warn(f"opsadv: plugin {what}", RuntimeWarning, stacklevel=3)
            else:
                log.info("plugin %s", what)


def side_effects() -> list[str]:
    """What plugins changed in the process's globals at load time and opsadv put back."""
    return list(_side_effects)


def _env_flag(name: str) -> bool:
    return env_bool(name)


PROBE_TIMEOUT_S = 5.0


def probe_timeout() -> float | None:
    """The time a plugin's opsadv_probe may take: $OPSADV_PROBE_TIMEOUT seconds (default PROBE_TIMEOUT_S); 0 or
    "off": no limit (the probe runs in the caller's thread)."""
    raw = os.environ.get("OPSADV_PROBE_TIMEOUT")
    if raw is None or not raw.strip():
        return PROBE_TIMEOUT_S
    if raw.strip().lower() == "off":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise EnvVarError("OPSADV_PROBE_TIMEOUT", raw, "a number of seconds >= 0 (0 or off: no limit)")
    return value or None


def _probe(plugin: Any, name: str, env: EnvInfo, limit: float | None) -> Any:
    """plugin.opsadv_probe(env=env), in a daemon thread given `limit` seconds: a probe that hangs (a driver call, a
    network mount) costs start-up that long and is then a TimeoutError (the thread is left to finish on its own)."""
    if limit is None:
        return plugin.opsadv_probe(env=env)
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def run():
        torch.set_grad_enabled(grad)           # grad mode is per thread: the probe sees the caller's
        try:
            box["result"] = plugin.opsadv_probe(env=env)
        except BaseException as e:              # SystemExit too: raised again in the caller's thread
            box["error"] = e
        box["grad"] = torch.is_grad_enabled()

    worker = threading.Thread(target=run, name=f"opsadv-probe-{name}", daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise TimeoutError(f"opsadv_probe did not return within {limit:g} s (OPSADV_PROBE_TIMEOUT); "
                           "left running in a background thread")
    torch.set_grad_enabled(box["grad"])        # a probe that switched grad mode did it to the caller (then put back)
    if "error" in box:
        raise box["error"]
    return box["result"]


class Registry:
    """All backends seen in this process.  Built lazily, once; `reset_registry()` rebuilds."""

    def __init__(self, env: EnvInfo | None = None):
        self.env = env or current_env()
        self.backends: dict[str, BackendRecord] = {}
        self.failures: list[PluginFailure] = []
        self.impls_by_op: dict[str, list[KernelImpl]] = {op: [] for op in OPS}     # plugins' ops join at discovery
        self._ids: set[str] = set()
        self._offered: list[tuple[str, Profile]] = []
        self.strict = _env_flag("OPSADV_STRICT_PLUGINS")
        self.probe_timeout = probe_timeout()

    # -- loading -------------------------------------------------------------------------
    def load_all(self) -> None:
        for module in BUILTIN_BACKENDS:
            if importlib.util.find_spec(module) is None:
                continue
            self._load(module, "builtin", "", lambda m=module: importlib.import_module(m))
        if _env_flag("OPSADV_DISABLE_PLUGIN_AUTOLOAD"):
            return
        allow = os.environ.get("OPSADV_PLUGINS")
        allowed = None if allow is None else {s.strip() for s in allow.split(",") if s.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                log.info("plugin %s skipped: not in OPSADV_PLUGINS", ep.name)
                continue
            dist = getattr(ep, "dist", None)
            version = getattr(dist, "version", "") if dist else ""
            self._load(ep.name, f"entry point {getattr(dist, 'name', ep.value)}", version, ep.load)

    def _fail(self, name: str, version: str, stage: str, exc: BaseException) -> None:
        failure = PluginFailure(name, version, stage, f"{type(exc).__name__}: {exc}",
                                "".join(traceback.format_exception(exc)))
        if self.strict:
            raise PluginError(f"opsadv plugin {failure} (OPSADV_STRICT_PLUGINS=1)") from exc
        self.failures.append(failure)
        warnings.warn(f"opsadv: skipping plugin {failure}", RuntimeWarning, stacklevel=3)

    def _load(self, name: str, source: str, version: str, loader) -> None:
        try:
            with _guarded_globals(name, "import"):
                plugin = loader()
        except KeyboardInterrupt:
            raise
        except BaseException as e:      # SystemExit at import too: a plugin never ends the program
            return self._fail(name, version, "import", e)
        self.register_plugin(plugin, name=name, source=source, version=version)

    def register_plugin(self, plugin: Any, *, name: str | None = None, source: str = "manual",
                        version: str = "") -> BackendRecord | None:
        """Check one plugin's hooks and add it.  Public so tests and apps can register a
        backend object without packaging it."""
        name = name or getattr(plugin, "__name__", type(plugin).__name__)
        pm = pluggy.PluginManager(hookspecs.PROJECT)   # validates hook names and signatures
        pm.add_hookspecs(hookspecs.BackendSpec)
        stage = "info"
        guard = _guarded_globals(name, "registration")
        try:
            guard.__enter__()
            pm.register(plugin, name=name)
            pm.check_pending()
            info = plugin.opsadv_backend_info()
            if not isinstance(info, BackendInfo):
                raise TypeError(f"opsadv_backend_info must return BackendInfo, got {type(info).__name__}")
            version = info.version or version
            if info.api_version.split(".")[0] != API_VERSION.split(".")[0]:
                raise RuntimeError(f"written for opsadv plugin API {info.api_version}, this opsadv speaks {API_VERSION}")
            if info.name in self.backends:
                raise RuntimeError(f"backend name {info.name!r} already registered by {self.backends[info.name].source}")
            stage = "probe"
            probe = _probe(plugin, name, self.env, self.probe_timeout)
            if not isinstance(probe, ProbeResult):
                raise TypeError(f"opsadv_probe must return ProbeResult, got {type(probe).__name__}")
            record = BackendRecord(info.name, info, probe, source, plugin)
            stage = "profiles"
            offered: list[Profile] = []
            if hasattr(plugin, "opsadv_profiles"):
                for p in plugin.opsadv_profiles() or []:
                    (record.profiles if p.backend in ("", info.name) else offered).append(p)
            stage = "ops"
            defs = self._plugin_ops(plugin) if hasattr(plugin, "opsadv_register_ops") else []
            record.ops = [d.name for d in defs]
            if probe.available:
                stage = "register"
                sink = _ImplSink(info.name, set(self._ids), {d.name for d in defs})
                plugin.opsadv_register_kernels(registry=sink, env=self.env)
                record.impls = sink.impls
                stage = "timer"
                if hasattr(plugin, "opsadv_device_timer"):
                    for dt in info.device_types:
                        timer = plugin.opsadv_device_timer(device_type=dt)
                        if timer is not None:
                            record.timers[dt] = timer
        except KeyboardInterrupt:
            raise
        except BaseException as e:      # SystemExit included (see _load)
            self._fail(name, version, stage, e)
            return None
        finally:
            guard.__exit__(None, None, None)
        self.backends[info.name] = record
        new_ops = [d for d in defs if register_op(d, source=f"plugin {info.name} ({source})")]
        for d in defs:
            self.impls_by_op.setdefault(d.name, [])
        # profiles one backend offers another, whichever of the two loads first
        self._offered += [(info.name, p) for p in offered]
        record.profiles += [p for src, p in self._offered if p.backend == info.name and src != info.name]
        for other in self.backends.values():
            if other is not record:
                other.profiles += [p for p in offered if p.backend == other.name]
        if self is _registry:
            self.publish_timers()
        for impl in record.impls:
            self._add_impl(impl)
        ref = self.backends.get("reference")
        if ref is not None and ref is not record and ref.available:
            for d in new_ops:          # defined after the reference backend loaded (its hook served the earlier)
                impl = d.reference_impl()
                if impl.id not in self._ids:
                    ref.impls.append(impl)
                    self._add_impl(impl)
        return record

    def _add_impl(self, impl: KernelImpl) -> None:
        self._ids.add(impl.id)
        self.impls_by_op.setdefault(impl.op, []).append(impl)

    @staticmethod
    def _plugin_ops(plugin: Any) -> list[OpDef]:
        """The ops a plugin defines (opsadv_register_ops), checked; core's op registry takes them once the plugin
        has loaded whole (a plugin that fails later defines nothing)."""
        defs = list(plugin.opsadv_register_ops() or [])
        for d in defs:
            if not isinstance(d, OpDef):
                raise TypeError(f"opsadv_register_ops must return OpDefs, got {type(d).__name__}")
            held = get_op(d.name)
            if held is not None and held != d and held.fn is not d.fn:
                raise ValueError(f"op {d.name!r} is already defined by {op_source(d.name)}")
        if len({d.name for d in defs}) != len(defs):
            raise ValueError(f"opsadv_register_ops returned an op name twice: {[d.name for d in defs]}")
        return defs

    def publish_timers(self) -> None:
        """Hand the available backends' device timers to core.tuning (the highest auto_priority per device type)."""
        timers: dict[str, Any] = {}
        for b in sorted(self.available(), key=lambda b: (-b.info.auto_priority, b.name)):
            for dt, timer in b.timers.items():
                timers.setdefault(dt, timer)
        tuning.declare_timers(timers)

    # -- queries ---------------------------------------------------------------------------
    def side_effects(self) -> list[str]:
        """What plugins changed in the process's globals while loading (see side_effects())."""
        return side_effects()

    def available(self) -> list[BackendRecord]:
        return [b for b in self.backends.values() if b.available]

    def auto_backend(self, device_type: str | None = None) -> BackendRecord:
        """The backend "auto" names as primary: the available one with the highest
        auto_priority (ties by name), reference when nothing else is available."""
        cands = [b for b in self.available() if device_type is None or device_type in b.info.device_types]
        cands.sort(key=lambda b: (-b.info.auto_priority, b.name))
        return cands[0] if cands else self.backends["reference"]


_lock = threading.RLock()
_registry: Registry | None = None


def get_registry() -> Registry:
    global _registry
    reg = _registry
    if reg is not None:
        return reg
    with _lock:
        if _registry is None:
            reg = Registry()
            reg.load_all()
            _registry = reg
            reg.publish_timers()
        return _registry


def reset_registry(env: EnvInfo | None = None) -> Registry:
    """Rediscover plugins (after installing one, or with a faked EnvInfo in tests)."""
    global _registry
    with _lock:
        reg = Registry(env)
        reg.load_all()
        _registry = reg
        reg.publish_timers()
    hooks.registry_reset()        # dispatch forgets its memoized choices
    return reg


hooks.install_registry(get_registry)     # core reads the registry through core.hooks


def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
