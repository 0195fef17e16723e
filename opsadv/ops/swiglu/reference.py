"""The swiglu reference impl (the oracle): plain torch, float32 accumulation (float64 stays float64)."""
from __future__ import annotations

import torch.nn.functional as F

from opsadv.core.activations import swiglu_grad
from opsadv.core.op_common import acc

FEATURES = frozenset({"batched"})


def swiglu_act_fwd(ctx, gate_up):
    g, u = acc(gate_up).chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)


def swiglu_act_bwd(ctx, grad, gate_up):
    return swiglu_grad(acc(grad), acc(gate_up)).to(gate_up.dtype)
