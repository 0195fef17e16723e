"""varlen_attention: attention of packed variable-length query segments over their own packed key segments
(chunked prefill, speculative decoding: each query chunk against its sequence's longer context), forward only.

    out = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, scale=None, return_lse=False)

FlashAttention's flash_attn_varlen_func order (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
..., causal): the max_seqlen arguments are optional here and keyword-only.
- q: (total_q, Hq, D); k, v: (total_k, Hkv, D), q's dtype, any strides (views of a packed qkv projection work).
- cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), from 0, non-decreasing, ending at total_q / total_k: sequence
  b's queries q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] attend its keys k / v[cu_seqlens_k[b]:cu_seqlens_k[b+1]].
  Empty segments (either side) are allowed.
- max_seqlen_q, max_seqlen_k: upper bounds of the segment lengths (ints), launch hints only: the Triton kernel
  sizes its tiles and its KV split count from them (default: total_q / batch and total_k).  Any value gives the
  same result; on CPU eager calls a value below the true maximum is refused as a caller bug.
- causal (default False, as FlashAttention's) is bottom-right aligned: query i of a segment with n queries and
  L keys sees keys j <= L - n + i.  A query that sees no key (L = 0, or n > L and i < n - L) gives out 0 and
  lse -inf.
- GQA / MQA by index (Hq a multiple of Hkv; query head h reads kv head h // (Hq / Hkv)); head_dim up to 256;
  scale defaults to 1 / sqrt(D); fp16 / bf16 / fp32 (float64 on the reference) with float32 arithmetic.
- Returns out (total_q, Hq, D) in q's dtype, or (out, lse) with return_lse: lse (total_q, Hq) (FlashAttention's
  varlen lse is (Hq, total_q): lse.T), float32 (float64 for float64), natural log.  No gradients: a call whose
  inputs require grad (with grad enabled) is refused.

Checks: shapes, dtypes and devices always; the values of cu_seqlens_q / cu_seqlens_k and the max_seqlen hints
only for CPU tensors in eager calls (on a GPU they would cost a device sync per call).

Impl contract:
  fn(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale: float) -> (out, lse)
  (max_seqlen_* an int or None)
out and lse contiguous, as the fakes say."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core.op_common import TORCH_OPS, check_scale, check_tensor, dt, eager_mode, len_bucket
from opsadv.core.policy import in_scope, op_scope

from . import cases as _cases, reference as _reference

OP = "varlen_attention"
_INDEX = (torch.int32,)
MAX_HEAD_DIM = 256


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, max_seqlen_q=None,
             max_seqlen_k=None) -> None:
    """Shapes, dtypes, devices and options (cheap: no tensor value is read)."""
    check_tensor(OP, "q", q, ndim=3, allow_empty=True)
    check_tensor(OP, "k", k, ndim=3, allow_empty=True)
    check_tensor(OP, "v", v, ndim=3, allow_empty=True)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise InvalidArgumentError(OP, name, f"dtype {dt(q.dtype)} (same as q)", dt(t.dtype))
    hq, d = q.shape[1:]
    hkv = k.shape[1]
    if k.shape[2] != d:
        raise InvalidArgumentError(OP, "k", f"head_dim (last dim) {d} (as q)", f"head_dim {k.shape[2]}")
    if v.shape != k.shape:
        raise InvalidArgumentError(OP, "v", f"shape {tuple(k.shape)} (same as k: total_k, Hkv, D)", tuple(v.shape))
    if not 1 <= d <= MAX_HEAD_DIM:
        raise InvalidArgumentError(OP, "q", f"head_dim in [1, {MAX_HEAD_DIM}]", f"head_dim {d}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise InvalidArgumentError(OP, "k", f"a number of kv heads dividing q's {hq} heads (GQA / MQA)",
                                   f"{hkv} kv heads")
    check_tensor(OP, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_INDEX)
    check_tensor(OP, "cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=_INDEX)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise InvalidArgumentError(OP, "cu_seqlens_k", f"shape {tuple(cu_seqlens_q.shape)} (batch + 1, as "
                                   "cu_seqlens_q)", tuple(cu_seqlens_k.shape))
    for name, t in (("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.device != q.device:
            raise InvalidArgumentError(OP, name, f"on device {q.device} (same as q)", str(t.device))
    if not isinstance(causal, bool):
        raise InvalidArgumentError(OP, "causal", "a bool", repr(causal))
    check_scale(OP, scale)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
            raise InvalidArgumentError(OP, name, "None or an int >= 0 (a bound on the segment lengths)", repr(m))


def check_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """The offsets' values and the hints against them (CPU tensors only: a GPU check would sync every call)."""
    for name, cu, total, hint, side in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "total_q"),
                                        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "total_k")):
        c = cu.tolist()
        if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
            raise InvalidArgumentError(OP, name, f"non-decreasing offsets from 0 to {side} = {total}",
                                       str(c if len(c) <= 9 else c[:4] + ["..."] + c[-4:]))
        longest = max((b - a for a, b in zip(c, c[1:])), default=0)
        if hint is not None and hint < longest:
            hname = "max_seqlen_" + name[-1]
            raise InvalidArgumentError(OP, hname, f">= the longest segment of {name} ({longest})", str(hint))


def features(q, k, causal) -> frozenset[str]:
    f = {"causal"} if causal else set()
    if q.shape[1] != k.shape[1]:
        f.add("gqa")
    return frozenset(f)


def _key(q, k, cu_seqlens_q, causal) -> tuple:
    hkv = k.shape[1]
    return (OP, device_key(q), q.dtype, q.shape[2], causal, q.shape[1] // hkv, q.shape[1] != hkv,
            len_bucket(q.shape[0]), len_bucket(k.shape[0]), len_bucket((cu_seqlens_q.shape[0] - 1) * hkv))


def _spec(q, k, cu_seqlens_q, causal, backward: bool = False) -> CallSpec:
    return CallSpec(OP, q.device.type, q.dtype, features(q, k, causal),
                    (len_bucket(q.shape[0]), len_bucket(k.shape[0]),
                     len_bucket((cu_seqlens_q.shape[0] - 1) * k.shape[1])),
                    head_dim=q.shape[2], backward=backward,
                    shapes=(tuple(q.shape), tuple(k.shape), tuple(cu_seqlens_q.shape)),
                    bucket_names=("total_q<=", "total_k<=", "batch*kv_heads<="), device_index=device_index(q))


def _route(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    out, lse = dispatch.call(_key(q, k, cu_seqlens_q, causal), lambda: _spec(q, k, cu_seqlens_q, causal),
                             (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale))
    return out if out.is_contiguous() else out.contiguous(), lse if lse.is_contiguous() else lse.contiguous()


@torch.library.custom_op("opsadv::varlen_attention", mutates_args=())
def _varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
            max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], causal: bool, scale: float,
            scope: int = 0) -> tuple[Tensor, Tensor]:
    """scope: the converted model's scope id (core.policy.op_scope)."""
    with in_scope(scope):
        return _route(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)


@_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, scope=0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


def _no_backward(ctx, dout, dlse):
    raise InvalidArgumentError(OP, "q", "no gradient: varlen_attention is forward only (inference; train with "
                               "flash_attention)", "a backward through varlen_attention")


_varlen.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def _refuse_grad(**tensors) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t.requires_grad:
            raise InvalidArgumentError(OP, name, "a tensor that does not require grad (varlen_attention is forward "
                                       "only: run it under torch.no_grad() / inference_mode, or detach)",
                                       "requires_grad=True")


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool = False,
                     scale: float | None = None, return_lse: bool = False):
    """Packed query segments over their own packed key segments (module docstring): out (q's shape), or
    (out, lse) with return_lse.  causal is bottom-right aligned; max_seqlen_q / max_seqlen_k are launch hints."""
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, max_seqlen_q, max_seqlen_k)
    _refuse_grad(q=q, k=k, v=v)
    mode = eager_mode(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if mode != TORCH_OPS and q.device.type == "cpu":
        check_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    s = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.numel() == 0 or k.numel() == 0:
        # no query row, or no key at all (every row: out 0, lse -inf)
        out = q.new_zeros(q.shape)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=lse_dtype(q.dtype))
    elif mode != TORCH_OPS:
        out, lse = _route(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, s)
    else:
        out, lse = torch.ops.opsadv.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, causal, s, op_scope())
    return (out, lse) if return_lse else out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    q, k, v, cq, ck = (arg(args, kwargs, i, n) for i, n in
                       enumerate(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")))
    causal = kwargs.get("causal", False)
    validate(q, k, v, cq, ck, causal, kwargs.get("scale"), kwargs.get("max_seqlen_q"), kwargs.get("max_seqlen_k"))
    return _spec(q, k, cq, causal, backward)


OPDEF = OpDef(OP, varlen_attention, Reference(_reference.varlen_fwd, None, _reference.FEATURES), explain_spec,
              custom_ops=(_varlen,), cases=tuple(_cases.CASES), demo=_cases.demo,
              description="variable-length attention, separate query / key segments (chunked prefill), forward only")
OPDEFS = (OPDEF,)
