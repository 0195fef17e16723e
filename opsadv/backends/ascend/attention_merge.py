"""attention_merge_ (the in-place lse merge, ring attention's step) on Ascend: the op's torch formula run on the
NPU (torch_npu has no fused merge of partial attention results), so that ring attention under
`use_backend("ascend")` merges on the device instead of being refused.  Elementwise torch ops: no SoC limit."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_GENERIC, KernelImpl
from opsadv.ops.attention_merge.reference import FEATURES, merge_fwd

from . import _npu

NAME = "ascend"


def impls(soc) -> list[KernelImpl]:
    return [KernelImpl(id="ascend.attention_merge_", op="attention_merge_", backend=NAME, fn=merge_fwd,
                       priority=PRIORITY_GENERIC, device_types=_npu.device_types(), dtypes=(torch.float32,),
                       features=FEATURES, deterministic=True,
                       description="the torch formula on the NPU (elementwise ops; no torch_npu fused merge)")]
