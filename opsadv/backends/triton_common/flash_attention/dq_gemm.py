"""dQ of the flash-attention backward as a GEMM over a materialized dS (attention.py's "ds" backward).

The two-kernel backward recomputes S = QK^T and dP = dO V^T in its dQ kernel: 7 GEMMs per tile pair
where the dK/dV kernel alone already forms dS.  Here the dK/dV kernel also writes dS^T (key rows, query
columns, q's dtype: the same rounding the dQ product uses in every FlashAttention backward) into a
workspace, and dQ = scale * dS K is one GEMM per query tile that streams dS from memory: 5 GEMMs in all,
deterministic (fixed summation order, no atomics).  The price is the workspace, b * h_q * s_q * s_k
elements; it is capped (use_backend("cuda", workspace_cap=N), else the profile's workspace_cap_bytes, else
DS_WORKSPACE_CAP) and filled a chunk of kv heads at a time, and the backward only takes this path where it
measured faster than the two-kernel one (attention._bwd's variant tuner).

Causal: the dK/dV kernel writes only the tiles its loop visits; the dQ GEMM reads only tiles left of the
diagonal and masks the diagonal band (and keys past s_k) by selection, so unwritten workspace never
reaches a sum."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bwd_kernels import key_range
from ..tma import TensorDescriptor, desc_bhsd
from ..utils import load_tile, store_tile

# Default cap of the dS workspace and SPLIT's fp32 dK / dV shares together (bytes) when neither the workspace_cap
# option nor the profile names one: 2 GiB of dS slabs (b4 h32 s4096 in bf16 needs 4 GiB in all: two chunks;
# s16384: four q heads per chunk) and room for the shares of the chunk (GQA 32/8 s16384 d128: 64 MiB per kv head).
# At 2 GiB flat, GQA 32/8 s16384 could not take the dS variant with SPLIT (one kv head's 2 GiB of slabs filled the
# cap), which the dS probe timed (b86c2f6) at 12.46 ms against 12.95 for the two-kernel backward the tuner chose
# (backward alone).  Chunks are balanced (kv_heads_per_chunk), so the extra room does not
# turn b4 s4096's two chunks of 64 heads into 72 + 56.
DS_WORKSPACE_CAP = (2 << 30) + (256 << 20)
DS_MEMORY_SHARE = 32   # the default cap is at most this fraction of device memory
DS_PAD = 128        # workspace rows / columns padded to a multiple of every tile either kernel uses


@triton.jit
def _dq_gemm_inner(acc, ds_slab, k_base, ds_desc, k_desc, slab, off_b, off_hk, m0, s_dsn, s_kn, offs_m, offs_d, lo, hi,
                   SK, OFFSET, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                   CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:     # (slabs, s_k, s_q) and (b, h_kv, s_k, d) descriptors; keys past s_k come back zero
            ds_t = ds_desc.load([slab, start_n, m0]).reshape(BLOCK_N, BLOCK_M)
            k = k_desc.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            # dS^T tile (keys x queries): rows contiguous along queries (coalesced); the workspace is padded
            ds_t = tl.load(ds_slab + offs_n[:, None] * s_dsn + offs_m[None, :])
            k = load_tile(k_base + offs_n[:, None] * s_kn + offs_d[None, :], offs_n, SK, offs_d, HEAD_DIM, MASKED,
                          PAD_D)
        if MASKED:  # the diagonal band and keys past s_k: never written (causal) or padding -> select 0
            keep = offs_n[:, None] < SK
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + OFFSET)
            ds_t = tl.where(keep, ds_t, 0.0)
        acc = tl.dot(tl.trans(ds_t), k, acc)      # (queries x keys) @ (keys x d)
    return acc


@triton.jit
def _dq_gemm_kernel(DS, K, DQ, ds_desc, k_desc, s_dss, s_dsn, s_kb, s_kh, s_kn, s_dqb, s_dqh, s_dqm,
                    H, GROUP, BH0, SQ, SK, OFFSET, scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr):
    """Grid (query tiles, q heads of the chunk): dQ[bh, m0:m0 + BLOCK_M] = scale * dS[slab] @ K[kv head],
    bh = BH0 + slab.  Last query tiles first (the longest rows when causal).  TMA: tiles through the
    descriptors ds_desc / k_desc instead of pointers."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    slab = tl.program_id(1)
    bh = BH0 + slab
    off_b = bh // H
    off_h = bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ds_slab = DS + slab.to(tl.int64) * s_dss
    off_hk = off_h // GROUP
    k_base = K + off_b.to(tl.int64) * s_kb + off_hk.to(tl.int64) * s_kh
    n_full, hi = key_range(m0, SK, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)     # the dQ kernel's split of the keys
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc = _dq_gemm_inner(acc, ds_slab, k_base, ds_desc, k_desc, slab, off_b, off_hk, m0, s_dsn, s_kn, offs_m, offs_d,
                         0, n_full, SK, OFFSET, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, False, TMA)
    acc = _dq_gemm_inner(acc, ds_slab, k_base, ds_desc, k_desc, slab, off_b, off_hk, m0, s_dsn, s_kn, offs_m, offs_d,
                         n_full, hi, SK, OFFSET, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, True, TMA)
    acc = acc * scale
    store_tile(DQ + off_b.to(tl.int64) * s_dqb + off_h.to(tl.int64) * s_dqh + offs_m[:, None] * s_dqm
               + offs_d[None, :], acc.to(DQ.dtype.element_ty), offs_m, SQ, offs_d, HEAD_DIM, not EVEN_M, PAD_D)


def padded(n: int) -> int:
    return -(-n // DS_PAD) * DS_PAD


def slab_bytes(sq: int, sk: int, dtype: torch.dtype) -> int:
    """Workspace bytes of one q head's dS^T."""
    return padded(sq) * padded(sk) * dtype.itemsize       # (no tensor made: this runs on every backward call)


def workspace_cap(ctx) -> int:
    """use_backend("cuda", workspace_cap=N) if given (0: no dS variant), else the profile's cap, else the default:
    DS_WORKSPACE_CAP, at most 1 / DS_MEMORY_SHARE of the device's memory (a 24 GB card: 750 MB), so the transient
    workspace stays small next to what a training step holds."""
    opts = getattr(ctx, "options", None) or {}
    if opts.get("workspace_cap") is not None:
        return int(opts["workspace_cap"])
    prof = getattr(ctx, "profile", None)
    cap = getattr(prof, "workspace_cap_bytes", None)
    if cap:
        return int(cap)
    total = getattr(getattr(ctx, "env", None), "total_memory", None)
    return min(DS_WORKSPACE_CAP, total // DS_MEMORY_SHARE) if total else DS_WORKSPACE_CAP


def kv_heads_per_chunk(ctx, b: int, hkv: int, group: int, sq: int, sk: int, dtype: torch.dtype) -> int:
    """The most kv heads (over batch x kv heads) a chunk holds: as few chunks as the cap allows for their q heads'
    dS^T, balanced (10 heads under a cap of 4: 3 chunks, at most 4 heads each; balanced_chunks); 0: not even one
    kv head fits."""
    total = b * hkv
    fit = min(total, workspace_cap(ctx) // (group * slab_bytes(sq, sk, dtype)))
    if fit <= 0:
        return 0
    chunks = -(-total // fit)
    return -(-total // chunks)


def balanced_chunks(total: int, most: int) -> list[tuple[int, int]]:
    """(first, count) chunks over `total` heads, as few as chunks of <= `most` allow, sizes differing by <= 1:
    10 heads, most 4 -> 4, 3, 3 rather than 4, 4, 2 (a small last chunk launches fewer programs than the SMs
    hold, and its wave runs half empty)."""
    n = -(-total // most)
    sizes = [total // n + (i < total % n) for i in range(n)]
    return [(sum(sizes[:i]), c) for i, c in enumerate(sizes)]


def new_workspace(slabs: int, sq: int, sk: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(slabs, s_k padded, s_q padded): uninitialized; every element a sum reads is written first."""
    return torch.empty((slabs, padded(sk), padded(sq)), dtype=dtype, device=device)


def launch_dq_gemm(ws: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, bh0: int, slabs: int, hq: int, group: int,
                   sq: int, sk: int, causal: bool, scale: float, cfg: dict) -> None:
    """dQ of q heads [bh0, bh0 + slabs) (flattened b * h_q) from the workspace's first `slabs` slabs."""
    d = k.shape[-1]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    ds_desc = k_desc = None
    if cfg.get("TMA"):
        ds_desc = TensorDescriptor(ws, list(ws.shape), list(ws.stride()), [1, bn, bm])
        k_desc = desc_bhsd(k, bn)
    _dq_gemm_kernel[(triton.cdiv(sq, bm), slabs)](
        ws, k, dq, ds_desc, k_desc, ws.stride(0), ws.stride(1), k.stride(0), k.stride(1), k.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), hq, group, bh0, sq, sk, sk - sq, scale,
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
        EVEN_M=sq % bm == 0, TMA=bool(cfg.get("TMA")), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


__all__ = ["DS_WORKSPACE_CAP", "balanced_chunks", "kv_heads_per_chunk", "launch_dq_gemm", "new_workspace", "slab_bytes"]
