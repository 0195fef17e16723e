"""The linear_cross_entropy op (opsadv.ops.linear_cross_entropy) over chunks of tokens: impl
"<backend>.triton.linear_cross_entropy"; and linear_cross_entropy_stats (the vocab-parallel loss's per-shard work):
impl "<backend>.triton.linear_cross_entropy_stats".

Per chunk of C tokens: the logits h_c @ W^T (+ bias) by the backend's GEMM (torch.mm: cuBLAS on CUDA) into one
(C, V) buffer in the inputs' dtype, as transformers computes them before its float32 upcast; the Triton kernel
(kernels.py) turns each row into its loss and lse and, where gradients are wanted, overwrites the row with
d loss / d logits; then dh_c = dz @ W and dW += dz^T h_c (addmm into one buffer: float32 for float32 weights, the
weight's dtype for half ones, as Liger-Kernel accumulates it, so the peak stays one weight-sized gradient plus one
chunk).  Only a chunk's logits exist at a time: C is chosen so that chunk is about as large as the hidden states."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_TRITON, KernelImpl, MemoryTraits

from .. import poisoned, triton_device_types

MIN_CHUNK, MAX_CHUNK = 64, 4096      # token rows per chunk
# the chunk's logits may be this many times the hidden states (H200, 8192 x 4096 x 128256 bf16: 512-row chunks
# spent ~8 ms of 47 re-reading and re-writing the 1 GiB dW in 16 addmm steps; fewer, larger chunks do it less often)
CHUNK_FACTOR = 4
MAX_BLOCK_V = 4096                   # vocabulary columns per kernel step
_K: dict = {}


def _kernel(name: str = "ce"):
    if not _K:
        from .kernels import ce_chunk_kernel, stats_chunk_kernel, stats_grad_kernel
        _K.update(ce=ce_chunk_kernel, stats=stats_chunk_kernel, stats_grad=stats_grad_kernel)
    return _K[name]


def _block(v: int) -> int:
    return min(MAX_BLOCK_V, max(16, 1 << (v - 1).bit_length()))


def chunk_rows(n: int, h: int, v: int) -> int:
    """Token rows per chunk: a power of two with C * V about CHUNK_FACTOR * N * H (the chunk's logits a few times
    the hidden states, well below the weight's gradient), within [MIN_CHUNK, MAX_CHUNK] and at most n."""
    target = max(1, (CHUNK_FACTOR * n * h) // max(v, 1))
    c = 1 << max(0, target - 1).bit_length()
    return max(1, min(n, max(MIN_CHUNK, min(MAX_CHUNK, c))))


def _logits(h, weight, bias, out):
    if bias is not None:
        return torch.addmm(bias, h, weight.t(), out=out)
    return torch.mm(h, weight.t(), out=out)


def _ce(z, labels, rowgrad, loss, lse, ignore_index, eps, z_loss, softcap, write_grad):
    c, v = z.shape
    block = _block(v)
    rg = rowgrad if rowgrad is not None else lse           # (not read without write_grad)
    _kernel()[(c,)](z, z.stride(0), labels, rg, rg.stride(0) if rg.numel() > 1 else 0, loss, lse, v, ignore_index,
                    float(eps), float(z_loss), float(softcap or 1.0), HAS_SOFTCAP=softcap is not None,
                    WRITE_GRAD=write_grad, BLOCK_V=block, num_warps=8 if block >= 2048 else 4)


def _run(hidden, weight, labels, bias, rowgrad, ignore_index, eps, z_loss, softcap, want_grads, post=1.0):
    """(loss per token, lse, dh, dw, db): one pass over the chunks; gradients weighted by rowgrad ((N,) or (1,))
    and then by the host number `post` (float16: see _scale)."""
    n, h = hidden.shape
    v = weight.shape[0]
    c = chunk_rows(n, h, v)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    labels = labels.contiguous()
    stat = torch.empty((), dtype=torch.float32, device=hidden.device)
    loss, lse = poisoned((n,), stat), poisoned((n,), stat)
    z = poisoned((c, v), hidden)
    dh = dw = db = None
    if want_grads:
        dh = poisoned((n, h), hidden)
        dw = torch.zeros((v, h), dtype=weight.dtype, device=weight.device)
        db = torch.zeros(v, dtype=torch.float32, device=weight.device) if bias is not None else None
    for s in range(0, n, c):
        e = min(n, s + c)
        zc = z[: e - s]
        _logits(hidden[s:e], weight, bias, zc)
        rg = rowgrad if rowgrad is None or rowgrad.numel() == 1 else rowgrad[s:e]
        _ce(zc, labels[s:e], rg, loss[s:e], lse[s:e], ignore_index, eps, z_loss, softcap, want_grads)
        if want_grads:
            torch.mm(zc, weight, out=dh[s:e])
            dw.addmm_(zc.t(), hidden[s:e])
            if db is not None:
                db += zc.sum(0, dtype=torch.float32)
    if post != 1.0:
        dh.mul_(post)
        dw.mul_(post)
        if db is not None:
            db.mul_(post)
    if db is not None:
        db = db.to(bias.dtype)
    return loss, lse, dh, dw, db


def _reduce(loss, labels, ignore_index, reduction):
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / (labels != ignore_index).sum() if reduction == "mean" else total


def _scale(labels, ignore_index, reduction, dtype):
    """(the per-token gradient the kernel folds into d loss / d logits, a host factor applied to dh / dW after) for a
    loss gradient of 1: 1 / n_valid ("mean", no host read) and 1, or 1 and 1 ("sum").  float16 folds N / n_valid
    and scales by 1 / N after: d logits of about softmax / n_valid underflowed float16 (15% error in dW at 3000
    tokens x 32003)."""
    one = torch.ones(1, dtype=torch.float32, device=labels.device)
    if reduction != "mean":
        return one, 1.0
    n = labels.shape[0] if dtype == torch.float16 else 1
    return one * n / (labels != ignore_index).sum(), 1.0 / n


def lce_fwd(ctx, hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap,
            grads_in_forward):
    rowgrad, post = _scale(labels, ignore_index, reduction, hidden.dtype) if grads_in_forward else (None, 1.0)
    loss, lse, dh, dw, db = _run(hidden, weight, labels, bias, rowgrad, ignore_index, label_smoothing, z_loss, softcap,
                                 grads_in_forward, post)
    out = _reduce(loss, labels, ignore_index, reduction)
    if not grads_in_forward:
        return out, lse, *(hidden.new_empty((0,)) for _ in range(3))   # (distinct: outputs may not alias)
    return out, lse, dh, dw, db if db is not None else hidden.new_empty((0,))


def lce_bwd(ctx, grad, hidden, weight, labels, bias, lse, ignore_index, label_smoothing, reduction, z_loss, softcap):
    g = grad.float()
    post = 1.0
    if reduction == "none":
        rowgrad = g.reshape(-1).contiguous()
    else:
        scale, post = _scale(labels, ignore_index, reduction, hidden.dtype)
        rowgrad = g.reshape(1) * scale
    _, _, dh, dw, db = _run(hidden, weight, labels, bias, rowgrad, ignore_index, label_smoothing, z_loss, softcap, True,
                            post)
    return dh, dw, db if db is not None else hidden.new_empty((0,))


# ---- linear_cross_entropy_stats: (lse, target logit, logit sum) of a slice of the vocabulary -------------------
# Same chunking as above: per chunk the logits GEMM (torch.mm) into one (C, V) buffer in the inputs' dtype, then one
# kernel program per row; the forward stores three float32 numbers per token (no float32 copy of the logits), the
# backward overwrites the recomputed logits with their gradient and runs the dh / dW GEMMs on them.
def _stats_kernel(name, z, labels, *ptrs, ignore_index, vocab_start, softcap):
    c, v = z.shape
    block = _block(v)
    _kernel(name)[(c,)](z, z.stride(0), labels, *ptrs, v, ignore_index, vocab_start, float(softcap or 1.0),
                        HAS_SOFTCAP=softcap is not None, BLOCK_V=block, num_warps=8 if block >= 2048 else 4)


def _contig(hidden, weight, labels):
    return (hidden if hidden.stride(-1) == 1 else hidden.contiguous(),
            weight if weight.stride(-1) == 1 else weight.contiguous(), labels.contiguous())


def stats_fwd(ctx, hidden, weight, labels, bias, ignore_index, softcap, vocab_start):
    n, h = hidden.shape
    v = weight.shape[0]
    c = chunk_rows(n, h, v)
    hidden, weight, labels = _contig(hidden, weight, labels)
    stats = poisoned((3, n), torch.empty((), dtype=torch.float32, device=hidden.device))
    z = poisoned((c, v), hidden)
    for s in range(0, n, c):
        e = min(n, s + c)
        zc = z[: e - s]
        _logits(hidden[s:e], weight, bias, zc)
        _stats_kernel("stats", zc, labels[s:e], stats[:, s:], stats.stride(0), ignore_index=ignore_index,
                      vocab_start=vocab_start, softcap=softcap)
    return stats


def stats_bwd(ctx, grad, hidden, weight, labels, bias, stats, ignore_index, softcap, vocab_start):
    n, h = hidden.shape
    v = weight.shape[0]
    c = chunk_rows(n, h, v)
    hidden, weight, labels = _contig(hidden, weight, labels)
    grad = grad.to(torch.float32).contiguous()
    lse = stats[0].to(torch.float32).contiguous()
    z = poisoned((c, v), hidden)
    dh = poisoned((n, h), hidden)
    dw = torch.zeros((v, h), dtype=weight.dtype, device=weight.device)     # (accumulated as lce_bwd's)
    db = torch.zeros(v, dtype=torch.float32, device=weight.device) if bias is not None else None
    for s in range(0, n, c):
        e = min(n, s + c)
        zc = z[: e - s]
        _logits(hidden[s:e], weight, bias, zc)
        _stats_kernel("stats_grad", zc, labels[s:e], grad[:, s:], grad.stride(0), lse[s:], ignore_index=ignore_index,
                      vocab_start=vocab_start, softcap=softcap)
        torch.mm(zc, weight, out=dh[s:e])
        dw.addmm_(zc.t(), hidden[s:e])
        if db is not None:
            db += zc.sum(0, dtype=torch.float32)
    return dh, dw, db.to(bias.dtype) if db is not None else hidden.new_empty((0,))


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.linear_cross_entropy", op="linear_cross_entropy", backend=backend, fn=lce_fwd,
        backward=lce_bwd, priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        features=frozenset({"bias", "label_smoothing", "z_loss", "softcap", "reduction_none", "reduction_sum"}),
        requires_interpret_or_cuda=True,
        memory=MemoryTraits("fused"),             # (one chunk of logits, about the hidden states' size)
        description="chunks of tokens: the logits GEMM, a Triton cross-entropy kernel that overwrites them with their "
                    "gradient, then the dh / dW GEMMs; only one chunk's logits in memory"),
        KernelImpl(
            id=f"{backend}.triton.linear_cross_entropy_stats", op="linear_cross_entropy_stats", backend=backend,
            fn=stats_fwd, backward=stats_bwd, priority=PRIORITY_TRITON, device_types=triton_device_types(env),
            dtypes=(torch.float16, torch.bfloat16, torch.float32), features=frozenset({"bias", "softcap"}),
            requires_interpret_or_cuda=True, memory=MemoryTraits("fused"),
            description="chunks of tokens: the logits GEMM, a Triton kernel storing each row's (lse, target logit, "
                        "logit sum) of the vocabulary slice (backward: the kernel overwrites the recomputed logits "
                        "with their gradient, then the dh / dW GEMMs); only one chunk's logits in memory")]
