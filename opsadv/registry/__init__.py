"""Plugin discovery: built-in backends and third-party entry points ("opsadv.backends")."""
from .hookspecs import API_VERSION, BackendInfo, ProbeResult, hookimpl
from .manager import BackendRecord, PluginFailure, get_registry, reset_registry

__all__ = ["API_VERSION", "BackendInfo", "ProbeResult", "hookimpl", "BackendRecord",
           "PluginFailure", "get_registry", "reset_registry"]
