"""Ascend SoC classification by the integer `torch_npu.npu.get_soc_version()` returns.

Classify by the code, never by the name prefix: the bare name "Ascend910B" is a first-generation
910 (codes 100-104), while the Atlas A2 parts report "Ascend910B1".."Ascend910B4" (codes 220-225)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SocInfo:
    code: int
    family: str                      # "910A", "310P", "A2", "310B", "A3", "950", "unknown"
    description: str
    supported: bool                  # the backend serves this SoC at all
    fusion_attention: bool           # torch_npu.npu_fusion_attention (Atlas A2/A3/950)
    bf16: bool                       # bfloat16 kernels (from 910B / Atlas A2 on)
    aoe_modes: tuple[int, ...]       # AOE job types this SoC accepts (1 subgraph, 2 operator, 4 gradient split)
    reason: str = ""                 # why unsupported, or a note

    @property
    def infer_attention(self) -> bool:
        """npu_fused_infer_attention_score (Atlas A2/A3; not confirmed for 950)."""
        return self.family in ("A2", "A3")

    @property
    def tag(self) -> str:
        """Directory-safe name used for per-SoC caches (AOE dump / tune bank)."""
        return f"{self.family.lower()}-{self.code}"


# (first code, last code, family, description, supported, fusion attention, bf16, aoe modes, reason)
_TABLE = (
    (100, 104, "910A", "first-generation Ascend 910 (910A/910ProA/910B/910PremiumA)", False, False, False, (),
     "first-generation Ascend 910 is not supported: npu_fusion_attention, bf16 and the fused norms this "
     "backend uses need Atlas A2 (910B1-B4, SoC codes 220-225) or newer"),
    (200, 205, "310P", "Ascend 310P (Atlas 300I/300V inference)", True, False, False, (1, 2),
     "inference part: fp16/fp32 norms and GEMM; no npu_fusion_attention, no bf16"),
    (220, 225, "A2", "Ascend 910B (Atlas A2 training/inference)", True, True, True, (2, 4), ""),
    (240, 243, "310B", "Ascend 310B (Atlas 200I/500 A2 edge)", True, False, False, (),
     "edge part: fp16/fp32 norms and GEMM only; AOE modes not confirmed for it"),
    (250, 256, "A3", "Ascend 910C (Atlas A3)", True, True, True, (2,), ""),
    (260, 260, "950", "Ascend 950", True, True, True, (),
     "AOE modes not confirmed for this SoC"),
)


def classify_soc(code: int) -> SocInfo:
    """The SocInfo of one `get_soc_version()` code; unknown codes are refused with a reason."""
    code = int(code)
    for lo, hi, fam, desc, ok, fa, bf16, aoe, why in _TABLE:
        if lo <= code <= hi:
            return SocInfo(code, fam, desc, ok, fa, bf16, aoe, why)
    known = ", ".join(f"{lo}-{hi} {fam}" if lo != hi else f"{lo} {fam}" for lo, hi, fam, *_ in _TABLE)
    return SocInfo(code, "unknown", f"unknown SoC code {code}", False, False, False, (),
                   f"unknown Ascend SoC code {code} (known: {known}); update opsadv to serve it")


def dtypes_for(soc: SocInfo, *, fp32: bool) -> tuple[torch.dtype, ...]:
    """Dtypes a kernel family runs in on this SoC (bf16 only from 910B / Atlas A2 on)."""
    out = [torch.float16] + ([torch.bfloat16] if soc.bf16 else [])
    return tuple(out + ([torch.float32] if fp32 else []))
