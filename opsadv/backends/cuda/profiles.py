"""CUDA profiles: data keyed on device properties read at run time (shared memory per block,
SM count, L2), not on names alone.  Kernels read their tiles from ctx.profile.  Every per-hardware tile and config
table of the cuda backend's Triton kernels is here (flash attention, sparse attention, gemm / swiglu_gemm); the
interpreter's small tiles are triton_common's (opsadv/backends/triton_common/profiles.py), the jetson profile's the
jetson backend's.  Kernel-specific candidate lists that a kernel's own tuner measures per shape (swiglu, norm) and
the Gluon kernels' named variants stay with their kernels."""
from __future__ import annotations

from opsadv.backends.triton_common.profiles import INTERPRETER_TILES, interpreter_profile, tile as _t
from opsadv.core.kernel import Profile


def _cc(env):
    return env.compute_capability or (0, 0)


def _nvidia(env) -> bool:
    # a ROCm GPU is device type "cuda" too, and MI300 reports "cc 9.4": these profiles are for NVIDIA only
    return env.device_type == "cuda" and getattr(env, "runtime", "cuda") == "cuda"


def _smem(env) -> int:
    return env.shared_memory_per_block_optin or 0




# flash attention tiles per pass ("fwd", "bwd_kv", "bwd_q") and head-dim class (64: d <= 64,
# 128: d <= 128, 256): the first config is the default, the list the autotune space.
# bwd_kv: BLOCK_N is the kv block a program owns, BLOCK_M the q block it loops over.
ATTN_TILES = {
    "h100": {   # pruned to the winners measured on an H200 (2026-11-29);
                # 2026-11-29 variant sweep:
                # fwd d128: 128x128/8/3 was 4% faster causal than 64x64/4/3 in two same-process sweeps, but
                # `opsadv bench` measured the [own] causal row at 0.899x cuDNN with 64x64 first (4e42928) and
                # 0.825x with 128x128 first (a3e4f98), non-causal 0.777x both: 64x64 stays the default; warp specialization (WS) compiles at 128x128/8 warps (not 128x64/4 or
                # 64x64/4) and is within noise of the plain kernel, so it is only in the autotune space;
                # conditional rescaling and the source-pipelined loop were slower (flags left off);
                # bwd_q 128x64/8/3 first (-5% whole backward non-causal, -2% causal)
        "fwd": {64: [_t(64, 64, 4, 3), _t(128, 64, 4, 3), _t(64, 64, 4, 4), _t(128, 64, 4, 4)],
                128: [_t(64, 64, 4, 3), _t(128, 128, 8, 3), _t(128, 64, 8, 3), _t(128, 128, 8, 3, True),
                      _t(128, 128, 8, 3, WS=True), _t(128, 128, 8, 3, True, WS=True)],
                256: [_t(64, 64, 4, 2), _t(128, 64, 8, 2, True), _t(64, 32, 4, 2), _t(128, 64, 8, 2)]},
        # backward TMA configs (streamed tiles through descriptors): compiled for sm_90 they cut the dK/dV
        # kernel's spills (64x64/4/2 d128 b4 s4096: 44 B -> 0 non-causal, 68 -> 32 causal) and the dQ kernel's
        # registers (128x64/8/3: 206 -> 158).  H200 (pinned kernel pairs): d128 with both kernels' TMA tiles
        # 1.040x / 1.028x / 0.995x / 1.057x the plain defaults (b4 s4096, causal, s16384 causal, GQA causal), so
        # d128 starts with them; at d64 no TMA pair won (0.99x), so they stay in the space there
        "bwd_kv": {64: [_t(64, 64, 4, 3), _t(32, 64, 4, 3), _t(32, 128, 4, 5), _t(64, 64, 4, 2),
                        _t(64, 64, 4, 3, True), _t(64, 64, 4, 2, True)],
                   128: [_t(64, 64, 4, 2, True), _t(64, 64, 4, 2), _t(32, 64, 4, 3), _t(64, 128, 8, 2),
                         _t(64, 64, 4, 3), _t(64, 64, 8, 2, True)],
                   256: [_t(32, 64, 4, 2), _t(64, 64, 8, 1), _t(32, 64, 8, 2)]},
        "bwd_q": {64: [_t(128, 64, 8, 3), _t(64, 64, 4, 3), _t(64, 64, 4, 2), _t(128, 64, 8, 3, True)],
                  128: [_t(128, 64, 8, 3, True), _t(128, 64, 8, 3), _t(64, 64, 4, 2), _t(64, 32, 4, 3),
                        _t(128, 64, 8, 2)],
                  256: [_t(64, 32, 4, 2), _t(64, 64, 8, 1), _t(32, 64, 4, 2)]},
        # bwd_kv 64x64/8/2 TMA: with the dS store (the "ds" backward) the causal 64x64/4/2 kernel spills
        # 80-92 B on sm_90 (ptxas), 8 warps do not (217-226 registers; tests/test_attention_ds_backward.py); not timed yet
        # the dQ GEMM over a materialized dS (triton_common/flash_attention/dq_gemm.py; BLOCK_M queries x BLOCK_N keys per step): streams
        # dS from memory, so deep pipelines.  Tuned on the H200: 128x64
        # with 8 warps won every d128 bucket (3 or 4 stages); the TMA-load variants were added after that run
        "bwd_dsq": {64: [_t(128, 64, 8, 4), _t(128, 128, 8, 3), _t(64, 128, 4, 4), _t(128, 64, 4, 4),
                         _t(128, 64, 8, 4, True), _t(128, 64, 4, 4, True)],
                    128: [_t(128, 64, 8, 4), _t(128, 128, 8, 3), _t(64, 128, 4, 4), _t(128, 64, 8, 3),
                          _t(128, 64, 8, 4, True), _t(128, 64, 8, 3, True)],
                    256: [_t(64, 64, 8, 3), _t(128, 32, 8, 3), _t(64, 32, 4, 3)]},
    },
    "a100": {
        "fwd": {64: [_t(128, 64, 4, 3), _t(128, 128, 8, 3), _t(64, 64, 4, 3)],
                128: [_t(128, 64, 4, 3), _t(128, 128, 8, 2), _t(64, 64, 4, 3)],
                256: [_t(64, 64, 4, 2), _t(64, 32, 4, 2)]},
        "bwd_kv": {64: [_t(64, 128, 8, 2), _t(32, 128, 4, 2)], 128: [_t(64, 128, 8, 2), _t(32, 64, 4, 2)],
                   256: [_t(32, 64, 4, 1), _t(32, 32, 4, 2)]},
        "bwd_q": {64: [_t(128, 64, 8, 2), _t(64, 64, 4, 2)], 128: [_t(128, 64, 8, 2), _t(64, 32, 4, 2)],
                  256: [_t(64, 32, 4, 1), _t(32, 32, 4, 2)]},
    },
    "rtx": {   # ~99 KB shared memory per block
        "fwd": {64: [_t(128, 64, 4, 2), _t(64, 64, 4, 2)], 128: [_t(64, 64, 4, 2), _t(128, 32, 4, 2)],
                256: [_t(64, 32, 4, 1)]},
        "bwd_kv": {64: [_t(32, 64, 4, 2)], 128: [_t(32, 64, 4, 1)], 256: [_t(16, 32, 4, 1)]},
        "bwd_q": {64: [_t(64, 32, 4, 2)], 128: [_t(64, 32, 4, 1)], 256: [_t(32, 16, 4, 1)]},
    },
    "interpreter": INTERPRETER_TILES["flash_attention"],
}   # (the jetson profile's tiles live with it: opsadv/backends/jetson/profiles.py)


# gemm / swiglu_gemm Triton configs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per profile; "small" serves
# M <= 64 (decode).  The persistent kernel's entries add (programs per SM, EPI_SPLIT: the epilogue in two column
# halves).
GEMM_CONFIGS = {
    "h100": {"gemm": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                      (256, 128, 64, 8, 3), (128, 64, 64, 4, 4)],
             "swiglu": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)],
             "small": [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 4)],
             # the winners measured on an H200: 2 programs of 128x128/8 warps per SM
             # at the BERT shapes (epilogue of one under the other's MMAs), 128x256 at 8192^3 and the
             # gemm suite's shapes, whole-tile stores at 12288x768x768.  The 128x256 entries exceed shared
             # memory with a residual epilogue (sm_90 compile: 245784 / 294944 B; the autotuner drops them)
             "persistent": [(128, 128, 64, 8, 3, 2, True), (128, 256, 64, 8, 4, 1, True),
                            (128, 256, 64, 8, 3, 1, True), (128, 128, 64, 8, 4, 1, False)],
             "persistent_swiglu": [(128, 128, 64, 8, 3, 1, True), (128, 128, 64, 8, 4, 1, True)]},
    "a100": {"gemm": [(128, 256, 32, 8, 3), (128, 128, 32, 4, 4), (128, 128, 64, 4, 3), (64, 128, 32, 4, 4)],
             "swiglu": [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4)],
             "small": [(16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (32, 64, 64, 4, 4)]},
    "rtx": {"gemm": [(128, 128, 32, 4, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 64, 32, 4, 4)],
            "swiglu": [(64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (64, 64, 32, 4, 4)],
            "small": [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (32, 64, 64, 4, 3)]},
}


# scaled_gemm (FP8) Triton configs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); "small" serves M <= 64.
# BLOCK_K divides 128 (a block-scale step lies in one 128-wide scale block).  Unmeasured first choices (fp8 tiles
# hold twice the K of bf16 ones in the same shared memory); the autotuner picks among them on the GPU.  No a100
# entry: FP8 tensor cores start at sm_89.
SCALED_GEMM_CONFIGS = {
    "h100": {"gemm": [(128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3), (128, 128, 128, 4, 4),
                      (128, 256, 64, 8, 4), (64, 128, 128, 4, 4)],
             # block scales: a second float32 tile per K step; 128x256 spills at 255 registers (sm_90 compile,
             # Triton 3.6), 128x128 / 8 warps fits in 202
             "block": [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (64, 128, 128, 4, 4), (128, 128, 64, 8, 4)],
             "small": [(64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (64, 256, 128, 8, 3)],
             # scaled_swiglu_gemm: a gate and an up accumulator per tile and a b tile of each half per stage
             # (128x128x128: 48 KB a stage); with block scales two partial products more.  Every entry compiles
             # for sm_90 without spills, TMA and pointer kernels, bias + gelu_tanh + fp8 output (Triton 3.6, ptxas;
             # 128x128/8 at 255 registers; block 128x128/8 and 64x128/4 spilled and are left out).  Unmeasured
             # first choices: the autotuner picks on the GPU.
             "swiglu": [(128, 128, 128, 8, 3), (128, 128, 64, 8, 4), (128, 64, 128, 4, 4), (64, 128, 128, 4, 4)],
             "swiglu_block": [(128, 64, 128, 8, 3), (64, 128, 128, 8, 3), (128, 64, 64, 8, 4), (64, 64, 128, 4, 4)],
             "swiglu_small": [(64, 64, 128, 4, 4), (64, 128, 128, 4, 3)]},
    "rtx": {"gemm": [(128, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 64, 128, 4, 3)],
            "block": [(128, 128, 64, 4, 3), (64, 128, 64, 4, 4)],
            "small": [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3)],
            "swiglu": [(64, 128, 64, 4, 3), (128, 64, 64, 4, 3)], "swiglu_block": [(64, 64, 64, 4, 3)],
            "swiglu_small": [(64, 64, 64, 4, 3)]},
}


# fp8_attention forward tiles per head-dim class, as ATTN_TILES' "fwd" (flag V_T: V read from a seq-contiguous copy,
# the K-major operand of the FP8 P V wgmma).  Unmeasured first choices; every one compiles for sm_90 without spills
# (Triton 3.6, ptxas; d128: 128x128/8/3 TMA V_T 192 registers non-causal, 205 causal; d256 64x64/4/2 232) with
# both dots as e4m3 wgmma.  rtx (sm_89): no TMA, no wgmma (mma.sync e4m3).  No a100 entry: FP8 starts at sm_89.
#
# The backward's "bwd_kv" (BLOCK_N the kv block a program owns, BLOCK_M the q block it loops over) and "bwd_q" tiles
# (TMA: the streamed tiles through descriptors).  sm_90 compile (Triton 3.6, ptxas, bf16 gradients, QK^T as e4m3
# wgmma), spill bytes non-causal / causal: d128 bwd_kv 64x64/8/2 and 32x64/4/3 none with or without TMA, 64x64/4/2
# 416 / 800 (536 / 1052 TMA: dK, dV accumulators plus the bf16 copy of the q tile for dK), 64x128/8/2 288 / 672;
# d128 bwd_q none (TMA 128x64/8/3: 171 registers, 220 without); d64 none; d256 only bwd_kv 32x32/8/2 and bwd_q
# 32x32/8/2, 32x64/8/2, 32x32/4/2 fit (16x64/8/2 spills causal, 32x64/8/2 196 / 672).  d128 starts with TMA, as
# flash_attention's backward (0.995-1.057x there); the order is otherwise unmeasured (the autotuner picks on the GPU).
FP8_ATTN_TILES = {
    "h100": {"fwd": {64: [_t(128, 128, 8, 3, True, V_T=True), _t(128, 64, 4, 3, True, V_T=True),
                          _t(64, 64, 4, 3, V_T=True)],
                     128: [_t(128, 128, 8, 3, True, V_T=True), _t(64, 128, 4, 3, True, V_T=True),
                           _t(128, 64, 4, 3, True, V_T=True), _t(128, 128, 8, 3, V_T=True), _t(128, 128, 8, 3)],
                     256: [_t(64, 64, 4, 2, True, V_T=True), _t(128, 64, 8, 2, True, V_T=True)]},
             "bwd_kv": {64: [_t(64, 64, 4, 2), _t(64, 64, 4, 2, True), _t(64, 128, 8, 2), _t(32, 64, 4, 3),
                             _t(64, 64, 8, 2, True)],
                        128: [_t(64, 64, 8, 2, True), _t(64, 64, 8, 2), _t(32, 64, 4, 3, True), _t(32, 64, 4, 3)],
                        256: [_t(32, 32, 8, 2)]},
             "bwd_q": {64: [_t(128, 64, 8, 3), _t(128, 64, 8, 3, True), _t(64, 64, 4, 2), _t(128, 64, 8, 2, True)],
                       128: [_t(128, 64, 8, 3, True), _t(128, 64, 8, 3), _t(128, 64, 8, 2, True), _t(64, 64, 4, 2)],
                       256: [_t(32, 32, 8, 2), _t(32, 64, 8, 2), _t(32, 32, 4, 2)]}},
    "rtx": {"fwd": {64: [_t(64, 64, 4, 2), _t(128, 64, 4, 2)], 128: [_t(64, 64, 4, 2), _t(128, 32, 4, 2)],
                    256: [_t(64, 32, 4, 1)]},
            "bwd_kv": {64: [_t(32, 64, 4, 2)], 128: [_t(32, 64, 4, 1)], 256: [_t(16, 32, 4, 1)]},
            "bwd_q": {64: [_t(64, 32, 4, 2)], 128: [_t(64, 32, 4, 1)], 256: [_t(32, 32, 4, 1)]}},
}


# sparse attention tiles (fwd BLOCK_M, BLOCK_N, warps, stages[, rescale threshold]), (dq BLOCK_M, BLOCK_N, warps,
# stages), (dkdv BLOCK_M, BLOCK_N, warps, stages) keyed by profile name, then head-dim class ("small" <= 128 <
# "large").  h100 "small": the best of a sweep on an H200 (s=16384 window 1024 causal d128 bf16).
SPARSE_TILES = {
    "h100": {"small": ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
             "large": ((64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 1))},   # d=256: fp32 accumulators fit registers
    "a100": {"small": ((128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
             "large": ((64, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2))},
    "rtx": {"small": ((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2)),
            "large": ((64, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 1))},
}


# sparse attention's forward tile for long rows, by profile: (tile, min mean keys per row).  H200 (
# causal windows, s16384 d128 bf16, "run" loop): 128x128/8/3 vs 64x64/4/3
# w2048 1.236 vs 1.343 ms, w4096 2.111 vs 2.259, w8192 3.447 vs 3.689; but w1024 0.782 vs 0.727, w256 0.443
# vs 0.312 and the packed varlen batch 1.693 vs 1.564 (segment edges: more masked work).  So only for
# layouts whose full tiles are one run per row, without segments, key padding or a mixed block mask, and
# rows that visit >= 1536 keys on average.  Shared memory at 128x128/3 stages: 229376 B of 232448 for every
# flag combination allowed here (sm_90 compile, Triton 3.6); the excluded gather paths need more.
LONG_ROW_FWD = {"h100": ((128, 128, 8, 3), 1536)}


def _tiles(name: str) -> dict:
    """A profile's tables per op.  The persistent GEMM runs on Hopper only: every profile carries the h100 tables
    for it (a profile forced onto an H100 still finds them)."""
    gemm = {k: v for k, v in GEMM_CONFIGS["h100"].items() if k.startswith("persistent")}
    sparse = dict(SPARSE_TILES[name], **({"long_row": LONG_ROW_FWD[name]} if name in LONG_ROW_FWD else {}))
    return {"flash_attention": ATTN_TILES[name], "gemm": {**gemm, **GEMM_CONFIGS[name]}, "sparse_attention": sparse,
            **({"scaled_gemm": SCALED_GEMM_CONFIGS[name]} if name in SCALED_GEMM_CONFIGS else {}),
            **({"fp8_attention": FP8_ATTN_TILES[name]} if name in FP8_ATTN_TILES else {})}


H100 = Profile(
    name="h100", backend="cuda", tiles=_tiles("h100"), description="Hopper (cc 9.x, ~227 KB smem/block): TMA, wgmma, deep pipelines",
    num_stages=3, num_warps=8, priority=30,
    matches=lambda env: _nvidia(env) and _cc(env)[0] == 9 and _smem(env) >= 200 * 1024,
)
A100 = Profile(
    name="a100", backend="cuda", tiles=_tiles("a100"), description="Ampere datacenter (cc 8.0, ~163 KB smem/block)",
    num_stages=3, num_warps=4, priority=20,
    matches=lambda env: _nvidia(env) and _cc(env) == (8, 0) and _smem(env) >= 160 * 1024,
)
RTX = Profile(
    name="rtx", backend="cuda", tiles=_tiles("rtx"), description="consumer / workstation parts (cc 8.6/8.9, ~99 KB smem/block)",
    num_stages=2, num_warps=4, priority=10,
    matches=lambda env: _nvidia(env) and _cc(env) >= (7, 5),
)
INTERPRETER = interpreter_profile("cuda")
# use_backend("cuda", profile="jetson") still works: the jetson backend offers its profile to this one
PROFILES = (H100, A100, RTX, INTERPRETER)
