"""opsadv.explain(op, *args, **kwargs): why a kernel was (or would be) chosen for a call."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import dispatch
from . import ops as _ops  # noqa: F401  (registers the ops first)
from .errors import InvalidArgumentError, UnknownKeywordError
from .kernel import OPS
import importlib

# modules, not the same-named op functions that opsadv.core.ops re-exports
attention = importlib.import_module("opsadv.core.ops.attention")
gemm = importlib.import_module("opsadv.core.ops.gemm")
norm = importlib.import_module("opsadv.core.ops.norm")
sparse = importlib.import_module("opsadv.core.ops.sparse")
swiglu = importlib.import_module("opsadv.core.ops.swiglu")
rotary = importlib.import_module("opsadv.core.ops.rotary")


def _attention_buckets(mode, backward: bool, kwargs: dict[str, Any]) -> tuple[bool, bool]:
    """(train, inference) of an attention call, as the op itself routes it (attention.flash_attention,
    sparse.sparse_attention): grad-recording eager calls in the train bucket, no-grad ones that do not return lse
    in the inference bucket."""
    train = not backward and mode == _ops._common.AUTOGRAD_FN
    inference = not backward and mode == _ops._common.DIRECT and not kwargs.get("return_lse", False)
    return train, inference


def _spec_for(op: str, args: tuple, kwargs: dict[str, Any], backward: bool):
    def get(i, name, default=None):
        return args[i] if len(args) > i else kwargs.get(name, default)

    if op == "flash_attention":
        q, k, v = get(0, "q"), get(1, "k"), get(2, "v")
        mask, causal, scale = kwargs.get("attn_mask"), kwargs.get("causal", False), kwargs.get("scale")
        attention.validate(q, k, v, mask, causal, scale)
        train, inference = _attention_buckets(_ops._common.eager_mode(q, k, v, mask), backward, kwargs)
        return attention._spec(q, k, mask, causal, backward, train=train, inference=inference)
    if op == "sparse_attention":
        q, k, v, layout = get(0, "q"), get(1, "k"), get(2, "v"), get(3, "layout")
        sparse.validate(q, k, v, layout, kwargs.get("scale"))
        mode = _ops._common.eager_mode(q, k, v, layout.block_mask, layout.key_padding_mask, layout.cu_seqlens)
        return sparse.layout_spec(q, k, layout, backward, *_attention_buckets(mode, backward, kwargs))
    if op == "gemm":
        a, b = get(0, "a"), get(1, "b")
        bias, act, res, alpha = (kwargs.get("bias"), kwargs.get("activation", "none"), kwargs.get("residual"),
                                 kwargs.get("alpha", 1.0))
        gemm.validate_gemm(a, b, bias, act, res, alpha)
        if act != "none" and gemm._records_grad(a, b, bias, res):     # gemm._composed_for_training
            return gemm._gemm_spec(a, b, bias, "none", None, alpha, backward), (
                f"grad-recording call: this GEMM runs with activation 'none', then {act}"
                + (" and the residual add" if res is not None else "") + " as torch ops (z kept for the backward)")
        return gemm._gemm_spec(a, b, bias, act, res, alpha, backward)
    if op == "swiglu_gemm":
        x, w, bias = get(0, "x"), get(1, "w_gate_up"), kwargs.get("bias")
        gemm.validate_swiglu(x, w, bias)
        if gemm._records_grad(x, w, bias):
            return gemm._gemm_spec(x, w, bias, "none", None, 1.0, backward), (
                "grad-recording call: this GEMM runs alone, then the swiglu op (opsadv.explain('swiglu', gate_up))")
        return gemm._swiglu_spec(x, w, bias, backward)
    if op == "swiglu":
        gate_up = get(0, "gate_up")
        swiglu.validate_swiglu_act(gate_up)
        return swiglu._spec(gate_up, backward)
    if op in ("layer_norm", "rms_norm"):
        x, w = get(0, "x"), get(1, "weight")
        bias = get(2, "bias") if op == "layer_norm" else None
        eps = get(3 if op == "layer_norm" else 2, "eps", 1e-5)
        res, offset = kwargs.get("residual"), kwargs.get("offset", 0.0)
        norm.validate(op, x, w, bias, eps, res, offset)
        # an eager call that records gradients resolves in its own bucket (CallSpec.train)
        train = not backward and _ops._common.eager_mode(x, w, bias, res) == _ops._common.AUTOGRAD_FN
        return norm._spec(op, x, w, bias, res, backward, offset, train=train)
    if op == "rotary_embedding":
        q, k, cos, sin = get(0, "q"), get(1, "k"), get(2, "cos"), get(3, "sin")
        pos, inter = kwargs.get("position_ids"), kwargs.get("interleaved", False)
        rotary.validate(q, k, cos, sin, pos, inter, kwargs.get("rotary_dim"))
        return rotary._spec(q, k, cos, pos, inter, backward)
    raise InvalidArgumentError("explain", "op", f"one of {list(OPS)}", repr(op))


def _check_keywords(op: str, kwargs: dict[str, Any]) -> None:
    """The op raises TypeError for a keyword it does not take: explain must not silently ignore one (causl=True)."""
    fn = getattr(_ops, op, None) if op in OPS else None
    if fn is None:
        return
    import inspect
    params = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is not p.POSITIONAL_ONLY]
    for name in kwargs:
        if name not in params:
            import difflib
            v = kwargs[name]
            given = f"{name}=" + (f"<{type(v).__name__}>" if hasattr(v, "shape") else repr(v))
            near = difflib.get_close_matches(name, params, 1)
            raise UnknownKeywordError("explain", name, f"a keyword of opsadv.ops.{op} ({', '.join(params)}) or "
                                      "explain's own 'backward'",
                                      given + (f" -- did you mean {near[0]}?" if near else ""))


def explain(op: str, *args: Any, backward: bool = False, **kwargs: Any) -> dispatch.Explanation:
    """Every candidate impl for this call under the current policy, accepted or rejected, with
    reasons, and the one that would run.  Takes the op's own arguments (an unknown keyword raises
    UnknownKeywordError, a TypeError, as the op does)."""
    _check_keywords(op, kwargs)
    spec = _spec_for(op, args, kwargs, backward)
    spec, note = spec if isinstance(spec, tuple) else (spec, "")
    exp, _ = dispatch.explain_spec(spec)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if _ops._common.is_empty_call(*tensors):       # the op answers these itself (docs/conformance.md)
        return dataclasses.replace(exp, chosen=None, candidates=tuple(dataclasses.replace(c, chosen=False)
                                                                      for c in exp.candidates),
                                   why="an operand is empty: the op computes the (empty / zero) result itself in "
                                       "plain torch, and no kernel runs")
    return dataclasses.replace(exp, why=f"{exp.why}; {note}") if note else exp
