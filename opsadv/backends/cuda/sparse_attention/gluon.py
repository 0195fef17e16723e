"""Gluon block-sparse attention forward for Hopper, impl "cuda.gluon.sparse_attention" of op
"sparse_attention" (issue #5).

Forward: the persistent, warp-specialized Gluon kernel in gluon_kernel.py (TMA K/V ring, async
wgmma, softmax/GEMM overlap), walking the layout's 128 x 128 tile lists (partial tiles element-masked,
full tiles unmasked, full runs without index loads).  Backward: the Triton sparse backward of sparse.py
from the saved out and lse.  Declared for sm_90 only, bf16/fp16, head_dim 64 or 128; layouts: block
masks (any block size whose refinement to the 128-tiles stays small), sliding windows, causal
(bottom-right), global tokens, key padding, GQA/MQA, s_q != s_k.  Rejected with a reason: packed
varlen batches (cu_seqlens; the kernel has no segment masks).  q/k/v may be any strided (b, h, s, d)
view with unit stride along d and 16-byte aligned strides; other views are copied first.

H200 at fc70817: every probe
check passed (11 layouts x both schedules vs float32, fwd+bwd through the op vs float64).  s=16384 causal
windows, d128 bf16 b1 h32, ms Gluon persistent / Triton sparse / flex: w1024 0.696 / 0.709 / 0.849
(1.22x flex, 0.79x the Triton dense causal TFLOP/s; targets 1.3x and 0.85x not met), w128 0.276 / 0.251,
w256 0.326 / 0.305, w512 0.455 / 0.452, w2048 1.186 / 1.218, w4096 2.114 / 2.035, w8192 3.494 / 3.353.
The persistent schedule wins on short rows (w1024 0.696 vs 0.744 one item per CTA) and loses on long
ones (w8192 3.494 vs 3.379): persistent_schedule() picks per call from the layout's tile count.

Schedules (VARIANTS; gluon_kernel's docstring):
  * "pingpong": the dense kernel's FA3 ping-pong.  Two consumer warpgroups of 64 rows run as separate
    partitions, each with its own Q slots and barriers, and alternate their GEMM issues through two "turn"
    mbarriers.  kv_empty counts 2 arrives.  Registers 240 / 240 / 24.
  * "pingpong_kv": "pingpong" plus separate K and V "empty" barriers (FA3's K/V pipelines; the producer
    loads K_{t+1} before V_t).
  * "st3": d128 3-stage K/V ring with one Q slot.  "pingpong_st3": both.
  * "q1": 1 Q slot at 2 stages, the control that separates st3's ring depth from its one-slot Q.
  All five store O from registers and free each Q slot after the item's last S = Q K^T (O_REGS).
  * "pingpong_st3_kslot" (what auto_schedule runs on d128 band layouts): pingpong_st3 with the
    interval mask whose O leaves by TMA through the rows of the item's last K tile (O_KSLOT), the copy's slot
    freed under the next item's first S, the next item's tile counts read during the epilogue.  H200 at
    3717140 (benchmarks/gluon_fa/sparse_trace_probe.py): per-item fixed cost 3.8k cycles vs 7.3k with the register
    store and 5.0k for the default schedule; the sparse suite's w1024 causal forward 0.531 ms (1.66x flex).
CPU sm_90 compile, causal window d128 bf16, STL/LDL / stack / smem: default 6 (outside the loops) / 16 /
196,916 B; pingpong 0 / 0 / 197,032; pingpong_kv 0 / 0 / 197,064; st3 0 / 0 / 229,724; pingpong_st3 0 / 0 /
229,816; q1 0 / 0 / 164,140.  Masked modes spill in the ping-pong schedules (global tokens: 4 inside the
masked loop; block masks: outside the loops), so they serve windows and causal layouts only.
H200 at b82d17a (every schedule passed every probe check,
both grids), s16384 causal windows d128 bf16 b1 h32, ms default / pingpong_st3 (persistent, one item per CTA) /
Triton sparse / flex: w1024 0.703 / 0.698, 0.772 / 0.691 / 0.847; w2048 ~1.26 / 1.091, 1.169 / 1.233 / 1.414;
w4096 2.08 / 1.887, 1.966 / 2.089 / 2.444; w8192 3.50 / 3.219, 2.991 / 3.385 / 4.077; w128-w512 the
default (pingpong_st3 0.379 / 0.423 / 0.506 vs 0.26-0.45).  auto_schedule() takes pingpong_st3_kslot
on d128 window/causal layouts from SCHEDULE_PINGPONG_MIN_TILES visited tiles per row (it beats the default from
~2 tiles per row: the threshold's comment has the numbers), its persistent grid up to PINGPONG_PERSISTENT_MAX_TILES,
and the default schedule elsewhere.
No-grad calls that do not ask for the lse (the op's inference bucket) run `sparse_fwd_infer`: the kernel built with
WRITE_LSE off (H200: +3.0% at w256, +0.2-0.4% at w1024 / w2048).
Masks (MASK_MODES): band layouts (windows / causal; no mixed block mask, key padding or global tokens) take the
interval mask, two per-row key bounds instead of the element predicate: bitwise the same output, and at 8c5ae80
(H200, same shapes) the
default schedule 0.680 vs 0.726 ms at w1024, 1.184 vs 1.219 at w2048; pingpong_st3 1.095 vs 1.093 at w2048, 1.787
vs 1.819 at w4096.  Compiled for sm_90: the default schedule's spills outside the loops (7), 0 with pingpong_st3.

Passed the pinned H200 conformance catalogue at 0802806, b82d17a and f1b9ea8 (10 pass / 0 fail;
docs/conformance/cuda-h200-gluon-sparse.md), so not experimental.  It ranks below the Triton sparse impl
except for d128 windows of more than 512 keys over long sequences (`_rank`, RANK_*: measured 1.05-1.19x the
Triton kernel there at 8c58d4f), and serves elsewhere where a measurement (autotune / the tuning cache) found it
faster, or when pinned.  When
triton.experimental.gluon does not import, the impl is still registered, rejecting every call with
the import error as the reason, and importing opsadv never fails."""
from __future__ import annotations

import weakref

import torch

from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_TRITON, KernelImpl
from opsadv.core.sparse_tiles import tile_index

from ..common.gluon import cdiv as _cdiv, desc as _desc, gluon_unavailable, nvmma_layout, tma_ready as _tma_ready
from opsadv.backends.triton_common.utils import new_output, new_output_bshd
from opsadv.backends.triton_common.sparse_attention.sparse import refinement_reasons, sparse_bwd as triton_sparse_bwd

try:
    from . import gluon_kernel as _K
    from triton.experimental.gluon import language as _gl
    UNAVAILABLE = ""
except Exception as e:  # ImportError, or an older Triton whose Gluon lacks a name used here
    _K = _gl = None
    UNAVAILABLE = gluon_unavailable(e)

IMPL_ID = "cuda.gluon.sparse_attention"
OP = "sparse_attention"
HEAD_DIMS = (64, 128)
# "varlen" is declared so that check() can say why it is refused instead of a bare "does not support".
FEATURES = frozenset({"causal", "window", "global", "key_padding", "gqa", "cross_length", "varlen"})
LOG2E = 1.4426950408889634
TILE = 128                      # the kernel's query and key tile (BLOCK_M = BLOCK_N)
# K/V ring depth per head dim: next to 2 Q slots (2 x 128 x d) it must fit 227 KB of shared memory.
# d128: 2 x 32 KB + 2 stages x 64 KB = 192 KB (3 stages would need 256 KB); d64: 32 KB + 4 x 32 KB.
STAGES = {128: 2, 64: 4}
SMEM_LIMIT = 232448             # sm_90 opt-in shared memory per block (227 KB)
SMEM_SLACK = 1024               # barriers and the layout-conversion scratch (measured: 308 B at d128)
PRODUCER_REGS = 24              # the 1-warp TMA producer (setmaxnreg); consumers get the rest
CONSUMER_REGS = 240             # each ping-pong consumer warpgroup (2 x 240 + 24 <= 512 per thread x 128)
DEFAULT_VARIANT: dict = {}           # {"persistent": bool, "stages": int, ...}: overrides auto_schedule()
# Named schedules for the benchmarks and tests (see gluon_kernel's docstring); all checked and timed
# on the H200.
VARIANTS = {
    "default": {},                                  # 8 consumer warps, 2 Q slots, STAGES[d]
    "pingpong": {"pingpong": True},                 # 2 consumer warpgroups taking GEMM turns, STAGES[d]
    "st3": {"stages": 3},                           # d128: 3-stage ring, 1 Q slot, O stored from registers
    "pingpong_st3": {"pingpong": True, "stages": 3},
    "q1": {"q_slots": 1},                           # control for st3: 1 Q slot / register O store, STAGES[d]
    "pingpong_kv": {"pingpong": True, "split_empty": True},    # + separate K / V "empty" barriers
    # the partial tiles' mask as per-row key bounds (band layouts only; mask_mode())
    "interval": {"mask": "interval"},
    "pingpong_st3_interval": {"pingpong": True, "stages": 3, "mask": "interval"},
    # O out by TMA through the rows of the item's last K tile (its slot freed after the copy) instead of from registers
    # (sparse_trace_probe.py measured where the ping-pong epilogue's time went)
    "pingpong_st3_kslot": {"pingpong": True, "stages": 3, "mask": "interval", "o_kslot": True},
    # the same with each item's epilogue (normalization, lse, O copy) run under the next item's first S = Q K^T
    # (a CPU timing model ranked it +3.6% at w1024).  H200
    # (51850ec): bitwise equal to pingpong_st3_kslot but runs 0.943 / 0.951 / 0.959
    # / 0.987x its speed at w256 / 1024 / 2048 / 4096 (median round ratios) -- a measured control, not auto_schedule's
    "pingpong_st3_kslot_es0": {"pingpong": True, "stages": 3, "mask": "interval", "o_kslot": True, "early_s0": True},
}
# Partial-tile masks (the kernel's MASK_MODE): the element predicate, per-row key intervals (band layouts: no mixed
# block mask, global tokens or key padding), and "unmasked_probe" -- no mask at all, WRONG results: a benchmark's
# control that times the tile walk without the masks' arithmetic (the op never passes a variant)
MASK_MODES = {"element": 0, "interval": 1, "unmasked_probe": 2}
# Persistent grid (<= one CTA per SM, the K/V ring kept across work items) for short rows, one work item
# per CTA for long ones (H200, fc70817, s16384 d128 causal windows, ms persistent / one item per CTA:
# ~8 tiles per row 0.696 / 0.744, ~16 1.186 / 1.203, ~32 2.114 / 2.088, ~64 3.494 / 3.379).
PERSISTENT_MAX_TILES = 24          # mean visited tiles per (b, h, query tile) up to which persistent wins
# pingpong_st3 (module docstring, b82d17a): faster than the default from ~17 tiles per row (w2048: 1.09 vs
# 1.26 ms), a tie at ~9 (w1024), slower below; its persistent grid wins at ~33 (w4096: 1.887 vs 1.966) and
# loses at ~65 (w8192: 3.219 vs 2.991).  Thresholds sit between the measured points.  H200 at c7efee3
# (persistent, ms default / pingpong_st3_kslot): with O leaving through the
# last K tile the ping-pong schedule wins from ~3 tiles per row: w256 0.312 / 0.267, w512 0.438 / 0.364, w1024
# 0.684 / 0.577, w2048 1.145 / 0.969, w4096 2.015 / 1.707; and at w128 (~2 tiles per row, 0db51d2)
# 0.295 / 0.260.  Rows of ~1 tile were not measured.
SCHEDULE_PINGPONG_MIN_TILES = 1.5
PINGPONG_PERSISTENT_MAX_TILES = 48

_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _sm_counts.get(idx)
    if n is None:
        n = _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def _s3(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B|1, H|1, R, ...) index tensor; 0 on broadcast dims."""
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0, t.stride(2))


def layout_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk):
    """The TileIndex the kernel walks (128 x 128 tiles; cached by core.sparse_tiles)."""
    return tile_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk, TILE, TILE)


def tiles_per_row(ti, n_m: int) -> float:
    """Mean visited tiles per (b, h, query tile) of the index; -1 for an index built during CUDA graph
    capture without host reads (ti.tiles < 0)."""
    if ti.tiles < 0:
        return -1.0
    items = ti.rows.shape[0] * ti.rows.shape[1] * n_m       # (b|1) x (h|1) x query tiles of the index
    return ti.tiles / max(items, 1)


def persistent_schedule(ti, n_m: int) -> bool:
    """The default schedule's grid choice above from the layout's tile count (an index without a host tile
    count, built under graph capture: persistent, the schedule measured at the common window sizes)."""
    per_row = tiles_per_row(ti, n_m)
    return per_row < 0 or per_row <= PERSISTENT_MAX_TILES


def band_layout(ti, kpm, ng: int) -> bool:
    """Windows / causal over an all-True or all-False block mask: no mixed block mask (bm_mode 2, gathered per
    element), key padding or global tokens.  What the interval mask serves and the ping-pong schedules compile
    spill-free for."""
    return ti.bm_mode != 2 and kpm is None and not ng


def auto_schedule(d: int, ti, n_m: int, kpm, ng: int) -> dict:
    """The schedule a call without an explicit variant runs (module docstring): pingpong_st3_kslot for d128
    windows / causal layouts (no mixed block mask, key padding or global tokens: those spill in the
    ping-pong schedules) with rows of ~2 tiles or more, else the default; the grid from the schedule's persistent
    crossover; band layouts (the same "plain" ones) with the interval mask."""
    per_row = tiles_per_row(ti, n_m)
    plain = band_layout(ti, kpm, ng)
    if d == 128 and plain and per_row >= SCHEDULE_PINGPONG_MIN_TILES:
        return {**VARIANTS["pingpong_st3_kslot"], "persistent": per_row <= PINGPONG_PERSISTENT_MAX_TILES}
    return {"persistent": persistent_schedule(ti, n_m), **({"mask": "interval"} if plain else {})}


def smem_bytes(d: int, stages: int, q_slots: int, esize: int = 2) -> int:
    """Q slots (128 rows each, split between the ping-pong warpgroups) plus the K and V rings."""
    return (q_slots * TILE + 2 * stages * TILE) * d * esize


def resolve_schedule(d: int, stages=None, q_slots=None, pingpong=False, split_empty=False, o_kslot=False,
                     early_s0=False) -> dict:
    """Kernel constexprs of a variant: STAGES (default STAGES[d]), Q_SLOTS (2 when it fits next to the
    ring, else 1), PINGPONG, and O_REGS: O stored from registers and the Q slot released after the
    item's last S (every new schedule; needed with 1 Q slot; the ping-pong TMA store through the slot
    spilled), SPLIT_EMPTY (K and V slots freed apart), O_KSLOT (O leaves by TMA through the rows of the item's
    last K tile instead of from registers; needs O_REGS' early Q release and K slots freed with their V), EARLY_S0
    (each item's epilogue runs under the next item's first S; needs O_KSLOT).
    ValueError when the ring does not fit even with one Q slot, or O_KSLOT / EARLY_S0 cannot serve."""
    stages = stages or STAGES[d]
    if q_slots is None:
        q_slots = 2 if smem_bytes(d, stages, 2) + SMEM_SLACK <= SMEM_LIMIT else 1
    if q_slots not in (1, 2) or smem_bytes(d, stages, q_slots) + SMEM_SLACK > SMEM_LIMIT:
        raise ValueError(f"{IMPL_ID}: d{d} with {stages} K/V stages and {q_slots} Q slots needs "
                         f"{smem_bytes(d, stages, q_slots)} B of shared memory (limit {SMEM_LIMIT})")
    o_regs = bool(pingpong) or q_slots == 1
    if o_kslot and (not o_regs or split_empty):
        raise ValueError(f"{IMPL_ID}: o_kslot (O out through the last K tile) needs a schedule that frees its Q slot "
                         f"early (ping-pong or one Q slot; got pingpong={bool(pingpong)}, q_slots={q_slots}) and "
                         f"K slots freed with their V (split_empty=False, got {bool(split_empty)})")
    if early_s0 and not o_kslot:
        raise ValueError(f"{IMPL_ID}: early_s0 (the epilogue under the next item's first S) moves the O copy through "
                         f"the last K tile with it: it needs o_kslot=True")
    return dict(STAGES=stages, Q_SLOTS=q_slots, PINGPONG=bool(pingpong), O_REGS=o_regs, SPLIT_EMPTY=bool(split_empty),
                O_KSLOT=bool(o_kslot), EARLY_S0=bool(early_s0))


def mask_mode(mask: str, ti, kpm, ng: int) -> int:
    """The kernel's MASK_MODE for a variant's "mask" (MASK_MODES); ValueError naming why it cannot serve."""
    if mask not in MASK_MODES:
        raise ValueError(f"{IMPL_ID}: mask must be one of {sorted(MASK_MODES)}, got {mask!r}")
    if mask == "interval" and not band_layout(ti, kpm, ng):
        raise ValueError(f"{IMPL_ID}: interval masks serve band layouts only (a window and/or causal over an all-True "
                         f"or all-False block mask), not a mixed block mask, key padding or global tokens")
    return MASK_MODES[mask]


def order_auto(persistent: bool, ng: int, sched: dict) -> bool:
    """Where the balanced deal is on by default: persistent grids (a grid of one item per CTA is balanced by the
    hardware's block scheduler), except with global tokens and the split K / V barriers (SPLIT_EMPTY): the read
    of the item adds a live register there and ptxas spills (sm_90 compile: global tokens 2 STL/LDL inside the
    tile loops, pingpong_kv 6 outside; 0 in the tile loops of every other mode, tests/test_gluon_sparse.py)."""
    return bool(persistent) and not ng and not sched["SPLIT_EMPTY"]


_order_cache: dict[int, tuple] = {}      # id(ti.rows) -> (weakref to it, {(b, h, n_m, reverse, nprog): perm})


def item_order(ti, b: int, hq: int, n_m: int, reverse: bool, nprog: int) -> torch.Tensor:
    """int32 (n_items,) perm: the work item of each slot of a grid of nprog CTAs, CTA c walking slots c, c + nprog,
    ...  Items (item w = (b * hq + h) * n_m + query tile, reversed when causal: sparse_fwd_kernel's _item) are
    sorted by visited tiles, longest first, and dealt a round of nprog at a time, every other round backwards
    (a snake; the last, partial round forwards, so slots < n_items are exactly the dealt ones).  Why: the static
    round-robin of a persistent grid gave its busiest CTA 4.1-4.7% more tiles than the mean at s16384 h32 causal
    windows 512 to 8192 (CTA 0 gets the longest item of every round); the snake brings that to <= 0.6% (1.5% at
    window 512; tests/test_gluon_sparse.py); H200: 1.003 / 1.016 / 1.011x the round-robin at windows 1024 / 2048 /
    4096.  With one item per CTA (nprog = n_items) it is plain longest-first, which ran 0.97x there (w8192), so
    order_auto() leaves those grids round-robin.  Computed on the GPU (no host sync), cached per tile index outside
    CUDA graph capture (a captured perm holds its values only once the graph has replayed)."""
    key = (b, hq, n_m, bool(reverse), nprog)
    slot = _order_cache.get(id(ti.rows))
    if slot is not None and slot[0]() is ti.rows and key in slot[1]:
        return slot[1][key]
    n_all = ti.rows[..., 1].expand(b, hq, n_m)               # visited tiles per (b, h, query tile)
    if reverse:
        n_all = n_all.flip(-1)
    order = torch.argsort(n_all.reshape(-1), descending=True, stable=True)
    n_items = order.numel()
    r = torch.arange(n_items, device=order.device)
    rnd, i = r // nprog, r % nprog
    backwards = (-(-n_items // nprog) - 1 - rnd) % 2 == 1            # the last round forwards
    perm = torch.empty(n_items, dtype=torch.int32, device=order.device)
    perm[rnd * nprog + torch.where(backwards, nprog - 1 - i, i)] = order.to(torch.int32)
    if not (perm.is_cuda and torch.cuda.is_current_stream_capturing()):
        if slot is None or slot[0]() is not ti.rows:
            slot = _order_cache[id(ti.rows)] = (weakref.ref(ti.rows), {})
        slot[1][key] = perm
    return perm


def launch_args(q, k, v, out, lse, ti, kpm, bs, causal, wl, wr, ng, scale, *, persistent=True, stages=None,
                q_slots=None, pingpong=False, split_empty=False, num_sms=132, order=None, mask="element", trace=None,
                o_kslot=False, early_s0=False):
    """(grid, args, kwargs) of one sparse_fwd_kernel launch writing out (b, h_q, s_q, d) and lse
    (b, h_q, s_q) float32 contiguous (lse None: not computed, WRITE_LSE=False).  q/k/v/out must be TMA-ready (see
    _tma_ready); ti: layout_index().
    order: slots dealt by item_order (else round-robin in item order); None: order_auto()'s rule.  mask: a
    MASK_MODES name (mask_mode()).  trace (probes): an int64 (n_items, 2, TRACE_STAMPS) tensor the TRACE build fills
    with the consumers' %clock64 stamps per work item (the kernel's _stamp).  o_kslot, early_s0: resolve_schedule()."""
    if _K is None:
        raise RuntimeError(f"{IMPL_ID}: {UNAVAILABLE}")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    gdt = _gl.bfloat16 if q.dtype == torch.bfloat16 else _gl.float16
    sched = resolve_schedule(d, stages, q_slots, pingpong, split_empty, o_kslot, early_s0)
    if sched["O_REGS"] and (sq + TILE) * out.stride(2) >= 2 ** 31:
        raise ValueError(f"{IMPL_ID}: the register O store of this schedule uses 32-bit row offsets "
                         f"(s_q {sq} x row stride {out.stride(2)}); use the default schedule")
    if sched["O_REGS"] and any(st % 8 for st in out.stride()[:3]):
        raise ValueError(f"{IMPL_ID}: the register O store forms its item offset in units of 8 elements (so that "
                         f"it can store 4-byte pieces): out's (b, h, s) strides must be multiples of 8, got "
                         f"{tuple(out.stride()[:3])}")
    if trace is not None and sched["EARLY_S0"]:
        raise ValueError(f"{IMPL_ID}: the TRACE build has no stamps for early_s0 (its extra turn past the last item "
                         f"would stamp past the trace buffer)")
    bq = TILE // 2 if sched["PINGPONG"] else TILE           # Q/O rows per consumer partition
    n_m = _cdiv(sq, TILE)
    n_items = n_m * b * hq
    n_st = _K.TRACE_STAMPS.value if trace is not None else 0
    if trace is not None and (trace.shape != (n_items, 2, n_st) or trace.dtype != torch.int64
                              or trace.device != q.device):
        raise ValueError(f"{IMPL_ID}: trace must be an int64 ({n_items}, 2, {n_st}) tensor on {q.device}, got "
                         f"{trace.dtype} {tuple(trace.shape)} on {trace.device}")
    grid = (min(n_items, num_sms) if persistent else n_items,)
    bm8 = ti.bm8
    s_bm = (bm8.stride(0) if bm8.shape[0] > 1 else 0, bm8.stride(1) if bm8.shape[1] > 1 else 0,
            bm8.stride(2), bm8.stride(3))
    kpm8 = ti.kpm8 if ti.kpm8 is not None else ti.rows      # unused pointer when there is no key padding
    if order is None:
        order = order_auto(persistent, ng, sched)
    perm = item_order(ti, b, hq, n_m, causal, grid[0]) if order else ti.rows   # ti.rows: unused without ORDER
    s_kpm = ti.kpm8.stride(0) if ti.kpm8 is not None else 0
    descs = (_desc(q, bq, gdt), _desc(k, TILE, gdt), _desc(v, TILE, gdt), _desc(out, bq, gdt))
    kw = dict(q_smem_layout=nvmma_layout((bq, d), gdt),
              kv_smem_layout=nvmma_layout((TILE, d), gdt),
              CAUSAL=bool(causal), HAS_WIN=wl >= 0, HAS_GLOBAL=ng > 0, BM_MODE=int(ti.bm_mode),
              HAS_KPM=kpm is not None, FULL_RUN=bool(ti.full_run), REVERSE=bool(causal), ORDER=bool(order), **sched,
              MASK_MODE=mask_mode(mask, ti, kpm, ng), TRACE=trace is not None, WRITE_LSE=lse is not None,
              CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
              num_warps=_K.PINGPONG_WARPS if sched["PINGPONG"] else _K.NUM_WARPS)
    lse_arg = lse if lse is not None else out                # (an unused pointer with WRITE_LSE=False)
    args = (*descs, lse_arg, out, ti.rows, ti.cols, bm8, kpm8, perm, *out.stride()[:3], *_s3(ti.rows), *_s3(ti.cols),
            *s_bm, s_kpm, hq, hq // hkv, n_m, n_items, sq, sk, sk - sq, wl, wr, ng, bs, scale * LOG2E,
            lse_arg if trace is None else trace)
    return grid, args, kw


def sparse_fwd(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks=False,
               max_seqlen=-1, *, variant=None, need_lse=True):
    """out (b, h_q, s_q, d) over (b, s, h, d) memory, lse (b, h_q, s_q) float32 natural log (need_lse=False:
    None, the kernel neither computes nor stores it -- the impl's `inference` forward for no-grad calls).
    variant (benchmarks): {"persistent": bool, "stages": int, "q_slots": 1 | 2, "pingpong": bool,
    "split_empty": bool, "order": bool, "mask": a MASK_MODES name, "trace": launch_args' trace, "o_kslot": bool,
    "early_s0": bool}
    (or a VARIANTS name) over DEFAULT_VARIANT; None: auto_schedule()."""
    if cu is not None:   # check() refuses these; a direct call must not get a silently wrong answer
        raise NotImplementedError(f"{IMPL_ID}: packed varlen layouts (cu_seqlens) are not supported")
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    ti = layout_index(block_mask, kpm, cu, bs, causal, wl, wr, ng, sq, sk)
    out = new_output_bshd(q.shape, q.dtype, q.device)
    lse = new_output((b, hq, sq), torch.float32, q.device) if need_lse else None
    n_m = _cdiv(sq, TILE)
    if variant is None:
        opts = {**auto_schedule(d, ti, n_m, kpm, ng), **DEFAULT_VARIANT}
    else:
        opts = {**DEFAULT_VARIANT, **(VARIANTS[variant] if isinstance(variant, str) else variant)}
    persistent = opts["persistent"] if "persistent" in opts else persistent_schedule(ti, n_m)
    grid, args, kw = launch_args(q, k, v, out, lse, ti, kpm, bs, causal, wl, wr, ng, scale,
                                 persistent=persistent, stages=opts.get("stages"), q_slots=opts.get("q_slots"),
                                 pingpong=opts.get("pingpong", False), split_empty=opts.get("split_empty", False),
                                 num_sms=_sm_count(q.device), order=opts.get("order"), mask=opts.get("mask", "element"),
                                 trace=opts.get("trace"), o_kslot=opts.get("o_kslot", False),
                                 early_s0=opts.get("early_s0", False))
    _K.sparse_fwd_kernel[grid](*args, **kw)
    return out, lse


def sparse_fwd_infer(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks=False,
                     max_seqlen=-1):
    """KernelImpl.inference: a no-grad eager call's forward, (out, None) -- the lse nobody reads is not computed."""
    return sparse_fwd(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks, max_seqlen,
                      need_lse=False)


def sparse_bwd(ctx, dout, q, k, v, out, lse, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale,
               dense_blocks=False, max_seqlen=-1):
    """The Triton sparse backward (dK/dV and dQ kernels, no atomics) from out and lse."""
    return triton_sparse_bwd(ctx, dout, q, k, v, out, lse, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale,
                             dense_blocks, max_seqlen)


def _check(spec, env) -> list[str]:
    if UNAVAILABLE:
        return [UNAVAILABLE]
    why = []
    if env.triton_interpret:
        why.append("TRITON_INTERPRET=1: Gluon kernels do not run under the Triton interpreter")
    if "varlen" in spec.features:
        why.append("packed varlen layouts (cu_seqlens) need segment masks the Gluon kernel does not have "
                   "(cuda.triton.sparse_attention serves them)")
    why.extend(refinement_reasons(spec, TILE))
    return why


# Where this impl ranks above the Triton sparse impl without a measurement on the caller's machine (rank()):
# d128 band layouts (window, optionally causal; no global tokens, key padding, packed varlen, GQA or q / k of
# different lengths) with a window span of more than 512 keys over long sequences.  H200 bf16 s16384 h32 causal
# (the sparse suite's tuner at 8c58d4f, ms Gluon / Triton): window span
# bucket 1024 (w512) 0.352 / 0.413, 2048 (w1024) 0.558 / 0.664, 4096 0.931 / 1.106, 8192 1.621 / 1.843, 16384
# 2.770 / 3.003; training (fwd + bwd) at w1024 2.583 / 2.714; below that the Triton kernel wins (w256 0.302 / 0.272,
# w128 0.284 / 0.214) and it stays first.  The bucket does not tell a window over an all-True block mask from one
# combined with a mixed block mask (its kernel path then takes the element mask and the default schedule): those
# rank the same, unmeasured.
RANK_MIN_WINDOW_SPAN = 1024        # the window span bucket (_window_bucket: next power of two of left + right + 1)
RANK_MIN_SEQ = 16384               # the s_q bucket measured (longer sequences only add work items per CTA)
RANK_EXCLUDED = frozenset({"global", "key_padding", "varlen", "gqa", "cross_length"})


def _rank(spec, env) -> tuple[int, str] | None:
    """KernelImpl.rank: above the Triton impl where the H200 measured this kernel faster (see RANK_*)."""
    if spec.backward or spec.head_dim != 128 or "window" not in spec.features or spec.features & RANK_EXCLUDED:
        return None
    bucket = spec.bucket            # (block_size, s_q, s_k, window span) buckets: opsadv.ops.sparse_attention._spec
    if len(bucket) < 4 or bucket[3] < RANK_MIN_WINDOW_SPAN or bucket[1] < RANK_MIN_SEQ:
        return None
    return (PRIORITY_TRITON + 10, f"d128 window span > {RANK_MIN_WINDOW_SPAN // 2} keys at s_q > {RANK_MIN_SEQ // 2}: "
            f"H200-measured 1.05-1.19x the Triton sparse kernel (opsadv.backends.cuda.sparse_attention.gluon.RANK_MIN_WINDOW_SPAN)")


def impls(env) -> list[KernelImpl]:
    return [KernelImpl(
        id=IMPL_ID, op=OP, backend="cuda", fn=sparse_fwd, backward=sparse_bwd, inference=sparse_fwd_infer,
        # below the Triton impl, except where rank() says the H200 measured it faster (long windows at d128);
        # elsewhere it serves a bucket where a measurement (autotune / the tuning cache) found it faster, or pinned
        priority=PRIORITY_TRITON - 10, device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16),
        head_dims=HEAD_DIMS, min_cc=(9, 0), max_cc=(9, 0), features=FEATURES, deterministic=True,
        check=_check, rank=_rank, memory=MEMORY_FLASH,
        description="Gluon block-sparse forward for Hopper (persistent, TMA K/V ring across work items, "
                    "async wgmma, softmax/GEMM overlap; 128x128 tile lists, partial tiles element-masked; "
                    "d128 windows / causal from ~2 tiles per row: ping-pong warpgroups over a 3-stage ring, O out "
                    "through the last K tile; no lse for no-grad calls); Triton sparse backward from out + lse")]


__all__ = ["impls", "sparse_fwd", "sparse_fwd_infer", "sparse_bwd", "launch_args", "layout_index", "resolve_schedule",
           "auto_schedule", "UNAVAILABLE", "IMPL_ID", "STAGES", "VARIANTS", "DEFAULT_VARIANT"]
