"""LayerNorm and RMSNorm forwards through PyTorch's own fused CUDA kernels as vendor impls.

cuda.aten.layer_norm    aten.native_layer_norm and its backward.
cuda.aten.rms_norm      aten._fused_rms_norm, forward only: its backward op exists only for CUDA, so it
                        could not be checked here and is not registered; a backward resolves to another
                        impl (the Triton one), which reads the same statistics (rstd of shape
                        x.shape[:-1], float32).  No `offset` (Gemma's (1 + w)): that would cost an op.
                        Where a torch build lacks aten._fused_rms_norm, fn is torch.rms_norm plus a
                        separately computed rstd (rms_fwd_unfused); eager no-grad and grad-recording
                        calls use torch.rms_norm itself either way.
cuda.aten.rms_norm_small_rows  the same code, ranked above the Triton RMSNorm for calls of <= 16 rows
                        (decode), the bucket measured on the H200 (host time per call, 8 rows x
                        2048, bf16): eager F.rms_norm, i.e. this kernel, took 15.9 us of host and 7.8 us
                        of GPU time per call vs 70.4 / 24.1 us for the Triton kernel pinned
                        (decode calls are host-bound).  At 65536 rows the Triton kernel is
                        faster (the norm suite's t65536 h1024 rows), so larger buckets keep it.

Eager no-grad calls (`inference`) go through torch.layer_norm / torch.rms_norm, eager PyTorch's own
path (one call, no statistics handed back).  Eager grad-recording calls (`train`) may take the same
path under PyTorch's own autograd (C++ backward, no Python on autograd's thread):
cuda.aten.layer_norm_autograd / cuda.aten.rms_norm_autograd  ranked above the Triton norms for those
                        calls without residual at hidden <= 2048, the bucket measured on the H200
                        (norm bench fwd+bwd, 65536 x 1024, ead87e0): eager 0.574 / 0.431 ms vs the
                        Triton fwd + bwd through opsadv's Function 0.752 / 0.800 ms (host-bound:
                        ~0.6 ms of host per call); with a residual the fused Triton kernels won
                        (1.02-1.03x) and at hidden 4096-8192 the results were mixed (0.88-1.06x), so
                        those buckets keep the priority order unless autotune measures otherwise.  The other impls sit below the Triton norms in priority:
with `use_backend(..., autotune=True)` (or `tune_for_hardware`) the dispatcher times them per shape
bucket and direction.  Saved statistics have the contract's layout (mean/rstd of shape x.shape[:-1],
float32), so a Triton forward and an aten backward (or the reverse) compose."""
from __future__ import annotations

import torch

from opsadv.core.kernel import PRIORITY_GENERIC, KernelImpl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
aten = torch.ops.aten
SMALL_ROWS = 16            # row bucket (len_bucket: 16 = up to 16 rows) where the measurement above holds
PRIORITY_SMALL_ROWS = 250  # above the Triton norms (200)


def _stat(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    want = torch.float64 if like.dtype == torch.float64 else torch.float32
    return t.reshape(like.shape[:-1]).to(want)


def _absent(ref: torch.Tensor, t):
    return t if t is not None else ref.new_empty((0,))


def ln_fwd(ctx, x, weight, bias, eps, residual):
    s = x + residual if residual is not None else x
    y, mean, rstd = aten.native_layer_norm(s, [x.shape[-1]], weight, bias, eps)
    return y, (s if residual is not None else x.new_empty((0,))), _stat(mean, x), _stat(rstd, x)


def ln_infer(ctx, x, weight, bias, eps, residual):
    s = x + residual if residual is not None else x
    return torch.layer_norm(s, (x.shape[-1],), weight, bias, eps), (s if residual is not None else None), None, None


def ln_bwd(ctx, dy, dsum, xin, weight, bias, mean, rstd):
    n = xin.shape[-1]
    acc = torch.float64 if xin.dtype == torch.float64 else torch.float32
    dx, dw, db = aten.native_layer_norm_backward(
        dy.contiguous(), xin.contiguous(), [n], mean.to(acc).unsqueeze(-1), rstd.to(acc).unsqueeze(-1), weight, bias,
        [True, weight is not None, bias is not None])
    if dsum.numel():
        dx = dx + dsum
    return dx, _absent(xin, dw), _absent(xin, db)


def rms_fwd(ctx, x, weight, eps, residual, offset):
    s = x + residual if residual is not None else x
    y, rstd = aten._fused_rms_norm(s, [x.shape[-1]], weight, eps)
    return y, (s if residual is not None else x.new_empty((0,))), _stat(rstd, x)


def rms_fwd_unfused(ctx, x, weight, eps, residual, offset):
    """rms_fwd's outputs without aten._fused_rms_norm: torch.rms_norm and a separately computed rstd."""
    s = x + residual if residual is not None else x
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rstd = torch.rsqrt(s.to(acc).pow(2).mean(-1) + eps)
    return (torch.rms_norm(s, (x.shape[-1],), weight, eps), (s if residual is not None else x.new_empty((0,))),
            rstd)


def rms_infer(ctx, x, weight, eps, residual, offset):
    if residual is None:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps), None, None
    s = x + residual
    return torch.rms_norm(s, (x.shape[-1],), weight, eps), s, None


TRAIN_MAX_HIDDEN = 2048   # grad-recording calls up to this hidden size: torch's autograd first (above)


def _train_small_hidden(spec, env) -> list[str]:
    if not spec.train:
        return ["serves eager grad-recording calls only (others: cuda.aten.* / the Triton norms)"]
    if spec.bucket[0] > TRAIN_MAX_HIDDEN:
        return [f"ranked for hidden <= {TRAIN_MAX_HIDDEN} (host-bound fwd+bwd); hidden {spec.bucket[0]}"]
    return []


def _small_rows(spec, env) -> list[str]:
    rows = spec.bucket[1]
    return [] if rows <= SMALL_ROWS else [f"ranked for <= {SMALL_ROWS} rows (decode); row bucket {rows}"]


def impls(env) -> list[KernelImpl]:
    common = dict(backend="cuda", priority=PRIORITY_GENERIC + 50, device_types=("cuda",), dtypes=DTYPES,
                  deterministic=False)
    out = [
        KernelImpl("cuda.aten.layer_norm", "layer_norm", fn=ln_fwd, backward=ln_bwd, inference=ln_infer,
                   train=ln_infer, features=frozenset({"weight", "bias", "residual"}), **common,
                   description="PyTorch's fused LayerNorm kernels (residual added separately)"),
        KernelImpl("cuda.aten.layer_norm_autograd", "layer_norm", fn=ln_fwd, backward=ln_bwd, inference=ln_infer,
                   train=ln_infer, features=frozenset({"weight", "bias"}),
                   **dict(common, priority=PRIORITY_SMALL_ROWS), check=_train_small_hidden,
                   description="PyTorch's LayerNorm under PyTorch's autograd, for grad-recording calls "
                               f"without residual at hidden <= {TRAIN_MAX_HIDDEN} (measured faster there)"),
    ]
    # without aten._fused_rms_norm (older torch builds) fn computes rstd in a second expression; the
    # no-grad (`inference`) and grad-recording (`train`) paths are torch.rms_norm either way
    rms = dict(common, fn=rms_fwd if hasattr(aten, "_fused_rms_norm") else rms_fwd_unfused, inference=rms_infer,
               train=rms_infer, features=frozenset({"weight", "residual"}))
    out += [
        KernelImpl("cuda.aten.rms_norm", "rms_norm", **rms,
                   description="PyTorch's fused RMSNorm forward (residual added separately; no backward)"),
        KernelImpl("cuda.aten.rms_norm_small_rows", "rms_norm", **dict(rms, priority=PRIORITY_SMALL_ROWS),
                   check=_small_rows,
                   description="PyTorch's fused RMSNorm forward for <= 16 rows (decode), measured faster there"),
        KernelImpl("cuda.aten.rms_norm_autograd", "rms_norm",
                   **dict(rms, priority=PRIORITY_SMALL_ROWS, features=frozenset({"weight"})),
                   check=_train_small_hidden,
                   description="PyTorch's RMSNorm under PyTorch's autograd, for grad-recording calls "
                               f"without residual at hidden <= {TRAIN_MAX_HIDDEN} (measured faster there)"),
    ]
    return out
