"""Precision policy per op class (the seed's `precision` parameter)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError

_NAMES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "float32": torch.float32, "tf32": torch.float32}


def parse_dtype(value, *, where: str = "precision", arg: str = "precision") -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    raise InvalidArgumentError(where, arg, f"one of {sorted(set(_NAMES))} or a torch.dtype", repr(value))


@dataclass(frozen=True)
class PrecisionPolicy:
    """How each op class computes.  `matmul`: "tf32" | "fp16" | "bf16" | "fp32" (fp32 inputs of
    GEMMs); `attention`: compute dtype for attention on fp32 inputs ("fp32" keeps them, which
    rules out the tensor-core kernels); `norm`: statistics dtype (always "fp32" or "fp64");
    `softmax`: "fp32" | "bf16" accumulation of the softmax."""

    matmul: str = "fp32"
    attention: str = "fp32"
    norm: str = "fp32"
    softmax: str = "fp32"

    _ALLOWED = {"matmul": ("tf32", "fp16", "bf16", "fp32"), "attention": ("fp16", "bf16", "fp32"),
                "norm": ("fp32", "fp64"), "softmax": ("fp32", "bf16")}

    def __post_init__(self):
        for name, allowed in self._ALLOWED.items():
            v = getattr(self, name)
            if v not in allowed:
                raise InvalidArgumentError("PrecisionPolicy", name, f"one of {list(allowed)}", repr(v))

    @classmethod
    def from_string(cls, s: "str | PrecisionPolicy | None") -> "PrecisionPolicy":
        """"fp16" / "bf16" / "fp32" / "tf32" shorthands used by Optimizer and the CLI."""
        if s is None:
            return cls()
        if isinstance(s, PrecisionPolicy):
            return s
        if not isinstance(s, str) or s.lower() not in ("fp16", "bf16", "fp32", "tf32"):
            raise InvalidArgumentError("precision", "precision",
                                       "'fp16', 'bf16', 'fp32', 'tf32' or a PrecisionPolicy", repr(s))
        s = s.lower()
        if s == "fp32":
            return cls()
        if s == "tf32":
            return cls(matmul="tf32")
        return cls(matmul=s, attention=s, norm="fp32", softmax="fp32")
