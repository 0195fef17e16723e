"""Precision policy per op class (the seed's `precision` parameter)."""
from __future__ import annotations

import difflib
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
    `softmax`: "fp32" | "bf16": the dtype of the softmax statistics (row max, sum, probabilities).
    Impls declare which fields they honour (KernelImpl.honours); explain() names those an impl ignores."""

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
    def from_string(cls, s: "str | dict | PrecisionPolicy | None") -> "PrecisionPolicy":
        """"fp16" / "bf16" / "fp32" / "tf32" shorthands used by Optimizer and the CLI, or a precision dict
        (from_dict)."""
        if s is None:
            return cls()
        if isinstance(s, PrecisionPolicy):
            return s
        if isinstance(s, dict):
            return cls.from_dict(s)
        if not isinstance(s, str) or s.lower() not in ("fp16", "bf16", "fp32", "tf32"):
            raise InvalidArgumentError("precision", "precision",
                                       "'fp16', 'bf16', 'fp32', 'tf32', a precision dict (keys "
                                       f"{sorted(DICT_KEYS)}) or a PrecisionPolicy", repr(s))
        s = s.lower()
        if s == "fp32":
            return cls()
        if s == "tf32":
            return cls(matmul="tf32")
        return cls(matmul=s, attention=s, norm="fp32", softmax="fp32")

    @classmethod
    def from_dict(cls, d: dict) -> "PrecisionPolicy":
        """The precision dict, e.g. {"matmul_precision": "medium", "attention_proj": "fp16", "layer_norm": "fp32",
        "softmax": "bf16"}: each key (DICT_KEYS) sets one field; keys left out keep the default.  Unknown keys
        and values are refused with the valid ones."""
        fields: dict[str, str] = {}
        for key, value in d.items():
            if key not in DICT_KEYS:
                near = difflib.get_close_matches(str(key), DICT_KEYS, 1)
                raise InvalidArgumentError("precision", "precision", f"a dict with keys from {sorted(DICT_KEYS)}",
                                           f"key {key!r}" + (f" -- did you mean {near[0]!r}?" if near else ""))
            field_name, values = DICT_KEYS[key]
            v = value.lower() if isinstance(value, str) else value
            if v not in values:
                raise InvalidArgumentError("precision", f"precision[{key!r}]", f"one of {list(values)}", repr(value))
            if field_name in fields and fields[field_name] != values[v]:
                raise InvalidArgumentError("precision", f"precision[{key!r}]", f"consistent with the other key for "
                                           f"{field_name!r} ({fields[field_name]!r})", repr(value))
            fields[field_name] = values[v]
        return cls(**fields)

    def changed(self) -> dict[str, str]:
        """The fields that differ from the default policy (what an impl can honour or ignore)."""
        return {f: getattr(self, f) for f in self._ALLOWED if getattr(self, f) != getattr(PrecisionPolicy(), f)}


_SAME = {"fp32": "fp32", "tf32": "tf32", "fp16": "fp16", "bf16": "bf16"}
# precision dict key -> (PrecisionPolicy field, accepted value -> field value).  matmul_precision takes torch's
# set_float32_matmul_precision names: "highest" = fp32, "high" and "medium" = TF32 tensor-core matmuls
DICT_KEYS: dict[str, tuple[str, dict[str, str]]] = {
    "matmul_precision": ("matmul", {"highest": "fp32", "high": "tf32", "medium": "tf32", **_SAME}),
    "matmul": ("matmul", {"highest": "fp32", "high": "tf32", "medium": "tf32", **_SAME}),
    "attention_proj": ("attention", {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}),
    "attention": ("attention", {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}),
    "layer_norm": ("norm", {"fp32": "fp32", "fp64": "fp64"}),
    "norm": ("norm", {"fp32": "fp32", "fp64": "fp64"}),
    "softmax": ("softmax", {"fp32": "fp32", "bf16": "bf16"}),
}

# which policy fields concern which ops, and for which input dtypes ("any": every dtype below float64)
FIELD_OPS = {"matmul": (("gemm", "swiglu_gemm"), "float32"), "attention": (("flash_attention", "sparse_attention"),
                                                                           "float32"),
             "norm": (("layer_norm", "rms_norm"), "any"), "softmax": (("flash_attention", "sparse_attention"), "any")}


def requested(policy: PrecisionPolicy, spec_op: str, dtype: torch.dtype, tile_size=None) -> dict[str, str]:
    """What a call under this policy asks of the impl beyond the defaults: {"tile_size": "64", "softmax": "bf16",
    ...} (only fields that concern this op and input dtype; float64 inputs always compute in float64)."""
    out = {"tile_size": str(tile_size)} if tile_size else {}
    for f, v in policy.changed().items():
        ops, dtypes = FIELD_OPS[f]
        if spec_op in ops and dtype != torch.float64 and (dtypes == "any" or dtype == torch.float32):
            out[f] = v
    return out


class float32_matmul_scope:
    """`with float32_matmul_scope(policy):` torch's float32 matmul precision is "high" (TF32 tensor cores) under
    matmul="tf32", restored after; other policies leave torch's own setting alone.  Process-wide while it lasts
    (torch keeps one setting), so it wraps one GEMM call, not a model."""

    __slots__ = ("on", "prev")

    def __init__(self, policy: "PrecisionPolicy | None"):
        self.on = policy is not None and policy.matmul == "tf32"

    def __enter__(self):
        if self.on:
            self.prev = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("high")

    def __exit__(self, *exc):
        if self.on:
            torch.set_float32_matmul_precision(self.prev)
