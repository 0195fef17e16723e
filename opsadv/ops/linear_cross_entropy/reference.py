"""The linear_cross_entropy reference impl (the oracle): the logits materialized in float32 (float64 stays float64),
the loss as F.cross_entropy defines it, plus z-loss and softcapping, and its analytic gradients."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opsadv.core.op_common import acc, acc_dtype

FEATURES = frozenset({"bias", "label_smoothing", "z_loss", "softcap", "reduction_none", "reduction_sum"})


def logits_of(hidden, weight, bias, softcap):
    """(N, V) logits in the accumulation dtype, softcapped where asked; also the raw ones (the softcap's gradient)."""
    z = acc(hidden) @ acc(weight).t()
    if bias is not None:
        z = z + acc(bias)
    capped = softcap * torch.tanh(z / softcap) if softcap is not None else z
    return capped, z


def per_token(z, labels, ignore_index, label_smoothing, z_loss):
    """(loss per token, lse per token, valid mask): (1 - eps) nll + eps (lse - mean z) + z_loss lse^2, 0 where
    ignored."""
    valid = labels != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    tgt = z.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    loss = (1.0 - label_smoothing) * (lse - tgt)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, torch.zeros_like(loss)), lse, valid


def reduce(loss, valid, reduction):
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / valid.sum() if reduction == "mean" else total       # (mean over no valid token: nan, as torch)


def lce_fwd(ctx, hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap,
            grads_in_forward):
    z, _ = logits_of(hidden, weight, bias, softcap)
    loss, lse, valid = per_token(z, labels, ignore_index, label_smoothing, z_loss)
    out = reduce(loss, valid, reduction)
    if not grads_in_forward:
        return out, lse, *(hidden.new_empty((0,)) for _ in range(3))   # (distinct: outputs may not alias)
    dh, dw, db = lce_bwd(ctx, torch.ones((), dtype=lse.dtype, device=lse.device), hidden, weight, labels, bias, lse,
                         ignore_index, label_smoothing, reduction, z_loss, softcap)
    return out, lse, dh, dw, db if db is not None else hidden.new_empty((0,))


def dlogits(z, labels, lse, row_grad, ignore_index, label_smoothing, z_loss):
    """d loss / d z for the per-token losses weighted by row_grad (N,): softmax (1 + 2 z_loss lse) - (1 - eps) onehot
    - eps / V, zero rows where ignored."""
    valid = labels != ignore_index
    p = torch.exp(z - lse[:, None])
    dz = p * (1.0 + 2.0 * z_loss * lse)[:, None]
    if label_smoothing:
        dz = dz - label_smoothing / z.shape[-1]
    dz = dz.scatter_add(1, torch.where(valid, labels, 0)[:, None],
                        torch.full_like(lse, -(1.0 - label_smoothing))[:, None])
    w = torch.where(valid, row_grad, torch.zeros_like(row_grad))
    return dz * w[:, None]


def row_grads(grad, labels, ignore_index, reduction, dtype):
    """The upstream gradient per token: grad (N,) for "none"; grad / n_valid or grad for "mean" / "sum"."""
    if reduction == "none":
        return grad.to(dtype)
    g = grad.to(dtype).expand(labels.shape[0])
    if reduction == "mean":
        g = g / (labels != ignore_index).sum().to(dtype)
    return g


def lce_bwd(ctx, grad, hidden, weight, labels, bias, lse, ignore_index, label_smoothing, reduction, z_loss, softcap):
    z, raw = logits_of(hidden, weight, bias, softcap)
    dz = dlogits(z, labels, acc(lse), row_grads(acc(grad), labels, ignore_index, reduction, z.dtype), ignore_index,
                 label_smoothing, z_loss)
    if softcap is not None:
        dz = dz * (1.0 - torch.tanh(raw / softcap) ** 2)
    dh = (dz @ acc(weight)).to(hidden.dtype)
    dw = (dz.t() @ acc(hidden)).to(weight.dtype)
    db = dz.sum(0).to(bias.dtype) if bias is not None else None
    return dh, dw, db


def lce_plain(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap):
    """The loss in plain differentiable torch (empty calls; the tests' independent expression)."""
    z, _ = logits_of(hidden, weight, bias, softcap)
    loss = F.cross_entropy(z, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    valid = labels != ignore_index
    if z_loss:
        lse = torch.logsumexp(z, -1)
        loss = loss + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    return reduce(loss, valid, reduction)


# ---- linear_cross_entropy_stats ----------------------------------------------------------------------------------
STATS_FEATURES = frozenset({"bias", "softcap"})


def label_in_slice(labels, ignore_index, vocab_start, v):
    """(each label's row in the slice [vocab_start, vocab_start + v), 0 where it is not there; whether it is)."""
    idx = labels.long() - vocab_start
    mine = (labels != ignore_index) & (idx >= 0) & (idx < v)
    return torch.where(mine, idx, torch.zeros_like(idx)), mine


def _chunks(n, h, v):
    """Token ranges of at most C rows, C * V about 4 N H within [64, 4096] (as the Triton impls chunk): the torch
    path of the vocab-parallel loss (devices without Triton) holds one chunk's float32 logits, not the shard's."""
    target = max(1, (4 * n * h) // max(v, 1))
    c = max(1, min(n, max(64, min(4096, 1 << max(0, target - 1).bit_length()))))
    return [(s, min(n, s + c)) for s in range(0, n, c)]


def stats_fwd(ctx, hidden, weight, labels, bias, ignore_index, softcap, vocab_start):
    """(3, N): logsumexp of the slice's logits (-inf for an empty slice), the target logit where the label is in
    the slice (else 0), the sum of the logits."""
    n, v = hidden.shape[0], weight.shape[0]
    idx, mine = label_in_slice(labels, ignore_index, vocab_start, v)
    parts = []
    for s, e in _chunks(n, hidden.shape[1], v) or [(0, 0)]:
        z, _ = logits_of(hidden[s:e], weight, bias, softcap)
        tgt = z.gather(1, idx[s:e, None])[:, 0] if v else z.new_zeros(e - s)
        parts.append(torch.stack([torch.logsumexp(z, -1), torch.where(mine[s:e], tgt, torch.zeros_like(tgt)),
                                  z.sum(-1)]))
    return torch.cat(parts, 1)


def stats_bwd(ctx, grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start):
    """d / d z of grad[0] lse + grad[1] z_y + grad[2] sum z: grad[0] softmax + grad[1] onehot + grad[2]."""
    n, v = hidden.shape[0], weight.shape[0]
    adt = acc_dtype(hidden)
    g, lse = acc(grad).to(adt), acc(stats[0]).to(adt)
    idx, mine = label_in_slice(labels, ignore_index, vocab_start, v)
    dh = torch.zeros(hidden.shape, dtype=adt, device=hidden.device)
    dw = torch.zeros(weight.shape, dtype=adt, device=weight.device)
    db = torch.zeros(v, dtype=adt, device=weight.device)
    w = acc(weight)
    for s, e in _chunks(n, hidden.shape[1], v):
        z, raw = logits_of(hidden[s:e], weight, bias, softcap)
        dz = torch.exp(z - lse[s:e, None]) * g[0, s:e, None] + g[2, s:e, None]
        if v:
            dz = dz.scatter_add(1, idx[s:e, None], torch.where(mine[s:e], g[1, s:e], torch.zeros_like(g[1, s:e]))[:, None])
        if softcap is not None:
            dz = dz * (1.0 - torch.tanh(raw / softcap) ** 2)
        dh[s:e] = dz @ w
        dw += dz.t() @ acc(hidden[s:e])
        db += dz.sum(0)
    return (dh.to(hidden.dtype), dw.to(weight.dtype),
            db.to(bias.dtype) if bias is not None else hidden.new_empty((0,)))
