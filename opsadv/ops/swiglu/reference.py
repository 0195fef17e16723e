"""The swiglu reference impl (the oracle): plain torch, float32 accumulation (float64 stays float64)."""
from __future__ import annotations

from opsadv.core.activations import ACT, swiglu_grad
from opsadv.core.op_common import acc

FEATURES = frozenset({"batched", "act_gelu_tanh"})


def swiglu_act_fwd(ctx, gate_up, activation="silu"):
    g, u = acc(gate_up).chunk(2, dim=-1)
    return (ACT[activation](g) * u).to(gate_up.dtype)


def swiglu_act_bwd(ctx, grad, gate_up, activation="silu"):
    return swiglu_grad(acc(grad), acc(gate_up), activation).to(gate_up.dtype)
