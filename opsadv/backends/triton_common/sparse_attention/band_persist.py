"""Persistent sparse-attention forward for windowed band layouts (sparse.py's LOOP "band_persist").

Why: at s16384 and a 1024-key causal window the Triton sparse forward spends a fixed ~5 us per (64-row q
tile, head) program outside its K/V loop: the Q load and
the first K/V tiles' latency, the refill of the masked edge tiles' loop, the epilogue.  Here a program walks
many (head, q tile) work items, every item running the same NT key tiles (the band's widest row tile;
narrower ones get leading dummy tiles, fully masked).

Measured on the H200 (5859e0a; s16384 causal
windows, d128 bf16, 64x64 tiles, K/V through descriptors, ms persistent / LOOP "band"): w128 0.2265 / 0.2349,
w256 0.2837 / 0.2922, w1024 0.712 / 0.680, w2048 1.29 / 1.17.  So it pays only where an item is short:
sparse.py takes it by default for bands at most PERSIST_MAX_TILES key tiles wide.  The loops fused by Triton
(`tl.range(..., flatten=True)`, meant to issue the next item's loads under the current item's last tiles)
computed wrong outputs on the H200 wherever a program walked several items (relative error
0.17-0.94 against SDPA at the timing shapes; right at the small check shapes, where each program had one item)
and ran 1.3-2x slower: removed.

Band layouts only (sparse._is_band) with a window: an all-True block mask (dense causal) has no bounded
width.  Tile classification as helpers._band_tiles (the edge tiles take the element mask of _allowed)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .helpers import _allowed, _band_tiles, _fwd_finish, _kv_tile_unmasked, _softmax_step

INTERPRETER_PROGRAMS = 3        # under the interpreter: few programs, so each walks several items (tests)
SMEM_PER_SM = 233472            # sm_90: 228 KB per SM, 1 KB of it reserved per resident block
REGS_PER_SM = 65536
# Resident programs per SM by launch configuration, read from the compiled kernel after its first launch (which
# assumes 1: never more programs than fit).  sm_90 compile at d128 64x64 3 stages (CPU, ptxas): 114,712 B of shared
# memory and 179 registers (2 per SM).
_PER_SM: dict = {}


@functools.lru_cache(maxsize=256)
def band_width_tiles(sq: int, sk: int, wl: int, wr: int, causal: bool, block_m: int, block_n: int) -> int:
    """The most key tiles any row tile of a windowed band visits (_band_tiles' n_vis, maximised over
    the row tiles on the host: integer arithmetic over range(cdiv(sq, block_m)), no device work)."""
    n_m = -(-sq // block_m)
    r0 = torch.arange(n_m, dtype=torch.int64) * block_m
    r1 = torch.clamp(r0 + block_m, max=sq) - 1
    off = sk - sq
    lo0 = torch.clamp(r0 + off - wl, min=0)
    hi1 = torch.clamp(r1 + off + wr, max=sk - 1)
    if causal:
        hi1 = torch.minimum(hi1, r1 + off)
    n_vis = torch.where(hi1 >= lo0, torch.div(hi1, block_n, rounding_mode="floor")
                        - torch.div(lo0, block_n, rounding_mode="floor") + 1, 0)
    return int(n_vis.max()) if n_m else 0


@triton.jit
def _sparse_fwd_band_persist(Q, K, V, O, LSE, BM, KPM, SEG, POS, k_desc, v_desc,
                             s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
                             s_bmb, s_bmh, s_bm_q, s_bm_k, s_kpmb,
                             H, GROUP, SQ, SK, OFF, D, qk_scale, WL, WR, NG, BS, n_m, n_items, NT,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                             EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WIN: tl.constexpr,
                             BM_MODE: tl.constexpr, RESCALE: tl.constexpr, TMA: tl.constexpr):
    offs_d = tl.arange(0, HEAD_D)
    # work item w: (batch * head, q tile); consecutive items are neighbouring q tiles of one head (K/V in L2)
    for w in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        bh = w // n_m
        pid_m = w % n_m
        b = (bh // H).to(tl.int64)                   # 64-bit offsets: b * s_qb can pass 2^31 elements
        h = (bh % H).to(tl.int64)
        hk = h // GROUP
        b32 = (bh // H).to(tl.int32)                 # descriptor coordinates are 32-bit
        hk32 = ((bh % H) // GROUP).to(tl.int32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                    mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < D), other=0.0)
        k_base = K + b * s_kb + hk * s_kh
        v_base = V + b * s_vb + hk * s_vh
        kt_lo, n_low, full_lo, n_full, hi_lo, n_high = _band_tiles(pid_m, SQ, SK, OFF, WL, WR, BLOCK_M, BLOCK_N,
                                                                   CAUSAL, BM_MODE)
        kt0 = kt_lo + n_low + n_full + n_high - NT   # NT tiles ending at the last visited one: those below kt_lo
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # are dummies (an all-masked tile: p = 0)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        for t in tl.range(0, NT):
            kt = kt0 + t
            # a dummy below key 0 re-reads tile 0 (masked below)
            k, v = _kv_tile_unmasked(k_base, v_base, s_kn, s_vn, tl.maximum(kt, 0), offs_d, SK, D, k_desc, v_desc,
                                     b32, hk32, BLOCK_N, HEAD_D, EVEN_D, TMA)
            s = tl.dot(q, tl.trans(k))
            if (kt < full_lo) | (kt >= full_lo + n_full):     # edge or dummy tile: element mask
                offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
                ok = _allowed(offs_m, offs_n, BM + b * s_bmb + h * s_bmh, s_bm_q, s_bm_k, KPM + b * s_kpmb, SEG, POS,
                              SQ, SK, OFF, WL, WR, NG, BS, CAUSAL, HAS_WIN, False, BM_MODE, False, False, True)
                s = tl.where(ok & (kt >= kt_lo), s, float("-inf"))
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, qk_scale, True, RESCALE)
        _fwd_finish(acc, l_i, m_i, O, LSE, b, h, bh, s_ob, s_oh, s_om, offs_m, offs_d, SQ, D)


def launch(q, k, v, out, lse, ti, ptrs, strides, k_desc, v_desc, hq, hk, sq, sk, d, hd, scale_log2, wl, wr, bs,
           causal, tile, rescale, tma):
    """Run the persistent band forward (sparse.sparse_fwd's arguments, already prepared)."""
    bm_m, bn_f, warps, stages = tile
    b = q.shape[0]
    n_m = triton.cdiv(sq, bm_m)
    n_items = b * hq * n_m
    nt = band_width_tiles(sq, sk, wl, wr, causal, bm_m, bn_f)
    key = (q.device, q.dtype, bm_m, bn_f, warps, stages, hd, tma, causal)
    if q.device.type == "cuda":
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        programs = min(n_items, sms * _PER_SM.get(key, 1))
    else:
        programs = min(n_items, INTERPRETER_PROGRAMS)
    bm8, kpm8, seg, pos = ptrs
    compiled = _sparse_fwd_band_persist[(max(programs, 1),)](
        q, k, v, out, lse, bm8, kpm8, seg, pos, k_desc, v_desc,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *strides,
        hq, hq // hk, sq, sk, sk - sq, d, scale_log2, wl, wr, 0, bs, n_m, n_items, nt,
        BLOCK_M=bm_m, BLOCK_N=bn_f, HEAD_D=hd, EVEN_D=hd == d, CAUSAL=causal, HAS_WIN=wl >= 0, BM_MODE=ti.bm_mode,
        RESCALE=rescale, TMA=tma, num_warps=warps, num_stages=stages)
    shared, regs = getattr(getattr(compiled, "metadata", None), "shared", None), getattr(compiled, "n_regs", None)
    if key not in _PER_SM and q.device.type == "cuda" and shared is not None and regs:
        _PER_SM[key] = resident_per_sm(shared, regs, warps)


def resident_per_sm(shared: int, regs: int, warps: int) -> int:
    """Programs of a kernel (shared memory bytes, registers per thread, warps) that fit one sm_90 SM at once."""
    return max(1, min(SMEM_PER_SM // (shared + 1024), REGS_PER_SM // (regs * 32 * warps)))
