"""fp8_attention (FP8 q, k, v) on Ascend: declared so that explain() and a strict backend choice name the reason,
never served (as ascend.scaled_gemm): the Atlas A2 (910B), A3, 310P and 310B cube units multiply fp16 / bf16 /
int8, not FP8; Ascend 950's FP8 is not mapped by this backend yet (torch_npu's npu_fusion_attention takes no fp8
q / k / v with descales).  The reference impl (dequantize, then float32 attention) still runs where a policy lets
it."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_VENDOR, KernelImpl
from opsadv.ops.fp8_attention.reference import FEATURES

from . import _npu
from .scaled_gemm import fp8_reason

NAME = "ascend"


def _refuse(ctx, *args):
    raise NotImplementedError("ascend.fp8_attention serves no call: " + fp8_reason(_npu.STATE.soc))


def impls(soc) -> list[KernelImpl]:
    reason = fp8_reason(soc)
    return [KernelImpl(id="ascend.fp8_attention", op="fp8_attention", backend=NAME, fn=_refuse,
                       priority=PRIORITY_VENDOR, device_types=_npu.device_types(),
                       dtypes=(torch.float16, torch.bfloat16, torch.float32), features=FEATURES,
                       check=lambda spec, env: [reason], description=f"refused on every SoC: {reason}")]
