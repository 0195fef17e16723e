"""The rotary_embedding op (opsadv.ops.rotary_embedding) for the cuda backend: impl "cuda.triton.rotary_embedding".

One launch rotates q and k (kernels.py): a program per token reads its cos / sin row once and every
head of q and k once, and writes q' and k' once, a memory-bound pass.  Outputs are (b, h, s, d) tensors stored
as (b, s, h, d), transformers' layout, which attention's output then keeps (cuDNN follows q's layout; the
Triton attention kernels write (b, s, h, d) memory), so the model's transpose back is free."""
from __future__ import annotations


import torch

from opsadv.core.envvars import env_bool
from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl

from .. import triton_device_types

HEAD_ELEMS = 4096          # elements of one (BLOCK_H heads x R/2) tile: BLOCK_H = HEAD_ELEMS // (R/2) heads
_K: dict = {}


def _kernel():
    if not _K:
        from .kernels import rotary_kernel
        from ..utils import FastLaunch
        _K["k"] = FastLaunch(rotary_kernel)
    return _K["k"]


def _out_like(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    strides = (s * h * d, d, h * d, 1)
    out = torch.empty_strided((b, h, s, d), strides, dtype=x.dtype, device=x.device)
    if x.device.type == "cpu" or env_bool("OPSADV_POISON_OUTPUTS"):
        out.fill_(float("nan"))          # an unwritten element shows
    return out


def _last_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _run(q, k, cos, sin, position_ids, interleaved, backward):
    q, k, cos, sin = _last_unit(q), _last_unit(k), _last_unit(cos), _last_unit(sin)
    b, hq, s, d = q.shape
    hk = k.shape[1]
    r = cos.shape[-1]
    oq, ok = _out_like(q), _out_like(k)
    if cos.dim() == 3:
        scb = cos.stride(0) if cos.shape[0] > 1 else 0
        scs = cos.stride(1)
    else:
        scb, scs = 0, cos.stride(0)
    if position_ids is not None:
        pos = position_ids
        spb = pos.stride(0) if pos.dim() == 2 and pos.shape[0] > 1 else 0
        sps = pos.stride(-1)
    else:
        pos, spb, sps = cos, 0, 0
    half = _pow2(r // 2)
    block_h = max(1, min(_pow2(max(hq, hk)), HEAD_ELEMS // half))
    pass_p2 = _pow2(d - r) if d > r else 0
    _kernel()[(b * s,)](q, k, oq, ok, cos, sin, pos, s, hq, hk,
                        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                        oq.stride(0), oq.stride(1), oq.stride(2), ok.stride(0), ok.stride(1), ok.stride(2),
                        scb, scs, spb, sps,
                        R=r, D=d, HALF_P2=half, PASS_P2=pass_p2, BLOCK_H=block_h, INTERLEAVED=interleaved,
                        HAS_POS=position_ids is not None, BACKWARD=backward, num_warps=4 if half * block_h <= 2048 else 8)
    return oq, ok


def rotary_fwd(ctx, q, k, cos, sin, position_ids, interleaved):
    return _run(q, k, cos, sin, position_ids, interleaved, False)


def rotary_bwd(ctx, gq, gk, cos, sin, position_ids, interleaved):
    return _run(gq, gk, cos, sin, position_ids, interleaved, True)


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    return [KernelImpl(
        id=f"{backend}.triton.rotary_embedding", op="rotary_embedding", backend=backend, fn=rotary_fwd,
        backward=rotary_bwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), features=frozenset({"interleaved", "partial",
                                                                                    "position_ids"}),
        deterministic=True, requires_interpret_or_cuda=True, memory=MEMORY_FUSED,
        description="Triton: q and k rotated in one launch, a program per token (cos / sin read once per token)")]
