"""Argument checks the linear_cross_entropy ops share (linear_cross_entropy, linear_cross_entropy_stats)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from opsadv.core.errors import InvalidArgumentError
from opsadv.core.op_common import check_same, check_tensor, dt

INT_DTYPES = (torch.int32, torch.int64)


def validate_head(op, hidden, weight, labels, bias, ignore_index, softcap) -> None:
    """hidden (..., H), weight (V, H), labels (...) int, bias (V,), ignore_index, softcap: op names the caller."""
    check_tensor(op, "hidden", hidden, min_ndim=1, allow_empty=True)
    check_tensor(op, "weight", weight, ndim=2, allow_empty=True)
    check_same(op, "hidden", hidden, weight=weight, bias=bias)
    if weight.shape[1] != hidden.shape[-1]:
        raise InvalidArgumentError(op, "weight", f"shape (V, H={hidden.shape[-1]}) (hidden is (..., H))",
                                   tuple(weight.shape))
    if not isinstance(labels, Tensor) or labels.dtype not in INT_DTYPES:
        raise InvalidArgumentError(op, "labels", "an int32 / int64 tensor",
                                   dt(labels.dtype) if isinstance(labels, Tensor) else type(labels).__name__)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise InvalidArgumentError(op, "labels", f"shape {tuple(hidden.shape[:-1])} (hidden's leading dims)",
                                   tuple(labels.shape))
    for name, t in (("weight", weight), ("labels", labels), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise InvalidArgumentError(op, name, f"on device {hidden.device} (same as hidden)", str(t.device))
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, allow_empty=True)
        if bias.shape[0] != weight.shape[0]:
            raise InvalidArgumentError(op, "bias", f"shape (V={weight.shape[0]},)", tuple(bias.shape))
    if type(ignore_index) is not int:
        raise InvalidArgumentError(op, "ignore_index", "an int", repr(ignore_index))
    if softcap is not None and (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)
                                or not (softcap > 0.0 and math.isfinite(softcap))):
        raise InvalidArgumentError(op, "softcap", "None or a finite float > 0", repr(softcap))
