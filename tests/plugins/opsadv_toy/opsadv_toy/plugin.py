"""A third-party backend as a user would write one: BackendInfo, a probe, KernelImpls.
Its kernels go through torch.nn.functional (a different code path from opsadv's reference)."""
import math

import torch
import torch.nn.functional as F

from opsadv import KernelImpl
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def rms_fwd(ctx, x, weight, eps, residual, offset):
    s = x.float() + residual.float() if residual is not None else x.float()
    if x.dtype == torch.float64:
        s = x + residual if residual is not None else x
    rstd = torch.rsqrt(s.pow(2).mean(-1) + eps)
    w = None if weight is None else (offset + weight.to(s.dtype))
    y = F.rms_norm(s, (x.shape[-1],), w, eps)
    return y.to(x.dtype), (s.to(x.dtype) if residual is not None else x.new_empty((0,))), rstd


def attn_fwd(ctx, q, k, v, attn_mask, causal, scale):
    # q/k/v upcast so the toy is exact enough for float32 conformance; lse from the scores
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(dt), k.to(dt), v.to(dt)
    out = F.scaled_dot_product_attention(qf, kf, vf, scale=scale)
    lse = torch.logsumexp((qf @ kf.transpose(-1, -2)) * scale, -1)
    return out.to(q.dtype), lse


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name="toy", vendor="Example Corp", device_types=("cpu",), version="0.3.0", auto_priority=0)


@hookimpl
def opsadv_probe(env):
    return ProbeResult(True, ("runs on any CPU",))


@hookimpl
def opsadv_register_kernels(registry, env):
    registry.add(KernelImpl(id="toy.rms_norm", op="rms_norm", backend="toy", fn=rms_fwd, priority=150,
                            device_types=("cpu",), dtypes=DTYPES, features=frozenset({"weight", "residual", "offset"})))
    registry.add(KernelImpl(id="toy.flash_attention", op="flash_attention", backend="toy", fn=attn_fwd, priority=150,
                            device_types=("cpu",), dtypes=DTYPES, features=frozenset()))


@hookimpl
def opsadv_profiles():
    return []
