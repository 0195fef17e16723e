"""Gluon FA3-style flash-attention forward for Hopper, impl "cuda.gluon.flash_attention" of op
"flash_attention" (issue #3).

Forward: the Gluon kernel in gluon_kernel.py (TMA + async wgmma, warp-specialized K/V loads,
intra-warpgroup softmax/GEMM overlap).  Backward: the Triton FlashAttention-2 backward of
attention.py from the saved out and lse, so training works.  Declared for sm_90 only (wgmma/TMA as
written here; Blackwell has other instructions), bf16/fp16, head_dim 64 or 128, any s_q/s_k, causal
(bottom-right), GQA/MQA; no attn_mask.  q/k/v may be any strided (b, h, s, d) view with unit stride
along d and 16-byte aligned strides (contiguous and the (b, s, h, d) memory of transformers'
projections both are); other views are made contiguous first (a copy).

Passed the H200 conformance catalogue at 0802806, b82d17a and, with d128's pingpong_st3 default, f1b9ea8
(14 pass / 0 fail; docs/conformance/cuda-h200-gluon-flash.md), so not experimental.  It ranks above the
Triton impl and below the vendor (cuDNN / flash) impls; measurement decides between them (autotune / the
tuning cache): `opsadv bench --suite attention` at 26cb27c chose it at b1 h32 s16384 d128, 1.035x cuDNN
non-causal and 1.135x causal; at b4 s4096 the two are within 1% and the
measured choice goes either way.  The Gluon backward of
gluon_bwd.py is correct on the H200 but slower than the Triton one, so it is not used.
When triton.experimental.gluon does not import, the impl is still registered, rejecting every call
with the import error as the reason (opsadv.explain shows it), and importing opsadv never fails."""
from __future__ import annotations

import torch

from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_TRITON, PRIORITY_VENDOR, KernelImpl

from ..common.gluon import cdiv as _cdiv, desc as _desc, gluon_unavailable, nvmma_layout, tma_ready as _tma_ready

try:
    from . import gluon_kernel as _K
    from triton.experimental.gluon import language as _gl
    UNAVAILABLE = ""
except Exception as e:  # ImportError, or an older Triton whose Gluon lacks a name used here
    _K = _gl = None
    UNAVAILABLE = gluon_unavailable(e)

IMPL_ID = "cuda.gluon.flash_attention"
HEAD_DIMS = (64, 128)
FEATURES = frozenset({"causal", "gqa", "cross_length"})
LOG2E = 1.4426950408889634

# Named kernel schedules (see gluon_kernel's docstring).  STAGES None: the deepest ring that fits
# 227 KB of shared memory next to Q/O (d128: 2 stages = 160 KB, 3 = 224 KB; d64: 3 stages).
VARIANTS = {
    "ws": dict(WARP_SPEC=True, PINGPONG=False, STAGES=None),
    "inline": dict(WARP_SPEC=False, PINGPONG=False, STAGES=None),
    "inline_st3": dict(WARP_SPEC=False, PINGPONG=False, STAGES=3),
    "pingpong": dict(WARP_SPEC=True, PINGPONG=True, STAGES=None),
    # d128 only (at d64 it is "pingpong"): 2 x 64-row Q/O slots + 3 x (K + V) = 229,736 B of shared
    # memory with the barriers (sm_90 limit 232,448).  0 spills; the d128 default since b82d17a.
    "pingpong_st3": dict(WARP_SPEC=True, PINGPONG=True, STAGES=3),
    # FA3's separate K and V pipelines: a K slot is refilled once its S has retired, without waiting
    # for the P V of the same tile (the kernel's SPLIT_EMPTY).  0 spills; H200: best non-causal MHA d128,
    # behind pingpong_st3 causal.
    "pingpong_kv": dict(WARP_SPEC=True, PINGPONG=True, STAGES=None, SPLIT_EMPTY=True),
    "pingpong_kv_st3": dict(WARP_SPEC=True, PINGPONG=True, STAGES=3, SPLIT_EMPTY=True),
    # Ping-pong with 1 in 2 / 1 in 4 of the unmasked tiles' exp2 on the FMA pipe (the kernel's EXP_EMU): at
    # d64 the MUFU unit's exp2 rate, not the tensor cores, bounds the forward.  Correct on the H200 but slower
    # than pingpong: selectable, not default.
    "pingpong_emu2": dict(WARP_SPEC=True, PINGPONG=True, STAGES=None, EXP_EMU=2),
    "pingpong_emu4": dict(WARP_SPEC=True, PINGPONG=True, STAGES=None, EXP_EMU=4),
    "pingpong_st3_emu4": dict(WARP_SPEC=True, PINGPONG=True, STAGES=3, EXP_EMU=4),
}
# Ping-pong at d128 recomputes the O store's coordinates after the K/V loop (the kernel's REMAT):
# held through the loop they spilled (8 B of stack, 24 B causal).  d64 did not spill; it stays
# byte-identical to the schedule measured on the H200 (its default).
REMAT_HEAD_DIMS = (128,)
# The schedule the impl launches, per head dim: the fastest correct one on the H200 at b82d17a
# (bf16, x SDPA cuDNN in the same run; every schedule
# passed every check).  d128 pingpong_st3, non-causal / causal: b4 h32 s4096 1.016 / 1.001, b1 s16384
# 1.015 / 1.219, GQA 32/8 b4 s4096 1.010 / 1.069 (inline_st3, the default before: 0.83 / 0.75, 0.83 / 0.91,
# 0.80 / 0.87; pingpong_kv 1.052 / 0.900, 1.038 / 1.014, 0.996 / 0.996).  d64 pingpong 0.962 / 0.869 at
# b4 s4096, 0.940 / 0.976 at s16384 (pingpong_kv within 1%).
DEFAULT_VARIANT = {64: "pingpong", 128: "pingpong_st3"}
CONSUMER_REGS = 240     # per thread, each ping-pong consumer warpgroup (setmaxnreg)
PRODUCER_REGS = 24      # the TMA producer warp only issues copies


def default_stages(d: int) -> int:
    return 2 if d == 128 else 3


def variants_for(d: int) -> list[str]:
    """The distinct schedules at head dim d: a variant whose explicit ring depth is d's default depth
    (3 stages at d64) is the same kernel as its base schedule, so it is left out."""
    return [name for name, cfg in VARIANTS.items() if cfg["STAGES"] != default_stages(d)]


def launch_args(q, k, v, out, lse, causal: bool, scale: float, variant: str = "ws", stages: int | None = None):
    """(grid, args, kwargs) of one fa_fwd_kernel launch writing out (b, h_q, s_q, d) and lse
    (b, h_q, s_q) float32 contiguous.  q/k/v must already be TMA-ready (see _tma_ready)."""
    if _K is None:
        raise RuntimeError(f"{IMPL_ID}: {UNAVAILABLE}")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    cfg = VARIANTS[variant]
    gdt = _gl.bfloat16 if q.dtype == torch.bfloat16 else _gl.float16
    bq = _K.BLOCK_M // 2 if cfg["PINGPONG"] else _K.BLOCK_M          # rows per consumer partition
    descs = (_desc(q, bq, gdt), _desc(k, _K.BLOCK_N, gdt), _desc(v, _K.BLOCK_N, gdt), _desc(out, bq, gdt))
    grid = (_cdiv(sq, _K.BLOCK_M), b * hq)
    kw = dict(q_smem_layout=nvmma_layout((bq, d), gdt),
              kv_smem_layout=nvmma_layout((_K.BLOCK_N, d), gdt),
              CAUSAL=bool(causal), STAGES=stages or cfg["STAGES"] or default_stages(d),
              WARP_SPEC=cfg["WARP_SPEC"], PINGPONG=cfg["PINGPONG"], CONSUMER_REGS=CONSUMER_REGS,
              PRODUCER_REGS=PRODUCER_REGS, REMAT=cfg["PINGPONG"] and d in REMAT_HEAD_DIMS,
              SPLIT_EMPTY=cfg.get("SPLIT_EMPTY", False), EXP_EMU=cfg.get("EXP_EMU", 0),
              num_warps=4 if cfg["PINGPONG"] else _K.NUM_WARPS)
    args = (*descs, lse, hq, hq // hkv, sq, sk, sk - sq, scale * LOG2E)
    return grid, args, kw


def attention_fwd(q, k, v, causal: bool = False, scale: float | None = None, variant: str | None = None,
                  stages: int | None = None):
    """out (b, h_q, s_q, d) over (b, s, h, d) memory, lse (b, h_q, s_q) float32 natural log."""
    from opsadv.backends.triton_common.utils import new_output, new_output_bshd
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    b, hq, sq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    out = new_output_bshd(q.shape, q.dtype, q.device)
    lse = new_output((b, hq, sq), torch.float32, q.device)
    grid, args, kw = launch_args(q, k, v, out, lse, causal, scale, variant or DEFAULT_VARIANT[d], stages)
    _K.fa_fwd_kernel[grid](*args, **kw)
    return out, lse


def gluon_fwd(ctx, q, k, v, attn_mask, causal, scale):
    return attention_fwd(q, k, v, causal, scale)


def gluon_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    """The Triton FlashAttention-2 backward (deterministic, no atomics) from out and lse."""
    from opsadv.backends.triton_common.flash_attention.attention import flash_bwd
    return flash_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale)


def gluon_bwd_atomic(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    """The Triton single-kernel backward (dQ by TMA bulk reduce-adds on Hopper: not deterministic)."""
    from opsadv.backends.triton_common.flash_attention.attention import flash_bwd_atomic
    return flash_bwd_atomic(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale)


def _check(spec, env) -> list[str]:
    if UNAVAILABLE:
        return [UNAVAILABLE]
    if env.triton_interpret:
        return ["Gluon kernels do not run under TRITON_INTERPRET=1 (the Triton interpreter)"]
    return []


# Where this forward ranks above cuDNN (the vendor impls' priority) without a measurement on the caller's machine
# (rank()): no-grad d128 causal self-attention (GQA too) over long sequences.  H200, attention suite at bd08067
# (tuned, this impl vs SDPA-cuDNN): b4 h32 s4096 bf16 1.091x, fp16 1.094x,
# b1 h32 s16384 1.112x, GQA kv8 s16384 1.096x.  Not ranked where cuDNN won or tied: s1024 (0.90x), d64 (0.92x at
# s4096, 1.02x at s16384), non-causal (1.00-1.03x), and grad-recording calls (the train bucket times fwd + bwd:
# cuDNN's pair won every d128 row).
RANK_MIN_SEQ = 4096               # s_q (= s_k) bucket
RANK_MIN_BATCH_HEADS = 32         # batch * heads bucket (the rows measured: 32 and 128)


def _rank(spec, env) -> tuple[int, str] | None:
    """KernelImpl.rank: above cuDNN where the H200 measured this forward faster (see RANK_*)."""
    if (spec.backward or not spec.inference or spec.head_dim != 128 or "causal" not in spec.features
            or spec.features - {"causal", "gqa"} or len(spec.bucket) != 3):
        return None
    s_q, s_k, bh = spec.bucket       # (s_q, s_k, batch * heads) buckets: opsadv.ops.flash_attention._spec
    if s_q < RANK_MIN_SEQ or s_k != s_q or bh < RANK_MIN_BATCH_HEADS:
        return None
    return (PRIORITY_VENDOR + 10, f"no-grad d128 causal at s > {RANK_MIN_SEQ // 2}: H200-measured 1.09-1.11x "
            f"SDPA-cuDNN (opsadv.backends.cuda.flash_attention.gluon.RANK_MIN_SEQ)")


def impls(env) -> list[KernelImpl]:
    common = dict(op="flash_attention", backend="cuda", fn=gluon_fwd, device_types=("cuda",),
                  dtypes=(torch.float16, torch.bfloat16), head_dims=HEAD_DIMS, min_cc=(9, 0), max_cc=(9, 0),
                  features=FEATURES, check=_check, memory=MEMORY_FLASH)
    return [KernelImpl(
        id=IMPL_ID, backward=gluon_bwd,
        # above the Triton impl (its forward is faster) and below the cuDNN / flash impls, except where rank()
        # says the H200 measured it faster (no-grad d128 causal, long sequences); a tuning cache's measurement
        # overrides the order
        priority=PRIORITY_TRITON + 10, deterministic=True, rank=_rank,
        # not experimental: passed the H200 conformance catalogue at 0802806
        description="Gluon FA3-style forward for Hopper (TMA producer warp, two consumer warpgroups taking "
                    "wgmma turns (ping-pong), 3-stage K/V ring, softmax/GEMM overlap; "
                    "ragged s, bottom-right causal, GQA by index); Triton backward from out + lse", **common),
        # the same forward with the single-kernel backward whose dQ goes through TMA reduce-adds: correct on the
        # H200 but slower than the deterministic two-kernel backward (8.09 vs 6.85 ms at b4 s4096
        # d128), so it stays experimental
        KernelImpl(
        id=IMPL_ID + ".atomic_dq", backward=gluon_bwd_atomic, priority=PRIORITY_TRITON + 5, deterministic=False,
        experimental=True, description="the Gluon forward; Triton single-kernel backward, dQ by TMA bulk "
                                       "reduce-adds (not deterministic)", **common)]


__all__ = ["impls", "attention_fwd", "launch_args", "variants_for", "VARIANTS", "DEFAULT_VARIANT", "UNAVAILABLE",
           "IMPL_ID"]
