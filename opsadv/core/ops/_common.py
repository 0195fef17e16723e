"""Argument checks shared by every op and backend: each raises InvalidArgumentError naming
the op, the argument, what was expected and what was given."""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def check_tensor(op: str, name: str, t, *, ndim: int | tuple[int, ...] | None = None,
                 min_ndim: int | None = None, dtypes=FLOAT_DTYPES, allow_empty: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(op, name, "a torch.Tensor", type(t).__name__)
    if ndim is not None:
        ok = t.dim() in ndim if isinstance(ndim, tuple) else t.dim() == ndim
        if not ok:
            raise InvalidArgumentError(op, name, f"a tensor of rank {ndim}", f"rank {t.dim()} (shape {tuple(t.shape)})")
    if min_ndim is not None and t.dim() < min_ndim:
        raise InvalidArgumentError(op, name, f"a tensor of rank >= {min_ndim}", f"rank {t.dim()} (shape {tuple(t.shape)})")
    if dtypes is not None and t.dtype not in dtypes:
        raise InvalidArgumentError(op, name, f"dtype in {[dt(d) for d in dtypes]}", dt(t.dtype))
    if not allow_empty and t.numel() == 0:
        raise InvalidArgumentError(op, name, "a non-empty tensor", f"shape {tuple(t.shape)} with 0 elements")


def check_same(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """Others must share ref's dtype and device."""
    for name, t in others.items():
        if t is None:
            continue
        if t.dtype != ref.dtype:
            raise InvalidArgumentError(op, name, f"dtype {dt(ref.dtype)} (same as {ref_name})", dt(t.dtype))
        if t.device != ref.device:
            raise InvalidArgumentError(op, name, f"on device {ref.device} (same as {ref_name})", str(t.device))


def check_choice(op: str, name: str, value, choices) -> None:
    if value not in choices:
        raise InvalidArgumentError(op, name, f"one of {list(choices)}", repr(value))


def check_scale(op: str, scale) -> None:
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not scale > 0 or scale != scale or scale == float("inf")):
        raise InvalidArgumentError(op, "scale", "None or a finite float > 0", repr(scale))


def len_bucket(n: int) -> int:
    """Sequence/row counts bucket to the next power of two (min 16)."""
    return 16 if n <= 16 else 1 << (n - 1).bit_length()


def empty_like_none(ref: torch.Tensor) -> torch.Tensor:
    """custom ops cannot return None: an absent tensor output is a 0-element tensor."""
    return ref.new_empty((0,))


def none_if_empty(t: torch.Tensor | None):
    return None if t is None or t.numel() == 0 else t


_Plain = (torch.Tensor, torch.nn.Parameter)


def eager_fast_path(*tensors) -> bool:
    """True when the op may skip torch.library's dispatcher and call the router directly:
    plain eager tensors, no autograd needed, no compile/export tracing, no dispatch or
    torch-function mode, no functorch transform.  Anything else takes the full torch.ops
    path (fake kernels, autograd), so semantics are identical either way."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._is_torch_function_mode_enabled() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _Plain or (grad and t.requires_grad):
            return False
    return True
