"""The gemm op's activations and their derivatives in plain torch, shared by every backend that
needs them outside a fused kernel (written out: autograd is off inside a custom op's kernel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SQRT_2_OVER_PI = 0.7978845608028654

ACT = {"none": lambda z: z, "relu": F.relu, "gelu": F.gelu,
       "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}


def act_grad(activation: str, z: Tensor) -> Tensor:
    """d activation / dz at z (compute in float32 or float64)."""
    if activation == "none":
        return torch.ones_like(z)
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if activation == "gelu":
        return 0.5 * (1 + torch.erf(z * 0.7071067811865476)) + z * torch.exp(-0.5 * z * z) * 0.3989422804014327
    if activation == "gelu_tanh":
        t = torch.tanh(SQRT_2_OVER_PI * (z + 0.044715 * z ** 3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    raise ValueError(f"unknown activation {activation!r}")


def swiglu_grad(grad: Tensor, gate_up: Tensor, activation: str = "silu") -> Tensor:
    """d gate_up of act(g) * u for gate_up = [g | u]: [grad * u * act'(g) | grad * act(g)] (compute in float32
    or float64); act silu (SwiGLU) or gelu_tanh (GeGLU)."""
    g, u = gate_up.chunk(2, dim=-1)
    return torch.cat([grad * u * act_grad(activation, g), grad * ACT[activation](g)], dim=-1)
