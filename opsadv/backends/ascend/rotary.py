"""rotary_embedding through torch_npu.npu_rotary_mul (rotary_mode "half": x * r1 + rotate_half(x) * r2).

q and k go in as (B, S, N, D) when that is how they are stored (transformers' projections viewed as
(B, N, S, D)), with r1 / r2 (B or 1, S, 1, D); otherwise as (B, N, S, D) with (B or 1, 1, S, D).  position_ids
gather the table rows first.  The backward is the same call with the angle negated: for the op's general tables
(cos / sin halves not necessarily equal) that is r1 = cos, r2 = -(sin with its halves swapped), the transpose of
the forward rotation.  Partial rotary and the interleaved layout are not mapped (npu_rotary_mul rotates whole
heads): those calls are refused with the reason and served by another backend."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_VENDOR, KernelImpl

from . import _npu

NAME = "ascend"


def _tables(cos, sin, position_ids, b: int):
    """(B or 1, S, R) tables, rows gathered by position_ids where given."""
    if position_ids is not None:
        pos = position_ids if position_ids.dim() == 2 else position_ids[None]
        return cos[pos], sin[pos]
    return (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)


def _rotate(x, c, s):
    npu = _npu.torch_npu()
    if x.transpose(1, 2).is_contiguous():             # stored (B, S, N, D): rotate in that layout
        y = npu.npu_rotary_mul(x.transpose(1, 2), c[:, :, None], s[:, :, None], rotary_mode="half")
        return y.transpose(1, 2)
    return npu.npu_rotary_mul(x.contiguous(), c[:, None], s[:, None], rotary_mode="half")


def _run(q, k, cos, sin, position_ids, backward: bool):
    c, s = _tables(cos, sin, position_ids, q.shape[0])
    c, s = c.to(q.dtype), s.to(q.dtype)
    if backward:                                      # the rotation by the negative angle (see the docstring)
        h = s.shape[-1] // 2
        s = -torch.cat((s[..., h:], s[..., :h]), -1)
    return _rotate(q, c, s), _rotate(k, c, s)


def rotary_fwd(ctx, q, k, cos, sin, position_ids, interleaved):
    return _run(q, k, cos, sin, position_ids, False)


def rotary_bwd(ctx, gq, gk, cos, sin, position_ids, interleaved):
    return _run(gq, gk, cos, sin, position_ids, True)


def impls(soc) -> list[KernelImpl]:
    return [KernelImpl(
        id="ascend.npu_rotary_mul", op="rotary_embedding", backend=NAME, fn=rotary_fwd, backward=rotary_bwd,
        priority=PRIORITY_VENDOR, device_types=_npu.device_types(),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), features=frozenset({"position_ids"}),
        description="torch_npu.npu_rotary_mul (half layout, whole heads); backward the same call at -angle")]
