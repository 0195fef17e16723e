"""The qk_norm_rotary op (opsadv.ops.qk_norm_rotary) for the cuda backend: impl "cuda.triton.qk_norm_rotary".

One launch normalizes and rotates q and k (kernels.py): a program per token reads its cos / sin row once and every
row of q and k once, and writes q' and k' once.  The backward is one persistent launch (dq, dk and per-program
float32 partial weight gradients, rstd recomputed from the saved inputs) and a fixed-order sum of the partials.
Outputs are (b, h, s, d) tensors stored as (b, s, h, d), transformers' layout, as rotary_embedding's."""
from __future__ import annotations

import torch

from opsadv.core.envvars import env_bool
from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl

from .. import triton_device_types
from ..rotary_embedding.rotary import _last_unit, _out_like, _pow2

HEAD_ELEMS = 4096          # elements of one forward (BLOCK_H heads x R/2) tile
HEAD_ELEMS_BWD = 2048      # the backward holds x and dy of a tile: half as many
PROGRAMS_PER_SM = 8        # the backward's persistent grid
_K: dict = {}


def _kernels():
    if not _K:
        from .kernels import qk_norm_rotary_bwd_kernel, qk_norm_rotary_fwd_kernel
        from ..utils import FastLaunch
        _K["fwd"] = FastLaunch(qk_norm_rotary_fwd_kernel)
        _K["bwd"] = FastLaunch(qk_norm_rotary_bwd_kernel)
    return _K


def _poison() -> bool:
    return env_bool("OPSADV_POISON_OUTPUTS")


def _tables(cos, position_ids):
    """(table strides (batch, seq), position ids tensor, its strides (batch, seq))."""
    if cos.dim() == 3:
        scb = cos.stride(0) if cos.shape[0] > 1 else 0
        scs = cos.stride(1)
    else:
        scb, scs = 0, cos.stride(0)
    if position_ids is not None:
        spb = position_ids.stride(0) if position_ids.dim() == 2 and position_ids.shape[0] > 1 else 0
        return scb, scs, position_ids, spb, position_ids.stride(-1)
    return scb, scs, cos, 0, 0


def _geometry(d: int, r: int, hq: int, hk: int, elems: int) -> tuple[int, int, int]:
    half = _pow2(r // 2)
    block_h = max(1, min(_pow2(max(hq, hk)), elems // half))
    return half, (_pow2(d - r) if d > r else 0), block_h


def qknr_fwd(ctx, q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved):
    q, k, cos, sin = _last_unit(q), _last_unit(k), _last_unit(cos), _last_unit(sin)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    b, hq, s, d = q.shape
    hk = k.shape[1]
    r = cos.shape[-1]
    poison = q.device.type == "cpu" or _poison()
    oq, ok = _out_like(q, poison), _out_like(k, poison)
    scb, scs, pos, spb, sps = _tables(cos, position_ids)
    half, pass_p2, block_h = _geometry(d, r, hq, hk, HEAD_ELEMS)
    _kernels()["fwd"][(b * s,)](
        q, k, oq, ok, q_weight, k_weight, cos, sin, pos, s, hq, hk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        oq.stride(0), oq.stride(1), oq.stride(2), ok.stride(0), ok.stride(1), ok.stride(2),
        scb, scs, spb, sps, float(eps), float(offset),
        R=r, D=d, HALF_P2=half, PASS_P2=pass_p2, BLOCK_H=block_h, INTERLEAVED=interleaved,
        HAS_POS=position_ids is not None, num_warps=4 if half * block_h <= 2048 else 8)
    return oq, ok


def qknr_bwd(ctx, gq, gk, q, k, cos, sin, q_weight, k_weight, eps, offset, position_ids, interleaved):
    gq, gk, q, k = _last_unit(gq), _last_unit(gk), _last_unit(q), _last_unit(k)
    cos, sin = _last_unit(cos), _last_unit(sin)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    b, hq, s, d = q.shape
    hk = k.shape[1]
    r = cos.shape[-1]
    t = b * s
    poison = q.device.type == "cpu" or _poison()
    dq, dk = _out_like(q, poison), _out_like(k, poison)
    sms = (getattr(getattr(ctx, "env", None), "sm_count", None) or 2) if q.is_cuda else 2
    progs = min(t, PROGRAMS_PER_SM * sms)
    per_prog = -(-t // progs)
    progs = -(-t // per_prog)
    part = torch.empty((2, progs, d), dtype=torch.float32, device=q.device)
    if poison:
        part.fill_(float("nan"))
    scb, scs, pos, spb, sps = _tables(cos, position_ids)
    half, pass_p2, block_h = _geometry(d, r, hq, hk, HEAD_ELEMS_BWD)
    _kernels()["bwd"][(progs,)](
        gq, gk, q, k, dq, dk, q_weight, k_weight, part[0], part[1], cos, sin, pos, t, s, hq, hk,
        gq.stride(0), gq.stride(1), gq.stride(2), gk.stride(0), gk.stride(1), gk.stride(2),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        scb, scs, spb, sps, float(eps), float(offset), per_prog,
        R=r, D=d, HALF_P2=half, PASS_P2=pass_p2, BLOCK_H=block_h, INTERLEAVED=interleaved,
        HAS_POS=position_ids is not None, num_warps=4 if half * block_h <= 1024 else 8)
    # a fixed-order column sum of the partials (two tensors: outputs of a custom op may not share memory)
    return dq, dk, part[0].sum(0).to(q_weight.dtype), part[1].sum(0).to(k_weight.dtype)


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.qk_norm_rotary", op="qk_norm_rotary", backend=backend, fn=qknr_fwd,
        backward=qknr_bwd, priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), features=frozenset({"interleaved", "partial",
                                                                                    "position_ids"}),
        deterministic=True, requires_interpret_or_cuda=True, memory=MEMORY_FUSED,
        description="Triton: q and k RMS-normalized per head and rotated in one launch, a program per token "
                    "(backward: one persistent launch, rstd recomputed, weight gradients as per-program partials)")]
