"""Bench suite "ring": what one step of opsadv.distributed.ring_attention costs on one GPU, against our own
single-GPU flash_attention over the same chunk (no communication: the transfer of the next chunk overlaps the step,
so the step's compute is what the ring adds up).  bf16, b1, 32 heads, d128, chunks of 4k / 8k / 16k tokens.

A "diagonal" step is a rank's own chunk (causal); an "off-diagonal" step a chunk wholly in the past (full).
Forward rows time the ring's forward_step: flash_attention with return_lse, then the lse merge into float32
accumulators; peers: flash_attention (`flash_attention`, no lse) and flash_attention(return_lse=True)
(`flash_attention_lse`, the step without its merge).  Backward rows ("bwd", backward alone) time the ring's
backward_step and the dk / dv accumulation: flash_attention_backward with the given out / lse, dq added into
float32; peers: the op's backward through autograd over a kept forward graph (`flash_attention`) and
flash_attention_backward alone (`flash_attention_backward`, the step without its accumulation).  rel_err compares
out, or dk / dv (dq adds up across the timed calls).  FLOPs: 4·b·h·c²·d forward (halved on the diagonal),
backward 2.5x that."""
from __future__ import annotations

from typing import Iterator

import torch

from opsadv.distributed.lse_merge import empty_accumulators
from opsadv.distributed.ring_steps import ALL, add_kv_grads, backward_step, forward_step
from opsadv.ops.flash_attention import flash_attention

from .case import BenchCase
from .runner import rel_err

CHUNKS = (4096, 8192, 16384)
HEADS, HEAD_DIM = 32, 128
STEPS = ("diagonal", "off-diagonal")
# `opsadv bench --allow-cpu` without a GPU: tiny chunks a CPU runs in seconds (a smoke test)
CPU_QUICK = [(128, 2, 64, step, bwd) for bwd in (False, True) for step in STEPS]


def _grid(quick: bool):
    """(chunk, heads, head_dim, step, backward)"""
    if quick and not torch.cuda.is_available():
        return CPU_QUICK
    chunks = CHUNKS[:1] if quick else CHUNKS
    return [(c, HEADS, HEAD_DIM, step, bwd) for bwd in (False, True) for c in chunks for step in STEPS]


def flops(c: int, h: int, d: int, diagonal: bool, backward: bool) -> float:
    fwd = 4.0 * h * c * c * d / (2 if diagonal else 1)
    return fwd * (2.5 if backward else 1.0)


def _dk_dv(a, b) -> float:
    return rel_err(a, tuple(b)[-2:])


def cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    for c, h, d, step, bwd in _grid(quick):
        diag = step == "diagonal"
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, h, c, d, generator=g).to(dev, dtype) for _ in range(3))
        kv = torch.stack((k, v))
        block, scale = (ALL, ALL, diag), d ** -0.5
        if not bwd:
            acc_out, acc_lse = empty_accumulators(q)

            # repeated calls merge the same partial again: out stays put, lse grows by log 2 a call
            def ring_step(q=q, kv=kv, block=block, scale=scale, acc_out=acc_out, acc_lse=acc_lse):
                forward_step(q, kv, block, scale, acc_out, acc_lse)
                return acc_out

            peers = {"flash_attention": (lambda q=q, k=k, v=v, diag=diag: flash_attention(q, k, v, causal=diag)),
                     "flash_attention_lse": (lambda q=q, k=k, v=v, diag=diag:
                                             flash_attention(q, k, v, causal=diag, return_lse=True)[0])}
            compare = None
        else:
            out, lse = flash_attention(q, k, v, causal=diag, return_lse=True)
            do = torch.randn(1, h, c, d, generator=g).to(dev, dtype)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=dev)

            def ring_step(do=do, q=q, kv=kv, out=out, lse=lse, block=block, scale=scale, dq=dq, dkv=dkv):
                dk, dv = backward_step(do, q, kv, out, lse, block, scale, dq)
                add_kv_grads(dkv, block, dk, dv)
                return dk, dv

            leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
            kept = flash_attention(*leaves, causal=diag)
            peers = {"flash_attention": (lambda kept=kept, leaves=leaves, do=do:
                                         torch.autograd.grad(kept, leaves, do, retain_graph=True)),
                     "flash_attention_backward": (lambda do=do, q=q, k=k, v=v, out=out, lse=lse, diag=diag, s=scale:
                                                  torch.ops.opsadv.flash_attention_backward(do, q, k, v, out, lse,
                                                                                            None, diag, s))}
            compare = _dk_dv
        words = ["bwd" if bwd else "fwd", "bf16", "b1", f"h{h}", f"chunk{c}", f"d{d}", f"{step} step"]
        yield BenchCase(suite="ring", case=" ".join(words), opsadv=ring_step, peers=peers,
                        work=flops(c, h, d, diag, bwd), compare=compare, baseline="flash_attention")
