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
  (current scaling), runs this op, saves the fp8 tensors and descales (half the memory of bf16) and back-propagates
  the gradient of exact attention at the point the forward evaluated (the dequantized inputs), passed straight
  through the quantization to the high-precision inputs.  Its backward= keyword picks how:
    "fp8"   this op's backward (impl.backward; the cuda backend's Triton kernel recomputes QK^T in FP8 and runs the
            other GEMMs in the gradients' bf16 / fp16 with the fp8 operands exact: bwd_kernels.py says why only
            QK^T; the reference impl emulates its roundings in float32); nothing serving it raises NoKernelError
            with every impl's reasons
    "bf16"  flash_attention's backward on the dequantized inputs (bf16 / fp16 GEMMs)
    None    (default) "fp8" where an impl other than the reference serves it under the policy in force, else
            "bf16" (so the reference backend keeps flash_attention's backward)
  The choice is made per call from explain()'s resolution of the backward (explain(..., backward=True) shows it).

Semantics: the reference (reference.py) is the exact attention of the dequantized inputs.  The Triton kernel also
rounds P (softmax probabilities, times 256) to e4m3 for its FP8 P @ V: an extra relative error of order 2^-5 on
the output, bounded in tests/test_fp8_attention.py and stated in docs/fp8.md; lse is not affected (the row sums
are of the unrounded P).

Impl contract:
  fn(ctx, q, k, v, q_descale, k_descale, v_descale, causal, scale: float, out_dtype) -> (out, lse)
  backward(ctx, dout, q, k, v, q_descale, k_descale, v_descale, out, lse, causal, scale: float) -> (dq, dk, dv):
    gradients with respect to the dequantized q, k, v, in dout's dtype (the backward CallSpec's dtype)
CallSpec: dtype = out_dtype; features: causal, gqa, cross_length, q_descale_{tensor,head,kv_head},
k_descale_{tensor,head}, v_descale_{tensor,head}; head_dim; bucket (s_q<=, s_k<=, batch*heads<=).

Conformance cases keep the fp8 tensors and their descales as built (Case.kept); the case dtype is the out_dtype.
The op's floors (TOLERANCE) allow the kernel's P rounding."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch, hooks
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError, NoKernelError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import TOLERANCE as _DEFAULT_TOLERANCE, OpDef, Reference, arg
from opsadv.core.op_common import (TORCH_OPS, carry_policy, check_scale, check_tensor, dt, eager_mode, is_compiling,
                                   len_bucket)
from opsadv.core.policy import current_policy, in_scope, op_scope
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


def _key(q, k, causal, kinds, out_dtype, backward: bool = False) -> tuple:
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    return (OP, backward, device_key(q), d, causal, kinds, out_dtype, hq // hk, sq != sk, len_bucket(sq),
            len_bucket(sk), len_bucket(b * hq))


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


def _bwd_route(dout, q, k, v, qd, kd, vd, out, lse, causal, scale, kinds):
    s = default_scale(q.shape[-1], scale)
    dtype = dout.dtype
    return dispatch.call(_key(q, k, causal, kinds, dtype, True), lambda: _spec(q, k, causal, kinds, dtype, True),
                         (dout, q, k, v, qd, kd, vd, out, lse, causal, s))


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


# ---- training: quantize on the fly; backward FP8 (this op's impl.backward) or bf16 (flash_attention's) ---------
BACKWARDS = ("fp8", "bf16")
_verdicts: dict[tuple, tuple] = {}     # (policy serial, backward bucket key) -> (chosen impl or None, reasons, policy)
hooks.on_registry_reset(_verdicts.clear)    # other impls: no verdict survives a rebuilt registry


def _fp8_backward_verdict(q, k, causal: bool, kinds, dtype: torch.dtype):
    """(the impl that would serve the FP8 backward of this call under the policy in force, or None; each refused
    impl's reasons; the policy's description): explain()'s resolution of the backward bucket, memoized per policy
    and bucket (no log line, no autotune: the backward's own dispatch does those).  q, k: any tensors of the fp8
    tensors' shapes and device."""
    pol = current_policy()
    key = (pol.serial, _key(q, k, causal, kinds, dtype, True))
    v = _verdicts.get(key)
    if v is None:
        exp, r = dispatch.explain_spec(_spec(q, k, causal, kinds, dtype, True), pol)
        v = (r.impl if r is not None else None, {c.impl.id: list(c.reasons) for c in exp.candidates if not c.accepted},
             pol.describe())
        if len(_verdicts) >= 4096:
            _verdicts.clear()
        _verdicts[key] = v
    return v


def _served(q, k, causal, kinds, dtype, backward: str):
    """Whether this call's backward runs this op's (FP8) backward, per fp8_attention_from_bf16's choice: "fp8":
    where any impl serves it (NoKernelError with every impl's reasons where none does); "auto": where an impl other
    than the reference serves it; "bf16": never."""
    if backward == "bf16":
        return False
    impl, reasons, pol = _fp8_backward_verdict(q, k, causal, kinds, dtype)
    if backward == "fp8" and impl is None:
        raise NoKernelError(OP + " (backward)", pol, reasons, " (fp8_attention_from_bf16(..., backward='fp8'))")
    return impl is not None and (backward == "fp8" or impl.backend != "reference")


def _train_grads(dout, q8, k8, v8, qd, kd, vd, out, lse, causal, scale, backward):
    """(dq, dk, dv) in dout's dtype: this op's backward or flash_attention's on the dequantized inputs
    (fp8_attention_from_bf16's backward=)."""
    if q8.numel() == 0 or k8.numel() == 0:     # no score: zero (or empty) gradients, no kernel
        return tuple(torch.zeros(t.shape, dtype=dout.dtype, device=dout.device) for t in (q8, k8, v8))
    kinds = _kinds(q8, k8, v8, qd, kd, vd)
    if _served(q8, k8, causal, kinds, dout.dtype, backward):
        return _bwd_route(dout, q8, k8, v8, qd, kd, vd, out, lse, causal, scale, kinds)
    q, k, v = (dequantize_heads(x8, d, dout.dtype) for x8, d in ((q8, qd), (k8, kd), (v8, vd)))
    return torch.ops.opsadv.flash_attention_backward(dout, q, k, v, out, lse, None, causal, scale, False, op_scope())


@torch.library.custom_op("opsadv::fp8_attention_backward", mutates_args=())
def _fp8_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor,
                            v_descale: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: Optional[float],
                            backward: str = "auto", scope: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """fp8_attention_from_bf16's backward as one op (compile / export see it whole): (dq, dk, dv) in dout's dtype.
    backward: "fp8", "bf16" or "auto" (fp8_attention_from_bf16's None)."""
    with in_scope(scope):
        dq, dk, dv = _train_grads(dout, q, k, v, q_descale, k_descale, v_descale, out, lse, causal, scale, backward)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_fp8_attention_backward.register_fake
def _(dout, q, k, v, q_descale, k_descale, v_descale, out, lse, causal, scale, backward="auto", scope=0):
    return tuple(dout.new_empty(t.shape) for t in (q, k, v))


def _train_setup(ctx, inputs, output):
    q, k, v, causal, scale, granularity, backward = inputs
    ctx.causal, ctx.scale, ctx.dtype, ctx.backward = causal, scale, q.dtype, backward


def _train_backward(ctx, dout, dlse):
    q8, k8, v8, qd, kd, vd, out, lse = ctx.saved_tensors
    dout = dout.to(ctx.dtype)
    args = (dout, q8, k8, v8, qd, kd, vd, out, lse, ctx.causal, ctx.scale, ctx.backward)
    if eager_mode(*args[:9]) != TORCH_OPS:      # eager: no torch.library boundary
        dq, dk, dv = _train_grads(*args)
    else:
        dq, dk, dv = torch.ops.opsadv.fp8_attention_backward(*args, op_scope())
    return dq, dk, dv, None, None, None, None


_setup, _backward = carry_policy(_train_setup, _train_backward)     # the backward resolves under the forward's policy


class _FP8AttentionTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, granularity, backward):
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, granularity)
        out, lse = fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, scale=scale, return_lse=True,
                                 out_dtype=q.dtype)
        ctx.save_for_backward(q8, k8, v8, qd, kd, vd, out, lse)     # fp8 + descales: half of bf16's bytes
        ctx.mark_non_differentiable(lse)
        _setup(ctx, (q, k, v, causal, scale, granularity, backward), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


TRAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_attention_from_bf16(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                            return_lse: bool = False, granularity: str = "head", backward: str | None = None):
    """Attention of bf16 (fp16, fp32) q, k, v through the FP8 forward, differentiable: q, k, v are quantized to
    e4m3 per (batch, head) (granularity "head"; or "tensor") from this call's amax (current scaling), fp8_attention
    computes out in q's dtype, and the gradients of the dequantized attention pass straight through the
    quantization to q, k, v.  backward: "fp8" (this op's backward: FP8 QK^T recomputation on the cuda backend;
    NoKernelError with every reason where nothing serves it), "bf16" (flash_attention's backward on the dequantized
    inputs) or None: "fp8" where an impl other than the reference serves it, else "bf16" (module docstring)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(OP, name, t, ndim=4, dtypes=TRAIN_DTYPES, allow_empty=True)
    _attn_validate(q, k, v, None, causal, scale)
    if granularity not in ("head", "tensor"):
        raise InvalidArgumentError(OP, "granularity", "'head' or 'tensor'", repr(granularity))
    if backward is not None and backward not in BACKWARDS:
        raise InvalidArgumentError(OP, "backward", "'fp8', 'bf16' or None (FP8 where a non-reference impl serves it, "
                                   "else bf16)", repr(backward))
    if backward == "fp8" and not is_compiling() and q.numel() and k.numel() and torch.is_grad_enabled() \
            and (q.requires_grad or k.requires_grad or v.requires_grad):
        _served(q, k, causal, (granularity,) * 3, q.dtype, "fp8")     # an explicit choice nothing serves raises now
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # no gradient to record: no autograd.Function (whose policy capture dynamo cannot trace in a compiled graph)
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, granularity)
        out, lse = fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, scale=scale, return_lse=True,
                                 out_dtype=q.dtype)
    else:
        out, lse = _FP8AttentionTrain.apply(q, k, v, causal, scale, granularity, backward or "auto")
    return (out, lse.detach()) if return_lse else out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    names = ("q", "k", "v", "q_descale", "k_descale", "v_descale")
    q, k, v, qd, kd, vd = (arg(args, kwargs, i, n) for i, n in enumerate(names))
    causal, scale = kwargs.get("causal", False), kwargs.get("scale")
    out_dtype = kwargs.get("out_dtype", torch.bfloat16)
    kinds = validate(q, k, v, qd, kd, vd, causal, scale, out_dtype)
    return _spec(q, k, causal, kinds, out_dtype, backward)


OPDEF = OpDef(OP, fp8_attention, Reference(_reference.fp8_attention_fwd, _reference.fp8_attention_bwd,
                                           _reference.FEATURES), explain_spec,
              custom_ops=(_fp8_attention, _fp8_attention_backward), cases=tuple(_cases.CASES), tolerance=TOLERANCE,
              description="attention of e4m3 q, k, v with per-tensor or per-(batch, head) dequantization factors "
                          "(FP8 QK^T and P V in the Triton kernel, P rounded to e4m3), GQA, bottom-right causal; "
                          "forward only to users; its backward serves fp8_attention_from_bf16's training path")
OPDEFS = (OPDEF,)
