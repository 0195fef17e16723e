"""Which (block_m x block_n) tiles a block-sparse attention kernel visits: the TileIndex that the cuda and
rocm sparse kernels walk, built from a SparseLayout's tensors (opsadv.ops.sparse_attention.layout) and cached
on them.  Kernel metadata of no backend in particular, so core holds it and backends import it from here."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef


def _nblocks(n: int, bs: int) -> int:
    return -(-n // bs)


def capturing(t: Tensor | None) -> bool:
    """True while the current CUDA stream is being captured into a graph (t on CUDA): host reads of
    device values are not allowed then."""
    return t is not None and t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ---- results computed from device values, cached without reading them -----------------------------------
def _version(t: Tensor) -> int:
    return -2 if t.is_inference() else t._version       # inference tensors keep no version counter


def _values_key(t: Tensor | None):
    """What identifies a tensor's values without reading them: its storage, view geometry and version counter.
    Views share their base's storage and counter, so the fresh view of one mask that a compiled graph hands each
    layer's call (inductor's reinterpret_tensor) hits where the tensor's identity would miss."""
    if t is None:
        return None
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device,
            _version(t))


class ValueCache:
    """A bounded FIFO of results computed from tensors' values, keyed on _values_key of each tensor plus
    hashable parameters.  An entry holds weak references to the storages, so it keeps no memory alive, and it is
    used only while every one of them is: a storage freed and allocated again is a new one (a miss)."""

    def __init__(self, size: int = 128):
        self._entries: OrderedDict = OrderedDict()
        self._size = size

    @staticmethod
    def _key(tensors: tuple, params: tuple) -> tuple:
        return tuple(_values_key(t) for t in tensors), params

    def get(self, tensors: tuple, params: tuple) -> Any:
        hit = self._entries.get(self._key(tensors, params))
        if hit is None or any(r.expired() for r in hit[0]):
            return None
        return hit[1]

    def put(self, tensors: tuple, params: tuple, value: Any) -> Any:
        key = self._key(tensors, params)
        for k in [k for k, (refs, _) in self._entries.items() if any(r.expired() for r in refs)]:
            del self._entries[k]
        self._entries[key] = ([StorageWeakRef(t.untyped_storage()) for t in tensors if t is not None], value)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


# ---- cu_seqlens without its trailing empty segments ------------------------------------------------------
_live_cache = ValueCache()


def live_segments(cu: Tensor) -> Tensor:
    """cu_seqlens up to its last non-empty segment: a layout built without a host read (a compiled packed batch:
    b * s + 1 entries, most of them empty trailing segments) would make a kernel whose grid spans the segments (FA2
    varlen) launch b * s of them.  One host read per cu values (ValueCache); unchanged while a CUDA graph is
    captured (nothing may be read then)."""
    if cu.numel() <= 2 or capturing(cu):
        return cu
    n = _live_cache.get((cu,), ())
    if n is None:
        n = _live_cache.put((cu,), (), max(1, int((cu[:-1] < cu[-1]).sum())))  # segments starting before the end
    return cu if n + 1 == cu.numel() else cu[:n + 1]


# ---- tile index: which (block_m x block_n) tiles a kernel visits -------------------------------------
class TileIndex(NamedTuple):
    """Row-major lists of the tiles with at least one allowed pair, per (b|1, h|1, row tile):
    `rows` (Bb, Hb, n_rows, 2) int32 = (number of partial tiles, number of tiles); `cols`
    (Bb, Hb, n_rows, max(1, width)) int32 column-tile ids, partial tiles first (they need element
    masks), then full ones.  `t_rows`/`t_cols`: the same by column tile (for dK/dV).  Token
    tables for element masks: `seg` (segment id) and `pos` (position in segment), int32 (s,).
    `bm_mode`: 0 block mask all False, 1 all True, 2 mixed (kernels gather it)."""
    rows: Tensor
    cols: Tensor
    t_rows: Tensor
    t_cols: Tensor
    seg: Tensor | None
    pos: Tensor | None
    bm_mode: int
    bm8: Tensor         # the block mask as int8 (kernels cannot load torch.bool)
    kpm8: Tensor | None
    tiles: int          # visited tiles (all b, h of the index); -1 when built during CUDA graph capture
    total_tiles: int    # Bb * Hb * n_row_tiles * n_col_tiles
    full_run: bool = False   # every row's full tiles are consecutive columns (kernels may walk them as a range)
    t_full_run: bool = False  # the same for t_rows / t_cols: every key tile's full query tiles are one run


_tile_cache = ValueCache()


def _pool(x: Tensor, dim: int, n_tiles: int, tile: int, pad, op) -> Tensor:
    """Reduce x along `dim` in groups of `tile` after padding to n_tiles * tile with `pad`."""
    x = x.movedim(dim, -1)
    need = n_tiles * tile - x.shape[-1]
    if need > 0:
        x = torch.cat([x, x.new_full((*x.shape[:-1], need), pad)], -1)
    x = x[..., :n_tiles * tile].reshape(*x.shape[:-1], n_tiles, tile)
    return op(x).movedim(-1, dim)


def _sorted_tiles(any_: Tensor, full: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(counts (..., 2) int32 = (partial, all), column ids ordered partial tiles first, then full, then empty,
    tiles per row) from (..., n_rows, n_cols) bool tiles; the ids are cut to the widest row's count by the caller."""
    partial = any_ & ~full
    key = torch.where(partial, 0, torch.where(full, 1, 2)).to(torch.int8)   # partial < full < empty
    order = torch.sort(key, dim=-1, stable=True).indices
    n_part, n_all = partial.sum(-1), any_.sum(-1)
    return torch.stack([n_part, n_all], -1).to(torch.int32).contiguous(), order, n_all


def tile_index(block_mask: Tensor, kpm: Tensor | None, cu: Tensor | None, bs: int, causal: bool, wl: int,
               wr: int, ng: int, sq: int, sk: int, block_m: int, block_n: int) -> TileIndex:
    """Cached on the layout tensors' values (ValueCache: storage, view, version) and the tile shape: every layer
    of a forward, and of a compiled one (whose calls get fresh views of one mask), builds it once.  A CUDA graph
    capture builds its own, kept by no cache (its lists are computed by the graph's kernels on every replay, which
    another graph's replays would not refresh)."""
    if capturing(block_mask):
        return _build_tile_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk, block_m, block_n)
    params = (bs, causal, wl, wr, ng, sq, sk, block_m, block_n)
    hit = _tile_cache.get((block_mask, kpm, cu), params)
    if hit is not None:
        return hit
    ti = _build_tile_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk, block_m, block_n)
    return _tile_cache.put((block_mask, kpm, cu), params, ti)


def _build_tile_index(bm, kpm, cu, bs, causal, wl, wr, ng, sq, sk, M, N) -> TileIndex:
    """Built from the layout's device tensors.  While a CUDA graph is captured it reads nothing back
    to the host (lists as wide as the grid, block-mask mode from an earlier eager build or 2 =
    gather, tiles = -1): replays then recompute it from the current mask / cu_seqlens values."""
    dev = bm.device
    static = capturing(bm)
    nqt, nkt = _nblocks(sq, M), _nblocks(sk, N)
    off = sk - sq
    qlo = torch.arange(nqt, device=dev) * M
    qhi = torch.clamp(qlo + M, max=sq) - 1                  # last real row of each row tile
    klo = torch.arange(nkt, device=dev) * N
    khi = torch.clamp(klo + N, max=sk) - 1
    QL, QH, KL, KH = qlo[:, None], qhi[:, None], klo[None, :], khi[None, :]
    true = torch.ones(nqt, nkt, dtype=torch.bool, device=dev)
    c_any, c_full = (KL <= QH + off, KH <= QL + off) if causal else (true, true)
    bounds_full = ((QH - QL + 1) == M) & ((KH - KL + 1) == N)
    # block mask, refined to a common grid then pooled to tiles
    gq, gk = math.gcd(bs, M), math.gcd(bs, N)
    fine = bm.repeat_interleave(bs // gq, 2).repeat_interleave(bs // gk, 3)
    fine = fine[:, :, :_nblocks(sq, gq), :_nblocks(sk, gk)]
    b_any = _pool(_pool(fine, 2, nqt, M // gq, False, lambda x: x.any(-1)), 3, nkt, N // gk, False, lambda x: x.any(-1))
    b_full = _pool(_pool(fine, 2, nqt, M // gq, True, lambda x: x.all(-1)), 3, nkt, N // gk, True, lambda x: x.all(-1))
    bm_mode = _bm_mode(bm, static)
    # window band (clipped by causal: the band's part above the diagonal is masked anyway)
    if wl >= 0:
        r = min(wr, 0) if causal else wr
        w_any = (KL <= QH + off + r) & (KH >= QL + off - wl)
        w_full = (KH <= QL + off + r) & (KL >= QH + off - wl)
    else:
        w_any = w_full = ~true
    # segments and per-segment global tokens
    seg = pos = None
    if cu is not None:
        cu64 = cu.to(torch.int64)
        tok = torch.arange(sq, device=dev)
        seg = torch.searchsorted(cu64, tok, right=True) - 1
        pos = tok - cu64[seg]
        smin_q = _pool(seg, 0, nqt, M, sq, lambda x: x.min(-1).values)
        smax_q = _pool(seg, 0, nqt, M, -1, lambda x: x.max(-1).values)
        smin_k = _pool(seg, 0, nkt, N, sk, lambda x: x.min(-1).values)
        smax_k = _pool(seg, 0, nkt, N, -1, lambda x: x.max(-1).values)
        s_any = (smin_q[:, None] <= smax_k[None, :]) & (smin_k[None, :] <= smax_q[:, None])
        s_full = (smin_q == smax_q)[:, None] & (smin_k == smax_k)[None, :] & (smin_q[:, None] == smin_k[None, :])
        pos_q, pos_k = pos, pos
        seg, pos = seg.to(torch.int32).contiguous(), pos.to(torch.int32).contiguous()
    else:
        s_any = s_full = true
        pos_q, pos_k = torch.arange(sq, device=dev), torch.arange(sk, device=dev)
    if ng > 0:
        gq_tok, gk_tok = pos_q < ng, pos_k < ng
        g_any = _pool(gq_tok, 0, nqt, M, False, lambda x: x.any(-1))[:, None] \
            | _pool(gk_tok, 0, nkt, N, False, lambda x: x.any(-1))[None, :]
        g_full = _pool(gq_tok, 0, nqt, M, True, lambda x: x.all(-1))[:, None] \
            | _pool(gk_tok, 0, nkt, N, True, lambda x: x.all(-1))[None, :]
    else:
        g_any = g_full = ~true
    if kpm is not None:
        k_any = _pool(kpm, 1, nkt, N, False, lambda x: x.any(-1))[:, None, None, :]    # (B, 1, 1, nkt)
        k_full = _pool(kpm, 1, nkt, N, True, lambda x: x.all(-1))[:, None, None, :]
    else:
        k_any = k_full = true
    any_ = (((b_any | g_any) & c_any) | w_any) & s_any & k_any
    full = (b_full | w_full | g_full) & c_full & s_full & k_full & bounds_full & any_
    Bb = max(any_.shape[0], full.shape[0])
    any_ = any_.expand(Bb, *any_.shape[1:]).contiguous()
    full = full.expand(Bb, *any_.shape[1:]).contiguous()
    rows, order, n_all = _sorted_tiles(any_, full)
    t_rows, t_order, t_n_all = _sorted_tiles(any_.transpose(-1, -2), full.transpose(-1, -2))
    if static:      # lists as wide as the grid: nothing is read back
        width, t_width, tiles = any_.shape[-1], any_.shape[-2], -1
    else:           # one host read for the three counts (each read stalls the launches queued behind it)
        width, t_width, tiles = torch.stack([n_all.max(), t_n_all.max(), any_.sum()]).tolist()
    cols = order[..., :max(1, width)].to(torch.int32).contiguous()
    t_cols = t_order[..., :max(1, t_width)].to(torch.int32).contiguous()
    runs = [False, False] if static else torch.stack([_full_run(rows, cols), _full_run(t_rows, t_cols)]).tolist()
    return TileIndex(rows, cols, t_rows, t_cols, seg, pos, bm_mode, bm.to(torch.int8).contiguous(),
                     None if kpm is None else kpm.to(torch.int8).contiguous(), tiles, any_.numel(), *runs)


def _full_run(rows: Tensor, cols: Tensor) -> Tensor:
    """(0-dim bool on the device) each row's full tiles (listed after its partial ones, in ascending column order)
    are consecutive columns: cols[n_all - 1] - cols[n_part] + 1 == n_all - n_part wherever a row has any."""
    n_part, n_all = rows[..., 0].long(), rows[..., 1].long()
    last_slot = cols.shape[-1] - 1
    first = cols.gather(-1, n_part.clamp(max=last_slot).unsqueeze(-1)).squeeze(-1).long()
    last = cols.gather(-1, (n_all - 1).clamp(0, last_slot).unsqueeze(-1)).squeeze(-1).long()
    n_full = n_all - n_part
    return ((n_full == 0) | (last - first + 1 == n_full)).all()


_bm_modes = ValueCache()         # block mask values -> mode: read once on the host


def _bm_mode(bm: Tensor, static: bool) -> int:
    """0 block mask all False, 1 all True, 2 mixed; 2 (always correct) when it cannot be read now."""
    hit = _bm_modes.get((bm,), ())
    if hit is not None:
        return hit
    if static:
        return 2
    some, every = torch.stack([bm.any(), bm.all()]).tolist()       # one host read
    return _bm_modes.put((bm,), (), 2 if some and not every else int(every))
