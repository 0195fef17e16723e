"""scaled_gemm and scaled_swiglu_gemm (FP8) on Ascend: declared so that explain() and a strict backend choice name the reason, never
served.  The Atlas A2 (910B), A3 (910C), 310P and 310B cube units multiply fp16 / bf16 / int8, not FP8; Ascend 950
has FP8 matmul (torch_npu's npu_quant_matmul), which this backend does not map yet.  The reference impl (dequantize,
then a float32 matmul) still runs on any device where a policy lets it."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_VENDOR, KernelImpl
from opsadv.ops.scaled_gemm.reference import FEATURES, SWIGLU_FEATURES

from . import _npu

NAME = "ascend"


def fp8_reason(soc) -> str:
    if soc is not None and soc.family == "950":
        return "Ascend 950's FP8 matmul (torch_npu npu_quant_matmul) is not mapped by this backend yet"
    what = f"{soc.family} ({soc.description})" if soc is not None else "this NPU"
    return f"no FP8 on Ascend {what}: its cube units multiply fp16 / bf16 / int8, not float8_e4m3fn / e5m2"


def _refuse(ctx, *args):
    raise NotImplementedError("ascend's FP8 GEMMs serve no call: " + fp8_reason(_npu.STATE.soc))


def impls(soc) -> list[KernelImpl]:
    reason = fp8_reason(soc)
    return [KernelImpl(id=f"ascend.{op}", op=op, backend=NAME, fn=_refuse,
                       priority=PRIORITY_VENDOR, device_types=_npu.device_types(),
                       dtypes=(torch.float16, torch.bfloat16, torch.float32), features=features,
                       check=lambda spec, env: [reason], description=f"refused on every SoC: {reason}")
            for op, features in (("scaled_gemm", FEATURES), ("scaled_swiglu_gemm", SWIGLU_FEATURES))]
