"""Host helpers of the Gluon persistent GEMMs (cuda/gemm/gluon.py, cuda/swiglu_gemm/gluon.py): TMA-ready operands,
the A / B / C descriptors and the persistent grid, the stream-K plan and its workspace, and the reasons a
GEMM-shaped Gluon kernel refuses a call."""
from __future__ import annotations

import functools

import torch

from .gluon import _GluonTensorDescriptor, _gl, cdiv as _cdiv, nvmma_layout, tma_ready as _tma_ready

ALIGN = 8            # elements per 16 bytes (2-byte dtypes): TMA row alignment of K and N
PRODUCER_REGS = 24    # the TMA producer warp only computes tile coordinates and issues copies
DEFAULT_SMS = 132     # H100 SXM / H200: the grid size when no GPU is visible (compile checks on CPU)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _descriptor(t: torch.Tensor, block, gdt):
    return _GluonTensorDescriptor(t, list(t.shape), list(t.stride()), list(block), nvmma_layout(tuple(block), gdt))


def persistent_grid(out: torch.Tensor, tiles: int, num_sms=None) -> tuple[int]:
    """One CTA per SM (num_sms, default the device's count), never more than the tiles."""
    if num_sms is None:
        num_sms = _num_sms(out.device.index or 0) if out.is_cuda else DEFAULT_SMS
    return (max(1, min(tiles, num_sms)),)


def stream_k_plan(tiles: int, nprog: int) -> int:
    """DP_TILES of a stream-K launch of `tiles` output tiles on `nprog` CTAs (gluon_gemm_ring.py's stream-K notes):
    every full wave but the last runs whole tiles; the last full wave and the partial one (nprog + tiles % nprog
    tiles, so each CTA's share of their K-slices is at least one tile and no tile has more than two sharers) are
    split.  All tiles (no split) where they fill whole waves or fewer than one."""
    if tiles <= nprog or tiles % nprog == 0:
        return tiles
    return (tiles // nprog - 1) * nprog


def stream_k_chunks(tiles: int, k_tiles: int, nprog: int, pid: int) -> list[tuple[int, int, int]]:
    """The (tile, first K-slice, end K-slice) chunks CTA pid computes after its whole tiles, in order: the
    kernel's _sk_range / _sk_chunk in Python (tests check coverage and the publish-before-wait order)."""
    dp = stream_k_plan(tiles, nprog)
    total = (tiles - dp) * k_tiles
    per, extra = divmod(total, nprog)
    cur = pid * per + min(pid, extra)
    end = cur + per + (pid < extra)
    out = []
    while cur < end:
        t, kb = divmod(cur, k_tiles)
        ke = min(k_tiles, kb + end - cur)
        out.append((dp + t, kb, ke))
        cur += ke - kb
    return out


def stream_k_args(out: torch.Tensor, tiles: int, nprog: int, stream_k: bool, per_tile: int):
    """(ws, flags, DP_TILES) kernel arguments: with stream_k a float32 workspace of per_tile values for each split
    tile and their zeroed int32 flags (one, unused, where nothing is split: the pointers keep their types); without
    it the output stands in for both (never read)."""
    if not stream_k:
        return out, out, tiles
    dp = stream_k_plan(tiles, nprog)
    split = max(tiles - dp, 1)
    return (torch.empty(split * per_tile, dtype=torch.float32, device=out.device),
            torch.zeros(split, dtype=torch.int32, device=out.device), dp)


def tile_descriptors(a2, b, out, cfg: dict, b_nk: bool, num_sms=None):
    """(a_desc, b_desc, c_desc, grid, gdt) of a persistent GEMM-shaped launch: A (BM, BK) boxes, B (BK, BN) boxes (or
    (BN, BK) with b_nk), C (BM, BN) boxes of cfg's tile, one CTA per SM at most."""
    gdt = _gl.bfloat16 if a2.dtype == torch.bfloat16 else _gl.float16
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    descs = (_descriptor(a2, (bm, bk), gdt), _descriptor(b, (bn, bk) if b_nk else (bk, bn), gdt),
             _descriptor(out, (bm, bn), gdt))
    return (*descs, persistent_grid(out, _cdiv(a2.shape[0], bm) * _cdiv(out.shape[1], bn), num_sms), gdt)


def prepare(a2: torch.Tensor, b: torch.Tensor):
    """(a2, b, b_nk): a2 TMA-ready; b as (K, N) rows, or with b_nk its transpose as (N, K) rows."""
    a2 = _tma_ready(a2)
    if b.stride(-1) == 1 and _tma_ready(b) is b:
        return a2, b, False
    bt = b.t()
    if bt.stride(-1) == 1 and _tma_ready(bt) is bt:     # nn.Linear weight.t(): read its rows directly
        return a2, bt, True
    return a2, b.contiguous(), False


def tma_gemm_reasons(env, unavailable: str, k: int, n: int) -> list[str]:
    """Why a Gluon GEMM-shaped kernel cannot serve a call with inner dim k and n output columns (empty if it can)."""
    if unavailable:
        return [unavailable]
    if env.triton_interpret:
        return ["Gluon kernels do not run under TRITON_INTERPRET=1 (the Triton interpreter)"]
    if k % ALIGN or n % ALIGN:
        return [f"TMA needs K and N multiples of {ALIGN} (16-byte rows), got K={k} N={n}"]
    return []
