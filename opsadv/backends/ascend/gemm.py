"""gemm and swiglu_gemm: one (add)mm on the NPU (the op AOE tunes), then the vendor epilogue:
npu_gelu for gelu / gelu_tanh, npu_swiglu for the gated GEMM.  Backward is two matmuls plus
the activation's derivative written out (autograd is off inside an op's kernel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opsadv.core.activations import act_grad, swiglu_grad
from opsadv.core.kernel import PRIORITY_VENDOR, KernelImpl
from opsadv.core.op_common import weight_grad

from . import _npu
from .norm import _bf16_check

NAME = "ascend"
GEMM_FEATURES = frozenset({"bias", "residual", "alpha", "batched", "act_relu", "act_gelu", "act_gelu_tanh", "act_silu"})


def _mm(a, b, bias, alpha: float):
    """alpha * (a @ b) + bias as (batch-flattened) addmm: one NPU MatMul kernel."""
    a2 = a.reshape(-1, a.shape[-1])
    z = torch.addmm(bias, a2, b, alpha=alpha) if bias is not None else (
        torch.mm(a2, b) if alpha == 1.0 else torch.mm(a2, b).mul_(alpha))
    return z.reshape(*a.shape[:-1], b.shape[1])


def _act(activation: str, z):
    if activation == "none":
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "silu":
        return F.silu(z)
    npu = _npu.torch_npu()
    return npu.npu_gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


def gemm_fwd(ctx, a, b, bias, activation, residual, alpha):
    y = _act(activation, _mm(a, b, bias, alpha))
    return y + residual if residual is not None else y


def _weight_grads(dz, a, b, bias, alpha: float):
    k, n = b.shape
    dz2, a2 = dz.reshape(-1, n), a.reshape(-1, k)
    da = torch.mm(dz2, b.t()).reshape(a.shape)
    db = weight_grad(a2, dz2, b)
    if alpha != 1.0:
        da, db = da * alpha, db * alpha
    dbias = dz2.float().sum(0).to(bias.dtype) if bias is not None else a.new_empty((0,))
    return da, db, dbias


def gemm_bwd(ctx, grad, a, b, bias, activation, alpha):
    dz = grad if activation == "none" else (
        grad.float() * act_grad(activation, _mm(a, b, bias, alpha).float())).to(a.dtype)
    return _weight_grads(dz.contiguous(), a, b, bias, alpha)


def swiglu_fwd(ctx, x, w, bias):
    return _npu.torch_npu().npu_swiglu(_mm(x, w, bias, 1.0), dim=-1)


def swiglu_bwd(ctx, grad, x, w, bias):
    return _weight_grads(swiglu_act_bwd(ctx, grad, _mm(x, w, bias, 1.0)), x, w, bias, 1.0)


def swiglu_act_fwd(ctx, gate_up):
    return _npu.torch_npu().npu_swiglu(gate_up, dim=-1)


def swiglu_act_bwd(ctx, grad, gate_up):
    return swiglu_grad(grad.float(), gate_up.float()).to(gate_up.dtype)      # float32 math


def impls(soc) -> list[KernelImpl]:
    common = dict(backend=NAME, priority=PRIORITY_VENDOR, device_types=_npu.device_types(),
                  dtypes=(torch.float16, torch.bfloat16, torch.float32), check=_bf16_check(soc))
    return [
        KernelImpl(id="ascend.matmul_epilogue", op="gemm", fn=gemm_fwd, backward=gemm_bwd, features=GEMM_FEATURES,
                   description="addmm (AOE-tunable MatMul) + npu_gelu / relu / silu epilogue", **common),
        KernelImpl(id="ascend.matmul_npu_swiglu", op="swiglu_gemm", fn=swiglu_fwd, backward=swiglu_bwd,
                   features=frozenset({"bias", "batched"}), description="addmm + torch_npu.npu_swiglu", **common),
        KernelImpl(id="ascend.npu_swiglu", op="swiglu", fn=swiglu_act_fwd, backward=swiglu_act_bwd,
                   features=frozenset({"batched"}), description="torch_npu.npu_swiglu (backward in float32 torch)",
                   **common),
    ]
