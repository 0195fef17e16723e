"""rms_norm through torch_npu.npu_rms_norm / npu_add_rms_norm (backward npu_rms_norm_backward) and
layer_norm through torch's native layer norm, which torch_npu implements on the NPU.

npu_rms_norm(x, gamma, epsilon) -> (y, rstd) with rstd shaped x.shape[:-1] + (1,), float32;
npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2) is forward-only, which is all the
op contract asks of it: the backward is a separate call on the saved sum."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_VENDOR, KernelImpl

from . import _npu

NAME = "ascend"
FEATURES = frozenset({"weight", "bias", "residual", "offset"})


def _gamma(x, weight, offset: float):
    """npu_rms_norm always takes a gamma: ones without a weight; (offset + weight) for Gemma-style."""
    if weight is None:
        return torch.full((x.shape[-1],), 1.0 + offset, dtype=x.dtype, device=x.device)
    return weight.contiguous() if offset == 0.0 else weight + offset


def rms_fwd(ctx, x, weight, eps, residual, offset):
    npu = _npu.torch_npu()
    gamma = _gamma(x, weight, offset)
    if residual is None:
        y, rstd = npu.npu_rms_norm(x.contiguous(), gamma, epsilon=eps)[:2]
        xsum = x.new_empty((0,))
    else:
        y, rstd, xsum = npu.npu_add_rms_norm(x.contiguous(), residual.contiguous(), gamma, epsilon=eps)[:3]
    return y, xsum, rstd.reshape(x.shape[:-1]).float()


def rms_bwd(ctx, dy, dsum, xin, weight, rstd, offset):
    npu = _npu.torch_npu()
    gamma = _gamma(xin, weight, offset)
    r = rstd.reshape(*xin.shape[:-1], 1).float()
    dx, dgamma = npu.npu_rms_norm_backward(dy.contiguous(), xin.contiguous(), gamma, r)[:2]
    if dsum.numel():
        dx = dx + dsum
    dw = dgamma.to(weight.dtype) if weight is not None else xin.new_empty((0,))
    return dx, dw


def _stat(t, shape):
    return t.reshape(shape).float()


_native_stat_dtypes: dict[tuple[str, torch.dtype], torch.dtype] = {}


def _native_stat_dtype(x) -> torch.dtype:
    """The dtype the native layer norm's mean/rstd come in for x (float32 on NPU/CUDA for half
    inputs, the input dtype on CPU): its backward wants them back in that dtype.  Read once."""
    key = (x.device.type, x.dtype)
    if key not in _native_stat_dtypes:
        _native_stat_dtypes[key] = torch.native_layer_norm(x.new_zeros(1, 1), [1], None, None, 1e-5)[1].dtype
    return _native_stat_dtypes[key]


def ln_fwd(ctx, x, weight, bias, eps, residual):
    s = x + residual if residual is not None else x.contiguous()
    y, mean, rstd = torch.native_layer_norm(s, [x.shape[-1]], weight, bias, eps)
    xsum = s if residual is not None else x.new_empty((0,))
    return y, xsum, _stat(mean, x.shape[:-1]), _stat(rstd, x.shape[:-1])


def ln_bwd(ctx, dy, dsum, xin, weight, bias, mean, rstd):
    n = xin.shape[-1]
    shape, sd = (*xin.shape[:-1], 1), _native_stat_dtype(xin)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy.contiguous(), xin.contiguous(), [n], mean.reshape(shape).to(sd), rstd.reshape(shape).to(sd), weight, bias,
        [True, weight is not None, bias is not None])
    if dsum.numel():
        dx = dx + dsum
    return (dx, dw if weight is not None else xin.new_empty((0,)), db if bias is not None else xin.new_empty((0,)))


def _bf16_check(soc):
    def check(spec, env) -> list[str]:
        if spec.dtype == torch.bfloat16 and not soc.bf16:
            return [f"bfloat16 needs Atlas A2 (910B) or newer; this NPU is {soc.family} (SoC {soc.code})"]
        return []
    return check


def impls(soc) -> list[KernelImpl]:
    common = dict(backend=NAME, priority=PRIORITY_VENDOR, device_types=_npu.device_types(),
                  dtypes=(torch.float16, torch.bfloat16, torch.float32), features=FEATURES, check=_bf16_check(soc))
    return [
        KernelImpl(id="ascend.npu_rms_norm", op="rms_norm", fn=rms_fwd, backward=rms_bwd,
                   description="npu_rms_norm / npu_add_rms_norm (residual); backward npu_rms_norm_backward", **common),
        KernelImpl(id="ascend.native_layer_norm", op="layer_norm", fn=ln_fwd, backward=ln_bwd,
                   description="torch native layer norm (an NPU kernel under torch_npu)", **common),
    ]
