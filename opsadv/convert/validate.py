"""Numerical validation of a conversion against the original model on validation inputs.

Limits (fp32): relative error < 1e-3, and for logits KL(p_orig || p_conv) < 0.01 (mean per
token) and top-1 agreement >= 99.9%.  Half-precision models are compared with the original in
the same dtype, with relative error < 1e-2 (fp16) / 3e-2 (bf16).  A top-1 flip between two
logits closer than the measured max abs error is a tie, not a disagreement (counted apart).
Padded positions (attention_mask == 0) are excluded."""
from __future__ import annotations

from typing import Any

import torch

from opsadv.core.errors import OpsadvError

REL_LIMIT = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
KL_LIMIT = 0.01
TOP1_LIMIT = 0.999


from opsadv.core.errors import ValidationError  # noqa: E402,F401  (public in opsadv.errors)


def primary_output(out) -> tuple[torch.Tensor | None, str]:
    if isinstance(out, torch.Tensor):
        return out, "output"
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        t = getattr(out, name, None) if not isinstance(out, dict) else out.get(name)
        if isinstance(t, torch.Tensor):
            return t, name
    seq = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for t in seq:
        if isinstance(t, torch.Tensor):
            return t, "output"
    return None, "none"


def hf_validation_inputs(model, batch: int = 2, seq: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids (real vocabulary range) with a right-padded second row."""
    cfg = model.config
    vocab = getattr(cfg, "vocab_size", None) or 1000
    maxpos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or seq
    seq = max(2, min(seq, int(maxpos)))
    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(vocab), (batch, seq), generator=gen)
    am = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        am[-1, seq - seq // 3:] = 0               # right padding on the last row
    return {"input_ids": ids.to(dev), "attention_mask": am.to(dev)}


def run(model, inputs) -> Any:
    with torch.no_grad():
        if isinstance(inputs, dict):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)


def compare(ref_out, new_out, inputs, dtype: torch.dtype) -> dict[str, Any]:
    a, kind = primary_output(ref_out)
    b, _ = primary_output(new_out)
    if a is None or b is None:
        raise OpsadvError("opsadv.convert_model: validation found no tensor output to compare")
    if a.shape != b.shape:
        return {"passed": False, "output": kind, "shape_ref": tuple(a.shape), "shape_new": tuple(b.shape),
                "limits": {}}
    am = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    a64, b64 = a.detach().double(), b.detach().double()
    if am is not None and am.dim() == 2 and a.dim() >= 3 and tuple(a.shape[:2]) == tuple(am.shape):
        keep = am.bool().to(a.device)
        a64, b64 = a64[keep], b64[keep]           # (tokens, features)
    else:
        a64, b64 = a64.reshape(-1, a.shape[-1]), b64.reshape(-1, b.shape[-1])
    finite = bool(torch.isfinite(b64).all())
    diff = (b64 - a64)
    rel = (diff.norm() / a64.norm().clamp_min(1e-30)).item() if finite else float("inf")
    cos = torch.nn.functional.cosine_similarity(a64, b64, dim=-1).min().item() if finite else float("nan")
    rel_lim = REL_LIMIT.get(dtype, 3e-2)
    m: dict[str, Any] = {"output": kind, "tokens": int(a64.shape[0]), "rel_err": rel,
                         "max_abs_err": diff.abs().max().item() if finite else float("inf"), "min_cosine": cos}
    limits = {"rel_err": rel_lim}
    ok = finite and rel < rel_lim
    if kind in ("logits", "prediction_logits") and a64.shape[-1] > 1:
        lp, lq = torch.log_softmax(a64, -1), torch.log_softmax(b64, -1)
        kl = (lp.exp() * (lp - lq)).sum(-1).mean().item() if finite else float("inf")
        t1a, t1b = a64.argmax(-1), b64.argmax(-1)
        top2 = a64.topk(2, dim=-1).values if a64.shape[-1] > 1 else None
        gap = (top2[:, 0] - top2[:, 1]) if top2 is not None else torch.full_like(a64[:, 0], float("inf"))
        flips = t1a != t1b
        ties = flips & (gap <= 2 * m["max_abs_err"])
        agree = 1.0 - (flips & ~ties).double().mean().item()
        m.update(kl=kl, top1_agreement=agree, top1_ties=int(ties.sum()))
        limits.update(kl=KL_LIMIT, top1_agreement=TOP1_LIMIT)
        ok = ok and kl < KL_LIMIT and agree >= TOP1_LIMIT
    m["limits"] = limits
    m["passed"] = bool(ok)
    return m
