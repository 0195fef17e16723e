"""fp8_attention: dense softmax attention of FP8 (e4m3) q, k, v with dequantization factors, forward only, plus
fp8_attention_from_bf16, the differentiable path a training step calls on its bf16 tensors.

    out = fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, scale=None,
                        return_lse=False, out_dtype=torch.bfloat16)
    out = softmax(scale * (q8 * q_descale) (k8 * k_descale)^T) (v8 * v_descale)

Why an op of its own rather than descale arguments on flash_attention (FA3's flash_attn_func(..., q_descale=...)
style): flash_attention's schema is read by the DTensor sharding rules (opsadv/distributed/rules.py), the model
conversion and its fast path, its autograd and every impl's contract; three more tensor arguments, fp8 inputs
whose output dtype is not the inputs' and no autograd of its own would have touched each of them.  Here they are
one op's business, as scaled_gemm is gemm's FP8 sibling.

- q (b, h_q, s_q, d), k / v (b, h_kv, s_k, d): float8_e4m3fn, any strides with a unit stride along d for the
  Triton kernel (it copies otherwise).  GQA / MQA when h_q is a multiple of h_kv; causal is bottom-right aligned
  (query i sees keys j <= i + s_k - s_q), as flash_attention.  e5m2 is refused: attention inputs are forward
  activations (e4m3's precision); e5m2 is the gradients' format.
- q_descale, k_descale, v_descale: float32 DEQUANTIZATION factors (x ≈ x_fp8.float() * descale: scaled_gemm's
  convention, docs/fp8.md): shape () / (1,) per tensor, or (b, h) per (batch, head) of its own tensor (k / v: per
  kv head); q_descale may also be (b, h_kv), FA3's layout, shared by the q heads of a GQA group.  Values must be
  finite and > 0 (checked for CPU tensors in eager calls).  quantize_qkv(q, k, v) makes all six.
- scale: the softmax scale, default 1 / sqrt(d) (applied on top of the descales).
- out_dtype: bfloat16 (default), float16, float32 (float64: the reference only, as an oracle).
- return_lse: also the (b, h_q, s_q) float32 natural-log row logsumexp of the scaled scores (float64 with a
  float64 out_dtype).  A row that sees no key gives zeros and lse = -inf.
- No gradients: inputs that require grad (with grad enabled) are refused.  Training goes through
  fp8_attention_from_bf16(q, k, v, ...): it quantizes bf16 / fp16 / fp32 q, k, v per (batch, head) on the fly
  (current scaling), runs this op, and back-propagates through flash_attention's backward (bf16 GEMMs) on the
  dequantized inputs: the gradient of exact attention at the point the forward evaluated, passed straight through
  the quantization to the high-precision inputs (saved as fp8 + descales: half the memory of bf16).  An FP8
  backward (dQ / dK / dV with FP8 GEMMs) is not written yet.

Semantics: the reference (reference.py) is the exact attention of the dequantized inputs.  The Triton kernel also
rounds P (softmax probabilities, times 256) to e4m3 for its FP8 P @ V: an extra relative error of order 2^-5 on
the output, bounded in tests/test_fp8_attention.py and stated in docs/fp8.md; lse is not affected (the row sums
are of the unrounded P).

Impl contract:
  fn(ctx, q, k, v, q_descale, k_descale, v_descale, causal, scale: float, out_dtype) -> (out, lse)
CallSpec: dtype = out_dtype; features: causal, gqa, cross_length, q_descale_{tensor,head,kv_head},
k_descale_{tensor,head}, v_descale_{tensor,head}; head_dim; bucket (s_q<=, s_k<=, batch*heads<=).

Conformance cases keep the fp8 tensors and their descales as built (Case.kept); the case dtype is the out_dtype.
The op's floors (TOLERANCE) allow the kernel's P rounding."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import TOLERANCE as _DEFAULT_TOLERANCE, OpDef, Reference, arg
from opsadv.core.op_common import (TORCH_OPS, carry_policy, check_scale, check_tensor, dt, eager_mode, len_bucket)
from opsadv.core.policy import in_scope, op_scope
from opsadv.ops.flash_attention import validate as _attn_validate

from . import cases as _cases, reference as _reference
from .reference import (E4M3, FMAX, dequantize_heads, descale_kind, quantize_heads,  # noqa: F401  (public helpers)
                        quantize_qkv)

OP = "fp8_attention"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Conformance floors (relative to ||oracle||): the Triton kernel rounds P to e4m3 (3 mantissa bits: a relative
# error up to 2^-4 per probability, ~2.5% rms).  With random v the output is itself an average of random vectors, as
# small as that error's own average, so the relative error does not shrink with the row length: 0.7-2.4% on the
# catalogue's and the tests' shapes under the interpreter (and ~2.5% expected at s 4096 on a GPU); 5% leaves room
# for the seeds.  float64 keeps the default rows (only the reference serves it).
TOLERANCE = {**_DEFAULT_TOLERANCE, torch.float32: (5e-2, 5e-2), torch.float16: (5e-2, 5e-2),
             torch.bfloat16: (5e-2, 5e-2)}


def default_scale(d: int, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(d)


def lse_dtype(out_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def _kinds(q, k, v, qd, kd, vd) -> tuple[str | None, str | None, str | None]:
    b, hq = q.shape[:2]
    hkv = k.shape[1]
    return descale_kind(qd, b, hq, hkv), descale_kind(kd, b, hkv), descale_kind(vd, b, hkv)


def validate(q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype) -> tuple[str, str, str]:
    """Shapes, dtypes, devices and options (no tensor value is read); returns the three descale kinds."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, Tensor) and t.dtype == torch.float8_e5m2:
            raise InvalidArgumentError(OP, name, "float8_e4m3fn (attention inputs are forward activations; e5m2 is "
                                       "the gradients' format)", "float8_e5m2")
        check_tensor(OP, name, t, ndim=4, dtypes=(E4M3,), allow_empty=True)
    b, hq, sq, d = q.shape
    if d < 1:
        raise InvalidArgumentError(OP, "q", "head_dim >= 1", f"head_dim {d}")
    if k.shape[0] != b or k.shape[3] != d:
        raise InvalidArgumentError(OP, "k", f"(batch, heads, seq, head_dim) with batch {b} and head_dim {d} (q's)",
                                   tuple(k.shape))
    if tuple(v.shape) != tuple(k.shape):
        raise InvalidArgumentError(OP, "v", f"shape {tuple(k.shape)} (k's)", tuple(v.shape))
    hkv = k.shape[1]
    if hq % hkv if hkv else hq:
        raise InvalidArgumentError(OP, "k", f"a number of heads dividing q's {hq} (GQA/MQA)", f"{hkv} heads")
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        check_tensor(OP, name, t, dtypes=(torch.float32,), allow_empty=True)
    kinds = _kinds(q, k, v, q_descale, k_descale, v_descale)
    if kinds[0] is None:
        raise InvalidArgumentError(OP, "q_descale", f"float32 of shape () or (1,) (per tensor), ({b}, {hq}) (per q "
                                   f"head) or ({b}, {hkv}) (per kv head, FA3's)", f"shape {tuple(q_descale.shape)}")
    for name, t, kind in (("k_descale", k_descale, kinds[1]), ("v_descale", v_descale, kinds[2])):
        if kind is None:
            raise InvalidArgumentError(OP, name, f"float32 of shape () or (1,) (per tensor) or ({b}, {hkv}) (per kv "
                                       "head)", f"shape {tuple(t.shape)}")
    if not isinstance(causal, bool):
        raise InvalidArgumentError(OP, "causal", "a bool", repr(causal))
    check_scale(OP, scale)
    if out_dtype not in OUT_DTYPES:
        raise InvalidArgumentError(OP, "out_dtype", f"one of {[dt(x) for x in OUT_DTYPES]}", repr(out_dtype))
    for name, t in (("k", k), ("v", v), ("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t.device != q.device:
            raise InvalidArgumentError(OP, name, f"on device {q.device} (same as q)", str(t.device))
    return kinds


def check_values(**descales) -> None:
    """The descales' values (CPU tensors only: a GPU check would sync every call)."""
    for name, s in descales.items():
        if s.device.type == "cpu" and s.numel() and not bool(((s > 0) & s.isfinite()).all()):
            bad = s[~((s > 0) & s.isfinite())].reshape(-1)[0].item()
            raise InvalidArgumentError(OP, name, "finite descales > 0 (dequantization factors: x = x_fp8 * descale)",
                                       f"a value {bad}")


def features(q, k, causal, kinds) -> frozenset[str]:
    f = {f"q_descale_{kinds[0]}", f"k_descale_{kinds[1]}", f"v_descale_{kinds[2]}"}
    f |= {n for n, on in (("causal", causal), ("gqa", q.shape[1] != k.shape[1]), ("cross_length", q.shape[2] !=
                                                                                     k.shape[2])) if on}
    return frozenset(f)


def _key(q, k, causal, kinds, out_dtype) -> tuple:
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    return (OP, device_key(q), d, causal, kinds, out_dtype, hq // hk, sq != sk, len_bucket(sq), len_bucket(sk),
            len_bucket(b * hq))


def _spec(q, k, causal, kinds, out_dtype, backward: bool = False) -> CallSpec:
    b, hq, sq, d = q.shape
    return CallSpec(OP, q.device.type, out_dtype, features(q, k, causal, kinds),
                    (len_bucket(sq), len_bucket(k.shape[2]), len_bucket(b * hq)), head_dim=d,
                    shapes=(tuple(q.shape), tuple(k.shape)), backward=backward,
                    bucket_names=("s_q<=", "s_k<=", "batch*heads<="), device_index=device_index(q))


def _route(q, k, v, qd, kd, vd, causal, scale, out_dtype, kinds):
    s = default_scale(q.shape[-1], scale)
    return dispatch.call(_key(q, k, causal, kinds, out_dtype), lambda: _spec(q, k, causal, kinds, out_dtype),
                         (q, k, v, qd, kd, vd, causal, s, out_dtype))


@torch.library.custom_op("opsadv::fp8_attention", mutates_args=())
def _fp8_attention(q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
                   causal: bool, scale: Optional[float], out_dtype: torch.dtype,
                   scope: int = 0) -> tuple[Tensor, Tensor]:
    """(out, lse).  scope: the converted model's scope id (core.policy)."""
    with in_scope(scope):
        out, lse = _route(q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype,
                          _kinds(q, k, v, q_descale, k_descale, v_descale))
        return out.contiguous(), lse.contiguous()


@_fp8_attention.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype, scope=0):
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:-1], dtype=lse_dtype(out_dtype))


def _no_backward(ctx, dout, dlse):
    raise InvalidArgumentError(OP, "q", "no gradient: fp8_attention is forward only (train through "
                               "fp8_attention_from_bf16)", "a backward through fp8_attention")


_fp8_attention.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def _refuse_grad(**tensors) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t.requires_grad:
            raise InvalidArgumentError(OP, name, "a tensor that does not require grad (fp8_attention is forward only: "
                                       "train through opsadv.ops.fp8_attention.fp8_attention_from_bf16)",
                                       "requires_grad=True")


def _empty_result(q, k, v, qd, kd, vd, causal, scale, out_dtype):
    """batch, heads, s_q or s_k of 0: the reference's plain torch gives the empty / zero result."""
    return _reference.fp8_attention_fwd(None, q, k, v, qd, kd, vd, causal, default_scale(q.shape[-1], scale),
                                        out_dtype)


def fp8_attention(q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor, *,
                  causal: bool = False, scale: float | None = None, return_lse: bool = False,
                  out_dtype: torch.dtype = torch.bfloat16):
    """softmax(scale * (q8 q_descale) (k8 k_descale)^T) (v8 v_descale) of e4m3 q, k, v (b, h, s, d) with float32
    dequantization factors per tensor or per (batch, head) (module docstring).  Returns out (b, h_q, s_q, d) in
    out_dtype, or (out, lse) with return_lse=True.  Forward only; quantize_qkv makes the inputs;
    fp8_attention_from_bf16 is the differentiable path."""
    kinds = validate(q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype)
    _refuse_grad(q=q, k=k, v=v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    mode = eager_mode(q, k, v, q_descale, k_descale, v_descale)
    if mode != TORCH_OPS:
        check_values(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if q.numel() == 0 or k.numel() == 0:
        out, lse = _empty_result(q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype)
    elif mode != TORCH_OPS:
        out, lse = _route(q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype, kinds)
    else:
        out, lse = torch.ops.opsadv.fp8_attention(q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype,
                                                  op_scope())
    return (out, lse) if return_lse else out


# ---- training: quantize on the fly, backward through flash_attention's (bf16) backward ------------------------
def _train_setup(ctx, inputs, output):
    q, k, v, causal, scale, granularity = inputs
    ctx.causal, ctx.scale, ctx.dtype = causal, scale, q.dtype


def _train_backward(ctx, dout, dlse):
    q8, k8, v8, qd, kd, vd, out, lse = ctx.saved_tensors
    q, k, v = (dequantize_heads(x8, d, ctx.dtype) for x8, d in ((q8, qd), (k8, kd), (v8, vd)))
    dq, dk, dv = torch.ops.opsadv.flash_attention_backward(dout.to(ctx.dtype), q, k, v, out, lse, None, ctx.causal,
                                                           ctx.scale, False, op_scope())
    return dq, dk, dv, None, None, None


_setup, _backward = carry_policy(_train_setup, _train_backward)     # the backward resolves under the forward's policy


class _FP8AttentionTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, granularity):
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, granularity)
        out, lse = fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, scale=scale, return_lse=True,
                                 out_dtype=q.dtype)
        ctx.save_for_backward(q8, k8, v8, qd, kd, vd, out, lse)     # fp8 + descales: half of bf16's bytes
        ctx.mark_non_differentiable(lse)
        _setup(ctx, (q, k, v, causal, scale, granularity), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


TRAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_attention_from_bf16(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                            return_lse: bool = False, granularity: str = "head"):
    """Attention of bf16 (fp16, fp32) q, k, v through the FP8 forward, differentiable: q, k, v are quantized to
    e4m3 per (batch, head) (granularity "head"; or "tensor") from this call's amax (current scaling), fp8_attention
    computes out in q's dtype, and the backward is flash_attention's (bf16 / fp16 GEMMs) on the dequantized
    inputs, its gradients passed straight through the quantization to q, k, v (module docstring)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(OP, name, t, ndim=4, dtypes=TRAIN_DTYPES, allow_empty=True)
    _attn_validate(q, k, v, None, causal, scale)
    if granularity not in ("head", "tensor"):
        raise InvalidArgumentError(OP, "granularity", "'head' or 'tensor'", repr(granularity))
    out, lse = _FP8AttentionTrain.apply(q, k, v, causal, scale, granularity)
    return (out, lse.detach()) if return_lse else out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    names = ("q", "k", "v", "q_descale", "k_descale", "v_descale")
    q, k, v, qd, kd, vd = (arg(args, kwargs, i, n) for i, n in enumerate(names))
    causal, scale = kwargs.get("causal", False), kwargs.get("scale")
    out_dtype = kwargs.get("out_dtype", torch.bfloat16)
    kinds = validate(q, k, v, qd, kd, vd, causal, scale, out_dtype)
    return _spec(q, k, causal, kinds, out_dtype, backward)


OPDEF = OpDef(OP, fp8_attention, Reference(_reference.fp8_attention_fwd, None, _reference.FEATURES), explain_spec,
              custom_ops=(_fp8_attention,), cases=tuple(_cases.CASES), tolerance=TOLERANCE,
              description="attention of e4m3 q, k, v with per-tensor or per-(batch, head) dequantization factors "
                          "(FP8 QK^T and P V in the Triton kernel, P rounded to e4m3), GQA, bottom-right causal; "
                          "forward only (training: fp8_attention_from_bf16)")
OPDEFS = (OPDEF,)
