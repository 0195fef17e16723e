"""Bench suite "ring": what one step of opsadv.distributed.ring_attention costs on one GPU, against our own
single-GPU flash_attention over the same chunk (no communication: the transfer of the next chunk overlaps the step,
so the step's compute is what the ring adds up).  bf16, b1, 32 heads, d128, chunks of 4k / 8k / 16k tokens.

A "diagonal" step is a rank's own chunk (causal); an "off-diagonal" step a chunk wholly in the past (full).
Forward rows time the ring's forward_step: flash_attention with return_lse, then the lse merge into float32
accumulators (opsadv.ops.attention_merge_, one kernel); peers: flash_attention (`flash_attention`, no lse),
flash_attention(return_lse=True) (`flash_attention_lse`, the step without its merge) and the step with the torch
formula as the merge (`step_torch_merge`, ~8 elementwise kernels: the step before the fused merge).  "merge" rows
time attention_merge_ alone against that torch formula (`torch_merge`, the baseline), in TB/s of the fused pass's
traffic (acc_out read and written, out read, the lse rows).  Backward rows ("bwd", backward alone) time the ring's
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
from opsadv.ops.attention_merge import attention_merge_
from opsadv.ops.attention_merge.reference import merge_fwd as torch_merge
from opsadv.ops.flash_attention import flash_attention

from .case import BenchCase
from .runner import rel_err

CHUNKS = (4096, 8192, 16384)
HEADS, HEAD_DIM = 32, 128
STEPS = ("diagonal", "off-diagonal")
MERGE = "merge"             # the merge alone (forward rows only)
# `opsadv bench --allow-cpu` without a GPU: tiny chunks a CPU runs in seconds (a smoke test)
CPU_QUICK = [(128, 2, 64, step, bwd) for bwd in (False, True) for step in STEPS] + [(128, 2, 64, MERGE, False)]


def _grid(quick: bool):
    """(chunk, heads, head_dim, step, backward)"""
    if quick and not torch.cuda.is_available():
        return CPU_QUICK
    chunks = CHUNKS[:1] if quick else CHUNKS
    return ([(c, HEADS, HEAD_DIM, step, bwd) for bwd in (False, True) for c in chunks for step in STEPS]
            + [(c, HEADS, HEAD_DIM, MERGE, False) for c in chunks])


def flops(c: int, h: int, d: int, diagonal: bool, backward: bool) -> float:
    fwd = 4.0 * h * c * c * d / (2 if diagonal else 1)
    return fwd * (2.5 if backward else 1.0)


def _dk_dv(a, b) -> float:
    return rel_err(a, tuple(b)[-2:])


def merge_bytes(c: int, h: int, d: int, out_bytes: int = 2) -> float:
    """Bytes one fused merge moves: acc_out (float32) read and written, out read, acc_lse read and written, lse
    read."""
    return float(h * c * (d * (8 + out_bytes) + 12))


def _merge_case(q, k, v, c, h, d) -> BenchCase:
    """attention_merge_ of a real partial (flash_attention's out / lse of the chunk) into accumulators that already
    hold it: repeated calls leave acc_out at out (equal weights) and raise acc_lse by log 2 a call, for the op and
    for the torch formula alike."""
    out, lse = flash_attention(q, k, v, return_lse=True)
    states = []
    for _ in range(2):
        acc_out, acc_lse = empty_accumulators(q)
        acc_out.copy_(out)
        acc_lse.copy_(lse)
        states.append((acc_out, acc_lse))
    (a_out, a_lse), (t_out, t_lse) = states

    def fused(a_out=a_out, a_lse=a_lse, out=out, lse=lse):
        return attention_merge_(a_out, a_lse, out, lse)[0]

    def torch_formula(t_out=t_out, t_lse=t_lse, out=out, lse=lse):
        torch_merge(None, t_out, t_lse, out, lse)
        return t_out

    return BenchCase(suite="ring", case=f"merge bf16 b1 h{h} chunk{c} d{d}", opsadv=fused,
                     peers={"torch_merge": torch_formula}, work=merge_bytes(c, h, d), unit="TB/s",
                     baseline="torch_merge")


def cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    for c, h, d, step, bwd in _grid(quick):
        diag = step == "diagonal"
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, h, c, d, generator=g).to(dev, dtype) for _ in range(3))
        if step == MERGE:
            yield _merge_case(q, k, v, c, h, d)
            continue
        kv = torch.stack((k, v))
        block, scale = (ALL, ALL, diag), d ** -0.5
        if not bwd:
            acc_out, acc_lse = empty_accumulators(q)

            # repeated calls merge the same partial again: out stays put, lse grows by log 2 a call
            def ring_step(q=q, kv=kv, block=block, scale=scale, acc_out=acc_out, acc_lse=acc_lse):
                forward_step(q, kv, block, scale, acc_out, acc_lse)
                return acc_out

            t_out, t_lse = empty_accumulators(q)

            def step_torch_merge(q=q, k=k, v=v, diag=diag, scale=scale, t_out=t_out, t_lse=t_lse):
                out, lse = flash_attention(q, k, v, causal=diag, scale=scale, return_lse=True)
                torch_merge(None, t_out, t_lse, out, lse)
                return t_out

            peers = {"flash_attention": (lambda q=q, k=k, v=v, diag=diag: flash_attention(q, k, v, causal=diag)),
                     "flash_attention_lse": (lambda q=q, k=k, v=v, diag=diag:
                                             flash_attention(q, k, v, causal=diag, return_lse=True)[0]),
                     "step_torch_merge": step_torch_merge}
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
