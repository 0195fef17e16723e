"""LayerNorm through PyTorch's own fused CUDA kernels (aten.native_layer_norm and its backward)
as a vendor impl.  (RMSNorm's aten._fused_rms_norm_backward exists only for CUDA, so it could not
be checked here and is not registered.)

They sit below the Triton norms in priority, so without a measurement the Triton kernels serve;
with `use_backend(..., autotune=True)` (or `tune_for_hardware`) the dispatcher times both per shape
bucket and direction, so a bucket where aten's kernel wins — the backward at some shapes on the H200
— is served by it.  The saved statistics have the contract's layout (mean/rstd of shape x.shape[:-1],
float32), so a Triton forward and an aten backward (or the reverse) compose."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_GENERIC, KernelImpl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
aten = torch.ops.aten


def _stat(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    want = torch.float64 if like.dtype == torch.float64 else torch.float32
    return t.reshape(like.shape[:-1]).to(want)


def _absent(ref: torch.Tensor, t):
    return t if t is not None else ref.new_empty((0,))


def ln_fwd(ctx, x, weight, bias, eps, residual):
    s = x + residual if residual is not None else x
    y, mean, rstd = aten.native_layer_norm(s, [x.shape[-1]], weight, bias, eps)
    return y, (s if residual is not None else x.new_empty((0,))), _stat(mean, x), _stat(rstd, x)


def ln_bwd(ctx, dy, dsum, xin, weight, bias, mean, rstd):
    n = xin.shape[-1]
    acc = torch.float64 if xin.dtype == torch.float64 else torch.float32
    dx, dw, db = aten.native_layer_norm_backward(
        dy.contiguous(), xin.contiguous(), [n], mean.to(acc).unsqueeze(-1), rstd.to(acc).unsqueeze(-1), weight, bias,
        [True, weight is not None, bias is not None])
    if dsum.numel():
        dx = dx + dsum
    return dx, _absent(xin, dw), _absent(xin, db)


def impls(env) -> list[KernelImpl]:
    common = dict(backend="cuda", priority=PRIORITY_GENERIC + 50, device_types=("cuda",), dtypes=DTYPES,
                  deterministic=False)
    return [
        KernelImpl("cuda.aten.layer_norm", "layer_norm", fn=ln_fwd, backward=ln_bwd,
                   features=frozenset({"weight", "bias", "residual"}), **common,
                   description="PyTorch's fused LayerNorm kernels (residual added separately)"),
    ]
