"""Numerical validation of a conversion against the original model on validation inputs.

Limits (fp32): relative error < 1e-3, and for logits KL(p_orig || p_conv) < 0.01 (mean per
token) and top-1 agreement >= 99.9%.  Half-precision models are compared with the original in
the same dtype, with relative error < 1e-2 (fp16) / 3e-2 (bf16).  A top-1 flip between two
logits closer than the measured max abs error is a tie, not a disagreement (counted apart).
Padded positions (attention_mask == 0) are excluded.

A half-precision model's own rounding grows with depth: a 28-layer bf16 Qwen3 differs from itself in float32 by
about as much as the bf16 limit.  So where it fits in memory (FP32_REF_MEMORY_SHARE of the device's free memory), the
original also runs once in float32 (a temporary copy), and an output over the relative limit still passes when its
error against that float32 output is at most NOISE_FACTOR x the original's own (conformance's bar) and the logits'
KL / top-1 limits hold; the metrics say which rule decided ("passed_by").

FP8 (convert_model(precision="fp8")): FP8_LIMITS, the issue's KL < 0.01 and the same top-1 agreement on logits, whose
relative error (e4m3's rounding steps of up to 2^-4 alone make it several percent) is reported, not limited;
outputs without logits are held to rel_err < FP8_REL_LIMIT."""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from opsadv.core import tuning
from opsadv.core.errors import InvalidArgumentError, OpsadvError

REL_LIMIT = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
KL_LIMIT = 0.01
NOISE_FACTOR = 3.0              # at most this many times the original's own half-precision error vs float32
FP32_REF_MEMORY_SHARE = 0.25    # the float32 copy may take this share of the device's free memory
TOP1_LIMIT = 0.999
FP8_REL_LIMIT = 0.15
# "logits_rel_err": None: logits are judged by KL and top-1 alone
FP8_LIMITS = {"rel_err": FP8_REL_LIMIT, "logits_rel_err": None, "kl": KL_LIMIT, "top1_agreement": TOP1_LIMIT}


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


def _image_size(cfg) -> tuple[int, int]:
    size = getattr(cfg, "image_size", None) or 224
    return (int(size[0]), int(size[-1])) if isinstance(size, (tuple, list)) else (int(size), int(size))


def _audio_frames(cfg) -> int:
    """Mel frames an audio encoder takes: Whisper-style encoders take exactly 2 x max_source_positions (two
    stride-2 convolutions), others any length."""
    src = getattr(cfg, "max_source_positions", None)
    return 2 * int(src) if src else 3000


_MEDIA = ("image", "video", "audio", "vision", "boi", "eoi", "boa", "eoa", "media")


def _media_tokens(cfg) -> set[int]:
    """The placeholder / delimiter token ids of a multimodal config (image_token_id, video_token_index, ...)."""
    out = set()
    for k, v in cfg.to_dict().items() if hasattr(cfg, "to_dict") else ():
        if (isinstance(v, int) and not isinstance(v, bool) and v >= 0 and any(m in k for m in _MEDIA)
                and (k.endswith("token_id") or k.endswith("token_index"))):
            out.add(v)
    return out


def hf_validation_inputs(model, batch: int = 2, seq: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs generated from a transformers model's config, by what its forward takes (`main_input_name`):
    token ids (real vocabulary range) with a right-padded last row; `pixel_values` (vision: channels x
    image_size^2); `input_features` (audio: mel bins x the frames the encoder takes); for encoder-decoder models
    also `decoder_input_ids` (starting with the decoder start token; another length than the encoder's).
    Any other input kind raises InvalidArgumentError naming what to pass as `example_inputs`."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg    # (a multimodal model's LM config)
    main = getattr(model, "main_input_name", "input_ids")
    dev = next(model.parameters()).device
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(getattr(cfg, "vocab_size", None) or getattr(text, "vocab_size", None) or 1000)
    maxpos = (getattr(cfg, "max_position_embeddings", None) or getattr(text, "max_position_embeddings", None)
              or getattr(cfg, "n_positions", None) or seq)
    seq = max(2, min(seq, int(maxpos)))
    out: dict[str, torch.Tensor] = {}
    if main == "input_ids":
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        media = _media_tokens(cfg)                   # text only: a media placeholder token asks for its media input
        if media:
            plain = next((t for t in range(vocab) if t not in media), 0)
            ids[torch.isin(ids, torch.tensor(sorted(media)))] = plain
        am = torch.ones(batch, seq, dtype=torch.long)
        if batch > 1:
            am[-1, seq - seq // 3:] = 0               # right padding on the last row
        out.update(input_ids=ids, attention_mask=am)
    elif main == "pixel_values":
        h, w = _image_size(cfg)
        out["pixel_values"] = torch.randn(batch, int(getattr(cfg, "num_channels", 3)), h, w, generator=gen).to(dtype)
    elif main == "input_features":
        mels = int(getattr(cfg, "num_mel_bins", None) or getattr(cfg, "feature_size", 80))
        out["input_features"] = torch.randn(batch, mels, _audio_frames(cfg), generator=gen).to(dtype)
    else:
        raise InvalidArgumentError(
            "convert_model", "example_inputs", f"inputs for {type(model).__name__} (a kwargs dict with its "
            f"'{main}'): opsadv generates token ids, pixel_values and input_features only", None)
    if getattr(cfg, "is_encoder_decoder", False):
        dec_max = getattr(cfg, "max_target_positions", None) or maxpos
        dec = max(2, min(seq // 2 + 1, int(dec_max)))
        dec = dec if dec != seq else dec - 1          # validation masks by the encoder's mask only at its length
        start = getattr(cfg, "decoder_start_token_id", None)
        dids = torch.randint(0, vocab, (batch, dec), generator=gen)
        if start is not None and 0 <= int(start) < vocab:
            dids[:, 0] = int(start)
        out["decoder_input_ids"] = dids
    return {k: v.to(dev) for k, v in out.items()}


def run(model, inputs) -> Any:
    with torch.no_grad():
        if isinstance(inputs, dict):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)


def check_run(model, inputs) -> Any:
    """run() for a correctness check: validation inputs are not the shapes the model will run, so nothing is
    tuned for them (core.tuning.deferred: cached measurements still decide; the real shapes' first calls tune)."""
    with tuning.deferred():
        return run(model, inputs)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _as_fp32(inputs):
    cast = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t   # noqa: E731
    if isinstance(inputs, dict):
        return {k: cast(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(cast(v) for v in inputs)
    return cast(inputs)


def fp32_reference(model, inputs) -> tuple[Any, str]:
    """(the original model's outputs computed in float32 by a temporary copy, "") or (None, why not)."""
    params = list(model.parameters()) + list(model.buffers())
    if not params:
        return None, "the model has no parameters"
    need = sum(p.numel() for p in params if p.is_floating_point()) * 6     # the copy, then its float32 tensors
    free = _free_bytes(params[0].device)
    if need > FP32_REF_MEMORY_SHARE * free:
        return None, (f"a float32 copy ({need / 2**30:.1f} GiB) would take more than {FP32_REF_MEMORY_SHARE:.0%} of "
                      f"the free memory ({free / 2**30:.1f} GiB)")
    if any(p.device.type == "meta" for p in params) or len({p.device for p in params}) > 1:
        return None, "the model is offloaded or spread over devices"
    try:
        m32 = copy.deepcopy(model).float()
        try:
            return check_run(m32, _as_fp32(inputs)), ""
        finally:
            del m32
    except Exception as e:          # noqa: BLE001 - the float32 reference is an aid: its failure only loses the aid
        return None, f"the float32 copy failed: {type(e).__name__}: {str(e)[:200]}"


def _rows(out, inputs) -> tuple[torch.Tensor | None, str]:
    """The primary output as float64 (tokens, features) rows, padded positions left out."""
    a, kind = primary_output(out)
    if a is None:
        return None, kind
    am = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    a64 = a.detach().double()
    if am is not None and am.dim() == 2 and a.dim() >= 3 and tuple(a.shape[:2]) == tuple(am.shape):
        return a64[am.bool().to(a.device)], kind
    return a64.reshape(-1, a.shape[-1]), kind


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def within_own_rounding(metrics: dict, ref_out, new_out, ref32_out, inputs) -> dict:
    """metrics (a failed half-precision comparison) judged again against the original's float32 output: passes where
    only the relative limit failed and the conversion's error vs float32 is at most NOISE_FACTOR x the original's own."""
    a, _ = _rows(ref_out, inputs)
    b, _ = _rows(new_out, inputs)
    c, _ = _rows(ref32_out, inputs)
    if a is None or b is None or c is None or not (a.shape == b.shape == c.shape):
        return metrics
    own, conv = _rel(a, c), _rel(b, c)
    m = dict(metrics, orig_rel_err_vs_fp32=own, rel_err_vs_fp32=conv)
    lim = metrics.get("limits", {})
    others_ok = all(metrics.get(k) is not None and (metrics[k] < v if k == "kl" else metrics[k] >= v)
                    for k, v in lim.items() if k != "rel_err")
    if bool(torch.isfinite(b).all()) and others_ok and conv <= NOISE_FACTOR * own:
        m["passed"] = True
        m["passed_by"] = (f"error vs the float32 original {conv:.3g} <= {NOISE_FACTOR:g}x the original's own "
                          f"{own:.3g}")
    return m


CHUNK_ELEMENTS = 1 << 25        # float64 values per chunk of rows compared at once (256 MiB; a few such temporaries)


def compare(ref_out, new_out, inputs, dtype: torch.dtype, limits: dict | None = None) -> dict[str, Any]:
    """The metrics of new_out against ref_out and whether they pass: the dtype's limits, or `limits`
    (FP8_LIMITS) where given.  Computed in float64 a chunk of rows at a time, so that a large batch's logits (32 x
    256 tokens x a 128k vocabulary: 8 GiB per float64 copy) never exist whole in float64."""
    lim = limits or {}
    a, kind = primary_output(ref_out)
    b, _ = primary_output(new_out)
    if a is None or b is None:
        raise OpsadvError("opsadv.convert_model: validation found no tensor output to compare")
    if a.shape != b.shape:
        return {"passed": False, "output": kind, "shape_ref": tuple(a.shape), "shape_new": tuple(b.shape),
                "limits": {}}
    am = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    width = a.shape[-1] if a.dim() else 1
    a2, b2 = a.detach().reshape(-1, width), b.detach().reshape(-1, width)
    rows = None                                   # all rows, else the real tokens' (padding excluded)
    if am is not None and am.dim() == 2 and a.dim() >= 3 and tuple(a.shape[:2]) == tuple(am.shape):
        rows = am.bool().to(a.device).reshape(-1).nonzero().squeeze(1)
    n = a2.shape[0] if rows is None else rows.numel()
    logits = kind in ("logits", "prediction_logits") and width > 1
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    finite, sq_diff, sq_ref, max_abs, min_cos, kl_sum = True, 0.0, 0.0, 0.0, float("inf"), 0.0
    flips, gaps = [], []
    for i in range(0, n, step):
        sel = slice(i, i + step) if rows is None else rows[i:i + step]
        x, y = a2[sel].double(), b2[sel].double()
        if not bool(torch.isfinite(y).all()):
            finite = False
            break
        d = y - x
        sq_diff += d.square().sum().item()
        sq_ref += x.square().sum().item()
        max_abs = max(max_abs, d.abs().max().item())
        min_cos = min(min_cos, torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item())
        if logits:
            lp, lq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
            kl_sum += (lp.exp() * (lp - lq)).sum().item()
            top2 = x.topk(2, dim=-1).values
            flips.append(x.argmax(-1) != y.argmax(-1))
            gaps.append(top2[:, 0] - top2[:, 1])
    rel = (sq_diff ** 0.5 / max(sq_ref ** 0.5, 1e-30)) if finite else float("inf")
    rel_lim = lim.get("rel_err", REL_LIMIT.get(dtype, 3e-2))
    m: dict[str, Any] = {"output": kind, "tokens": int(n), "rel_err": rel,
                         "max_abs_err": max_abs if finite else float("inf"),
                         "min_cosine": min_cos if finite and n else float("nan")}
    if logits and "logits_rel_err" in lim:
        rel_lim = lim["logits_rel_err"]
    limits = {"rel_err": rel_lim} if rel_lim is not None else {}
    ok = finite and (rel_lim is None or rel < rel_lim)
    if logits:
        if finite and n:
            flip, gap = torch.cat(flips), torch.cat(gaps)
            ties = flip & (gap <= 2 * max_abs)    # a flip between logits closer than the error: a tie
            agree = 1.0 - (flip & ~ties).double().mean().item()
            kl, n_ties = kl_sum / n, int(ties.sum())
        else:
            kl, agree, n_ties = (float("inf"), 0.0, 0) if not finite else (0.0, 1.0, 0)   # (non-finite: nothing agrees)
        m.update(kl=kl, top1_agreement=agree, top1_ties=n_ties)
        kl_lim, top1_lim = lim.get("kl", KL_LIMIT), lim.get("top1_agreement", TOP1_LIMIT)
        limits.update(kl=kl_lim, top1_agreement=top1_lim)
        ok = ok and kl < kl_lim and agree >= top1_lim
    m["limits"] = limits
    m["passed"] = bool(ok)
    return m
