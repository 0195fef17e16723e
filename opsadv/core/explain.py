"""opsadv.explain(op, *args, **kwargs): why a kernel was (or would be) chosen for a call."""
from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Callable

import torch

from . import dispatch
from .errors import InvalidArgumentError, UnknownKeywordError
from .op_common import is_empty_call
from .opdef import OPS, OpDef, get_op


def _check_keywords(d: OpDef, kwargs: dict[str, Any]) -> None:
    """The op raises TypeError for a keyword it does not take: explain must not silently ignore one (causl=True)."""
    params = [n for n, p in inspect.signature(d.fn).parameters.items() if p.kind is not p.POSITIONAL_ONLY]
    module = getattr(d.fn, "__module__", "") or ""
    public = f"opsadv.ops.{d.name}" if module.startswith("opsadv.ops") else f"{module}.{d.fn.__name__}"
    for name in kwargs:
        if name not in params:
            v = kwargs[name]
            given = f"{name}=" + (f"<{type(v).__name__}>" if hasattr(v, "shape") else repr(v))
            near = difflib.get_close_matches(name, params, 1)
            raise UnknownKeywordError("explain", name, f"a keyword of {public} ({', '.join(params)}) or "
                                      "explain's own 'backward'",
                                      given + (f" -- did you mean {near[0]}?" if near else ""))


# opsadv.distributed installs this once DTensor loads: (op name, args, kwargs, backward) -> None for a call without
# DTensor arguments, else (args, kwargs) as each rank's kernel sees them (local shards) and the placements text, and
# optionally a fourth item: why no dispatched kernel runs on the call's distributed path (the table then only says
# what a call on those local shards alone would take)
_placement_planner: Callable[[str, tuple, dict, bool], Any] | None = None


def install_placement_planner(fn: Callable[[str, tuple, dict, bool], Any]) -> None:
    global _placement_planner
    _placement_planner = fn


def explain(op: str, *args: Any, backward: bool = False, **kwargs: Any) -> dispatch.Explanation:
    """Every candidate impl for this call under the current policy, accepted or rejected, with
    reasons, and the one that would run.  Takes the op's own arguments (an unknown keyword raises
    UnknownKeywordError, a TypeError, as the op does)."""
    d = get_op(op) if isinstance(op, str) else None
    if d is None:
        raise InvalidArgumentError("explain", "op", f"one of {list(OPS)}", repr(op))
    _check_keywords(d, kwargs)
    placements, no_kernel, shard_note = "", "", ""
    planned = _placement_planner(d.name, args, kwargs, backward) if _placement_planner is not None else None
    if planned is not None:      # DTensor arguments: the kernel runs on each rank's shards, as the rule placed them
        args, kwargs, placements, *rest = planned
        no_kernel = rest[0] if rest else ""
        if len(rest) > 1 and rest[1]:
            # the call runs another op on each rank's shards (args / kwargs are that op's): explain that one
            d, shard_note, no_kernel = get_op(rest[1]), no_kernel, ""
    spec = d.spec(args, kwargs, backward)
    spec, note = spec if isinstance(spec, tuple) else (spec, "")
    note = "; ".join(n for n in (shard_note, note) if n)
    exp, _ = dispatch.explain_spec(spec)
    if placements:
        exp = dataclasses.replace(exp, placements=placements)
    if no_kernel:
        return dataclasses.replace(exp, chosen=None, why=no_kernel,
                                   candidates=tuple(dataclasses.replace(c, chosen=False) for c in exp.candidates))
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    # opsadv's own ops answer a call with an empty operand themselves (docs/conformance.md); a plugin's op dispatches
    if (getattr(d.fn, "__module__", "") or "").startswith("opsadv.ops") and is_empty_call(*tensors):
        return dataclasses.replace(exp, chosen=None, candidates=tuple(dataclasses.replace(c, chosen=False)
                                                                      for c in exp.candidates),
                                   why="an operand is empty: the op computes the (empty / zero) result itself in "
                                       "plain torch, and no kernel runs")
    return dataclasses.replace(exp, why=f"{exp.why}; {note}") if note else exp
