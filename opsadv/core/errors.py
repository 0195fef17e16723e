"""Exceptions raised by opsadv.  Every message names the op, the argument, what was
expected and what was given, so a user can fix the call without reading our source."""
from __future__ import annotations

from typing import Any


class OpsadvError(Exception):
    """Base class of every opsadv error."""


class InvalidArgumentError(OpsadvError, ValueError):
    """A call's argument is wrong (rank, shape, dtype, device, layout, option)."""

    def __init__(self, op: str, arg: str, expected: str, given: object):
        self.op, self.arg, self.expected, self.given = op, arg, expected, given
        super().__init__(f"opsadv.{op}: argument '{arg}' must be {expected}; got {given}")


class ShardingError(InvalidArgumentError, NotImplementedError):
    """A DTensor argument whose placement the op's sharding rule cannot run with (opsadv.distributed): the message
    names the op, the argument, the placements it accepts on that mesh dim and the one given, with the reason.
    A NotImplementedError too (this placement is not implemented): DTensor's dispatcher passes that class through
    as raised, where it would wrap any other exception in a RuntimeError."""


class UnknownOptionError(InvalidArgumentError):
    """An option name or value that opsadv does not know."""


class UnknownKeywordError(UnknownOptionError, TypeError):
    """A keyword argument that the function does not take (a TypeError too, as Python raises for one)."""


class EnvVarError(OpsadvError, ValueError):
    """An OPSADV_* environment variable holds a value opsadv cannot read."""

    def __init__(self, name: str, value: str, accepted: str):
        self.name, self.value, self.accepted = name, value, accepted
        super().__init__(f"opsadv: environment variable {name}={value!r} is not valid; accepted: {accepted}")


class NoKernelError(OpsadvError, RuntimeError):
    """No kernel impl could serve a call under the current policy.  `reasons` maps each
    candidate impl id to the reasons it was rejected."""

    def __init__(self, op: str, policy: str, reasons: dict[str, list[str]], detail: str = ""):
        self.op, self.policy, self.reasons = op, policy, reasons
        lines = [f"opsadv.{op}: no kernel can serve this call under {policy}{detail}."]
        if not reasons:
            lines.append("  (no impl of this op is registered by the selected backend(s))")
        for impl_id, why in reasons.items():
            lines.append(f"  {impl_id}: " + "; ".join(why))
        super().__init__("\n".join(lines))


class BackendUnavailableError(OpsadvError, RuntimeError):
    """An explicitly chosen backend is missing or its probe says it cannot run here."""

    def __init__(self, backend: str, reasons: list[str]):
        self.backend, self.reasons = backend, list(reasons)
        msg = f"opsadv backend '{backend}' is not available here"
        if reasons:
            msg += ":\n" + "\n".join(f"  - {r}" for r in reasons)
        super().__init__(msg)


class UnsafeArchiveError(OpsadvError, ValueError):
    """opsadv.load refused a .pt2 entry that loading would unpickle or execute (`.entry`, `.reason`)."""

    def __init__(self, path: str, entry: str, reason: str):
        self.path, self.entry, self.reason = path, entry, reason
        super().__init__(f"opsadv.load: refused to load {path}: entry {entry!r} {reason}. opsadv.load reads only "
                         "plain tensors; load a program you trust with torch.export.load (it runs pickled code)")


class PluginError(OpsadvError, RuntimeError):
    """A backend plugin failed to load or register (raised only in strict mode)."""


class ValidationError(OpsadvError, RuntimeError):
    """A conversion whose outputs differ from the original's beyond the limits (the numbers are in
    `.metrics`, and in the message).  The model was restored to its original modules."""

    def __init__(self, model: str, metrics: dict[str, Any]):
        self.metrics = metrics
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
                         if k not in ("limits", "passed"))
        super().__init__(f"opsadv.convert_model: refused to convert {model}: the converted model's outputs differ "
                         f"from the original's beyond the limits {metrics.get('limits')}: {nums}. "
                         "The model was left unconverted; pass validate='warn' to keep the conversion anyway.")
