"""Host side of the Gluon FA3-style attention backward for Hopper (gluon_bwd_kernel.py, issue #3).

Status (H200, 6e8a381): correct
(every GPU check, bf16/fp16, causal, ragged, GQA/MQA, decode, s_q != s_k with empty rows;
the GPU tests of tests/test_gluon_attention_bwd.py pass) but SLOWER than our Triton backward: b4 h32
s4096 d128 7.04 ms vs 6.82 (cuDNN 5.55), causal 3.82 vs 3.33 (cuDNN 2.75), GQA 32/8 7.15 vs 7.13;
3 ring stages change nothing, 1 stage is slower.  So it is not the backward of impl
cuda.gluon.flash_attention: USE_GLUON_BWD_IN_IMPL stays False.  What it lacked against cuDNN/FA3 (~500
TFLOP/s vs our ~390): a producer warp (the consumers issue TMA loads themselves) and dQ handed to
another warp instead of atomics from the GEMM warps.  (The key rows are already split FA3's way: each
of the two GEMM warpgroups holds 64 of the 128 keys of dK/dV.)

Schedules, VARIANTS (compiled for sm_90 on CPU, 0 STL/LDL and 0 stack at d64/d128, bf16/fp16,
causal or not).  H200 at b82d17a: ws and ws_dqw pass every
check, and none wins: b4 h32 s4096 d128 bf16, ms inline / ws / ws st3 / ws_dqw / Triton / cuDNN:
non-causal 7.05 / 6.99 / 7.01 / 7.37 / 6.76 / 5.46, causal 3.85 / 3.82 / 3.83 / 4.06 / 3.34 / 2.86, GQA 32/8
7.09 / 7.17 / 7.11 / 7.48 / 6.89 / 5.48.  The producer warp gains <1%, dQ through smem costs 5%: the
limit is the GEMM warps' own issue rate, not the loads or the atomics.  DEFAULT_VARIANT stays "inline"
(dqfirst / ws_dqfirst not yet run: PART=e2):
  * ws: a 1-warp TMA producer partition (24 registers) feeding the Q/dO ring through "empty" barriers;
    the 8 GEMM warps run under setmaxnreg 240 (up to R237 used at d128; "inline" uses 255 without a
    producer).  The epilogue's coordinates are re-read from the CTA id (held, they spilled 14 STL/LDL).
    smem 164,108 B at d128 (3 stages: 196,924).
  * dqfirst / ws_dqfirst: the dQ wgmma first, its atomics issued while dV/dK run.
  * ws_dqw: ws + dqfirst, and dQ_part goes through a 32 KB float32 shared buffer to the producer warp,
    which issues the atomics (red.global.add.v4.f32): the GEMM warps only do 16 st.shared.v2 per tile.
    smem 198,972 B at d128 (3 stages: 231,788 of 232,448).
A schedule is checked (NaN-poisoned, against float32 autograd) before timing it next to
"inline", Triton and cuDNN; a schedule becomes DEFAULT_VARIANT only if it passes every check and beats
"inline" causal and not.

attention_bwd(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv): bf16/fp16, d 64 or 128, any
s_q/s_k, bottom-right causal, GQA/MQA; q/k/v/out/dout any (b, h, s, d) view a TMA descriptor can address
(else a contiguous copy is made).  dq/dk/dv come back over (b, s, h, d) memory like the op's outputs."""
from __future__ import annotations

import torch

from ..common.gluon import desc as _desc, gluon_unavailable, nvmma_layout, tma_ready as _tma_ready

try:
    from . import gluon_bwd_kernel as _KB
    from triton.experimental.gluon import language as _gl
    UNAVAILABLE = ""
except Exception as e:  # ImportError, or an older Triton whose Gluon lacks a name used here
    _KB = _gl = None
    UNAVAILABLE = gluon_unavailable(e)


# True only once the kernel beats the Triton backward on the H200 (then wire impl_backward into
# gluon.impls()).  While False, impl_backward is the Triton
# FlashAttention-2 backward.
USE_GLUON_BWD_IN_IMPL = False
LOG2E = 1.4426950408889634
# Q/dO ring depth: 2 stages = 32 KB x 2 next to K, V (64 KB) and dS (16 KB) at d128.
DEFAULT_STAGES = 2
# Named kernel schedules (the kernel's constexprs; see gluon_bwd_kernel's docstring).  Only "inline"
# has run on a GPU; the others are compiled (0 spills) and NOT yet run on a GPU: a GPU run checks and
# times them next to "inline", and one becomes DEFAULT_VARIANT only if it is correct and faster there.
VARIANTS = {
    "inline": dict(WARP_SPEC=False, DQ_FIRST=False),      # the consumers issue their own TMA loads
    "ws": dict(WARP_SPEC=True, DQ_FIRST=False),           # 1-warp TMA producer partition, setmaxnreg
    "dqfirst": dict(WARP_SPEC=False, DQ_FIRST=True),      # dQ wgmma first, its atomics under dV/dK
    "ws_dqfirst": dict(WARP_SPEC=True, DQ_FIRST=True),
    # ws + dQ_part through shared memory (32 KB fp32 at d128), its atomics issued by the producer warp
    "ws_dqw": dict(WARP_SPEC=True, DQ_FIRST=True, DQ_WRITER=True),
}
DEFAULT_VARIANT = "inline"
PRODUCER_REGS = 24      # the producer warp only issues copies; the 8 GEMM warps get 240 (setmaxnreg)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_args(q, k, v, dout, dq_acc, dk, dv, lse2, delta, causal: bool, scale: float,
                stages: int = DEFAULT_STAGES, variant: str = DEFAULT_VARIANT):
    """(grid, args, kwargs) of one fa_bwd_kernel launch.  q/k/v/dout/dk/dv TMA-ready (b, h, s, d) views;
    dq_acc float32 (b, h_q, s_q, d) contiguous and zeroed; lse2/delta float32 (b, h_q, s_q) contiguous."""
    if _KB is None:
        raise RuntimeError(f"gluon attention backward: {UNAVAILABLE}")
    cfg = VARIANTS[variant]
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    gdt = _gl.bfloat16 if q.dtype == torch.bfloat16 else _gl.float16
    bm, bn = _KB.BLOCK_M, _KB.BLOCK_N
    descs = (_desc(q, bm, gdt), _desc(k, bn, gdt), _desc(v, bn, gdt), _desc(dout, bm, gdt),
             _desc(dk, bn, gdt), _desc(dv, bn, gdt))
    grid = (_cdiv(sk, bn), b * hkv)
    kw = dict(kv_smem_layout=nvmma_layout((bn, d), gdt),
              qd_smem_layout=nvmma_layout((bm, d), gdt),
              ps_smem_layout=nvmma_layout((bm, bn), gdt),
              CAUSAL=bool(causal), STAGES=stages, WARP_SPEC=cfg["WARP_SPEC"], DQ_FIRST=cfg["DQ_FIRST"],
              DQ_WRITER=cfg.get("DQ_WRITER", False),
              PRODUCER_REGS=PRODUCER_REGS, num_warps=_KB.NUM_WARPS)
    args = (*descs, dq_acc, lse2, delta, hq, hq // hkv, sq, sk, sk - sq, scale * LOG2E, scale)
    return grid, args, kw


def preprocess(out, dout, lse):
    """(delta, lse2): rowsum(dO * O) and lse in log2 units (+inf for empty rows), float32 (b, h, s_q),
    by the Triton backward's preprocess kernel."""
    import triton
    from opsadv.backends.triton_common.flash_attention.attention import _bwd_pre_kernel
    b, hq, sq, d = out.shape
    lse = lse.float().contiguous()
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)
    pre_bm = 64
    _bwd_pre_kernel[(triton.cdiv(sq, pre_bm), b * hq)](
        out, dout, lse, delta, lse2, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), hq, sq, HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=pre_bm)
    return delta, lse2


def attention_bwd(dout, q, k, v, out, lse, causal: bool = False, scale: float | None = None,
                  stages: int = DEFAULT_STAGES, variant: str = DEFAULT_VARIANT):
    """(dq, dk, dv) of softmax attention from the forward's out and natural-log lse."""
    from opsadv.backends.triton_common.utils import new_output_bshd
    q, k, v, out, dout = (_tma_ready(t) for t in (q, k, v, out, dout))
    b, hq, sq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    delta, lse2 = preprocess(out, dout, lse)
    dq_acc = torch.zeros((b, hq, sq, d), dtype=torch.float32, device=q.device)
    dk = new_output_bshd(k.shape, q.dtype, q.device)
    dv = new_output_bshd(v.shape, q.dtype, q.device)
    grid, args, kw = launch_args(q, k, v, dout, dq_acc, dk, dv, lse2, delta, causal, scale, stages,
                                 variant)
    _KB.fa_bwd_kernel[grid](*args, **kw)
    dq = new_output_bshd(q.shape, q.dtype, q.device)
    dq.copy_(dq_acc)                      # float32 accumulator (already scaled) -> q's dtype
    return dq, dk, dv


def impl_backward(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    """The backward for impl cuda.gluon.flash_attention: the Gluon kernel when USE_GLUON_BWD_IN_IMPL,
    else the Triton FlashAttention-2 backward (today's behaviour)."""
    if USE_GLUON_BWD_IN_IMPL:
        return attention_bwd(dout, q, k, v, out, lse, causal, scale)
    from opsadv.backends.triton_common.flash_attention.attention import flash_bwd
    return flash_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale)


__all__ = ["attention_bwd", "launch_args", "preprocess", "impl_backward", "USE_GLUON_BWD_IN_IMPL", "UNAVAILABLE",
           "VARIANTS", "DEFAULT_VARIANT"]
