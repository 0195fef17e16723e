"""Gluon warp-specialized persistent SwiGLU GEMM for Hopper, impl "cuda.gluon.swiglu_gemm" of op "swiglu_gemm".

    out = silu(x @ W_g + b_g) * (x @ W_u + b_u)      x (..., K), w_gate_up = [W_g | W_u] (K, 2N); bf16 / fp16

Why: the Triton SwiGLU GEMM (cuda.triton.swiglu_gemm_tma) ran at 653-665 TFLOP/s on the H200 where the Gluon
GEMM's cooperative schedule ran plain GEMMs at 691-694 (9bd6b69); SwiGLU is
one GEMM of twice the columns, so it should run at the GEMM's rate.  The kernel (gluon_kernel.py) is
that schedule with two B boxes (gate and up columns of the same weight) per ring slot and two accumulators.

Not experimental: on the H200 at 7a12dcb its 42 GPU tests passed (tests/test_gluon_swiglu_gemm.py -k gpu:
every variant vs float64, odd M / N / K tails, both weight layouts, bias, capped grids) and so did pinned conformance
(docs/conformance/cuda-h200-gluon-swiglu.md, 6 pass / 0 fail); the suite's four SwiGLU shapes then ran at 696-709
TFLOP/s (1.10-1.22x eager, 1.05-1.07x torch.compile).  The dispatcher measures it
per shape bucket against the Triton and cuBLAS impls like every other impl.  Host side as
cuda.gluon.gemm (gemm/gluon.py): leading dims of x flattened, TMA descriptors (K and N multiples of 8), an
nn.Linear-style weight.t() read as (2N, K) rows without a copy.  Backward: the Triton TMA SwiGLU backward."""
from __future__ import annotations

import functools

import torch

from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl

from opsadv.backends.triton_common import poisoned as _poisoned
from opsadv.backends.triton_common.gemm.gemm import _triton_swiglu_bwd
from ..common.gluon import gluon_unavailable
from ..common.gluon_gemm import PRODUCER_REGS, prepare, stream_k_args, tile_descriptors, tma_gemm_reasons

try:
    from . import gluon_kernel as _K
    from triton.experimental.gluon import language as _gl  # noqa: F401  (the import check: see gemm/gluon.py)
    UNAVAILABLE = ""
except Exception as e:  # ImportError, or an older Triton whose Gluon lacks a name used here
    _K = _gl = None
    UNAVAILABLE = gluon_unavailable(e)

IMPL_ID = "cuda.gluon.swiglu_gemm"
# BM x BN: the output tile (each ring slot holds BN gate and BN up columns: a 128 x 256 GEMM tile, as the Gluon
# GEMM's "coop"); shared memory per stage 16 KB of A + 2 x 16 KB of B; + a 32 KB output tile.
#   coop:      4-stage ring (224 KB in all)
#   coop_st3:  3-stage ring (176 KB)
#   coop_tanh: coop with the sigmoid through one tanh.approx (the Gluon GEMM's TANH_FAST; relative error ~2^-11)
#   coop_sk / coop_tanh_sk: coop / coop_tanh with stream-K (the last waves' K-slices shared evenly by the CTAs: a
#              launch of 4096 tiles on 132 SMs otherwise idles 3%; common/gluon_gemm.py stream_k_plan).  H200,
#              on the H200 (median of 5 interleaved rounds): 1.024-1.027x coop and
#              1.013-1.026x coop_tanh at 8192^3 and 16384 x 4096 x 11008 (4096 tiles each); the suite's SwiGLU
#              rows then ran at 700-726 TFLOP/s, 1.153-1.228x eager.
VARIANTS = {
    "coop": dict(BM=128, BN=128, BK=64, STAGES=4, num_warps=8),
    "coop_st3": dict(BM=128, BN=128, BK=64, STAGES=3, num_warps=8),
    "coop_tanh": dict(BM=128, BN=128, BK=64, STAGES=4, num_warps=8, TANH=True),
    "coop_sk": dict(BM=128, BN=128, BK=64, STAGES=4, num_warps=8, STREAM_K=True),
    "coop_tanh_sk": dict(BM=128, BN=128, BK=64, STAGES=4, num_warps=8, TANH=True, STREAM_K=True),
}
DEFAULT_VARIANT = "coop"


def launch_args(x2, w, out, bias=None, variant=None, w_nk=False, num_sms=None):
    """(grid, args, kwargs) of one swiglu_gemm_kernel launch writing out (M, N) from x2 (M, K) and w (K, 2N),
    or w as (2N, K) rows with w_nk; all already TMA-ready (common/gluon_gemm.py prepare)."""
    if _K is None:
        raise RuntimeError(f"{IMPL_ID}: {UNAVAILABLE}")
    cfg = VARIANTS[variant or DEFAULT_VARIANT]
    a_desc, b_desc, c_desc, grid, _ = tile_descriptors(x2, w, out, cfg, w_nk, num_sms)
    m, k, n = x2.shape[0], x2.shape[1], out.shape[1]
    tiles = -(-m // cfg["BM"]) * -(-n // cfg["BN"])
    stream_k = cfg.get("STREAM_K", False)
    sk = stream_k_args(out, tiles, grid[0], stream_k, 2 * cfg["BM"] * cfg["BN"])     # gate and up partials
    args = (a_desc, b_desc, c_desc, bias if bias is not None else out, m, n, k, *sk)
    kw = dict(HAS_BIAS=bias is not None, STAGES=cfg["STAGES"], B_NK=bool(w_nk), TANH=cfg.get("TANH", False),
              STREAM_K=stream_k, PRODUCER_REGS=PRODUCER_REGS, num_warps=cfg["num_warps"])
    return grid, args, kw


_VARIANT_TUNER = None


def _pick_variant(ctx, x2, w_, out, bias, w_nk) -> str:
    """The schedule measured per (dtype, rows bucket, N, K, bias, weight layout) where the profile autotunes."""
    global _VARIANT_TUNER
    from opsadv.backends.triton_common.utils import ConfigTuner, bucket
    profile = getattr(ctx, "profile", None)
    if not (out.is_cuda and profile is not None and profile.autotune):
        return DEFAULT_VARIANT
    if _VARIANT_TUNER is None:
        _VARIANT_TUNER = ConfigTuner("gluon_swiglu_gemm.variant")

    def launch(cfg):
        grid, args, kw = launch_args(x2, w_, out, bias, cfg["variant"], w_nk)
        _K.swiglu_gemm_kernel[grid](*args, **kw)
    key = (str(x2.dtype), bucket(x2.shape[0]), out.shape[1], x2.shape[1], bias is not None, bool(w_nk))
    order = [DEFAULT_VARIANT] + [v for v in VARIANTS if v != DEFAULT_VARIANT]
    return _VARIANT_TUNER.pick(key, [{"variant": v} for v in order], launch, True)["variant"]


def swiglu_gemm_fwd(ctx, x, w_gate_up, bias, variant=None, num_sms=None):
    """The impl's forward (swiglu_gemm contract), shape (..., N).  variant / num_sms (tests, probes): the
    schedule and a grid cap below the SM count (every CTA then walks many tiles)."""
    k, n2 = w_gate_up.shape
    x2, w_, w_nk = prepare(x.reshape(-1, k), w_gate_up)
    out = _poisoned((x2.shape[0], n2 // 2), x)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()                        # the epilogue reads it with unit stride
    if variant is None and num_sms is None:
        variant = _pick_variant(ctx, x2, w_, out, bias, w_nk)
    grid, args, kw = launch_args(x2, w_, out, bias, variant, w_nk, num_sms)
    _K.swiglu_gemm_kernel[grid](*args, **kw)
    return out.reshape(*x.shape[:-1], n2 // 2)


swiglu_gemm_bwd = functools.partial(_triton_swiglu_bwd, kernel="tma")


def _check(spec, env) -> list[str]:
    x_shape, w_shape = spec.shapes[:2]
    return tma_gemm_reasons(env, UNAVAILABLE, x_shape[-1], w_shape[1] // 2)


def impls(env) -> list[KernelImpl]:
    return [KernelImpl(
        id=IMPL_ID, op="swiglu_gemm", backend="cuda", fn=swiglu_gemm_fwd, backward=swiglu_gemm_bwd,
        priority=PRIORITY_TRITON - 5,     # an unmeasured bucket keeps the Triton / cuBLAS order
        device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16), min_cc=(9, 0), max_cc=(9, 0),
        features=frozenset({"bias", "batched"}), check=_check, memory=MEMORY_FUSED,
        description="Gluon persistent SwiGLU GEMM for Hopper (the Gluon GEMM's cooperative schedule with the gate "
                    "and up columns of [W_g | W_u] in each ring slot, two accumulators, silu(g) * u epilogue, TMA "
                    "stores), the schedule measured per shape bucket; sm_90 only; passed its H200 checks and pinned "
                    "conformance there; Triton backward")]


__all__ = ["impls", "swiglu_gemm_fwd", "swiglu_gemm_bwd", "launch_args", "VARIANTS", "DEFAULT_VARIANT", "IMPL_ID"]
