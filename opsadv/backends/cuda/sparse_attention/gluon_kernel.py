"""Block-sparse flash-attention forward for Hopper (sm_90) in Gluon (triton.experimental.gluon, Triton 3.6).

Imported only by gluon.py, and only when triton.experimental.gluon imports.  The dense FA3-style
schedule of flash_attention/gluon_kernel.py (TMA K/V ring with ready/empty mbarriers, async wgmma, S_{j+1} issued
before the softmax of S_j's successor, P in registers), driven by the layout's tile lists
(opsadv.core.sparse_tiles.TileIndex at 128 x 128) instead of a dense column range:

  * A work item is one 128-row query tile of one (batch, head).  Its list holds n_part partial tiles
    first (column ids in COLS), then n_all - n_part full ones.  With FULL_RUN (TileIndex.full_run:
    windows, causal) the full tiles are the column run [COLS[n_part], +n_all - n_part) and need no
    index loads; otherwise every id comes from COLS.
  * Partial tiles get the element mask of sparse.py's `_allowed` (block-mask bit, window band,
    global tokens, causal diagonal, key padding, bounds); full tiles run unmasked.  MASK_MODE
    interval (band layouts: windows / causal, no mixed block mask, globals or key padding): the same
    mask as two per-row key bounds (_row_interval_mask), bitwise the same output, fewer instructions.
  * Persistent: grid = min(items, SMs); CTA p takes items p, p + grid, ...  A 1-warp producer walks
    the same item sequence and keeps loading across item boundaries, so the next item's Q (two Q
    slots, q_ready/q_empty barriers) and first K/V tiles are in shared memory when the consumers
    finish the current one.  Ring slots and phases follow a tile counter carried over all items.
  * O leaves through its item's Q slot by TMA store (rows past s_q clipped); the slot is released to
    the producer once the store has read it.  lse (natural log) by plain stores.
  * O_REGS (every schedule added for issue #5; the measured default keeps the TMA store): O goes out
    from registers by plain masked stores, and each Q slot is released as soon as the item's last
    S = Q K^T has retired (before the last P V), so the producer loads the next item's Q under the
    last P V and the epilogue.  Needed with Q_SLOTS == 1, what a 3-stage K/V ring at d128 leaves
    room for (1 x 32 KB of Q + 3 x 64 KB of K/V).  (With ping-pong the TMA store through the slot
    compiled with spills; the register store and the opaque per-item values of _item/_pid compile
    with none.)
  * PINGPONG (FA3 3.1, as in flash_attention/gluon_kernel.py): each consumer warpgroup is its own partition owning
    64 of the item's 128 rows, with its own Q slot(s) and barriers; both walk the same items and
    tiles.  They take turns issuing their GEMMs through a pair of "turn" mbarriers (warpgroup 0
    pre-armed, a turn counter carried across items), so one warpgroup's softmax runs while the
    other's GEMMs hold the tensor cores.  kv_empty counts one arrive per warpgroup.
  * O_KSLOT (with O_REGS' early Q release): O leaves by TMA through the partition's rows of the
    item's last K tile instead of from registers.  Every S that read the tile has retired (this partition's
    in its tile loops, the other warpgroup's by k_done: one arrive per warpgroup and item), and the ring slot
    is released only after the copy has read it -- at the next item's first S, so nothing waits for the copy
    at the boundary; the next item's tile counts are loaded during the epilogue for the same reason.  Items
    with no tile store their zeros from registers.  (The register store, even in 4-byte pieces, costs far more
    per item than one TMA copy: sparse_trace_probe.py.)
  * WRITE_LSE=False (no-grad calls through KernelImpl.inference): the lse is neither computed nor stored.
  * EARLY_S0 (with O_KSLOT): an item's epilogue (1 / l, the lse,
    O into its last K tile and the copy) runs in the next turn of the item loop, under that item's first S = Q K^T
    (or, for an empty item, before its idle turn's end), and one extra empty turn past the CTA's last item runs the
    last one; the copy's slot is released once that S has retired.  k_done then counts only items with tiles: with
    the wait one item later, empty items' arrivals could complete a phase for one warpgroup alone.  Ranked +3.6% at
    w1024 by a CPU timing model; on the H200 bitwise right but 4-6% slower
    at w256-w2048: a measured control.
  * SPLIT_EMPTY (FA3's separate K and V pipelines, as the dense kernel's pingpong_kv): a K slot is
    freed on k_empty as soon as its S has retired, a V slot on kv_empty after its P V, and the
    producer loads K_{t+1} before V_t.  With one shared barrier and ping-pong, tile j+STAGES waits for
    warpgroup 1's P V of tile j, half an iteration behind warpgroup 0.

Rows with no allowed key get out 0 and lse -inf (running max starts finite, at -1e30, so a fully
masked tile yields p = 0, not NaN).  q/k/v/out are (b, h, s, d) strided views with unit stride along
d and 16-byte aligned strides (4-D TMA descriptors, block (1, 1, 128, d): tiles never straddle heads,
rows past s are zero on load).  GQA: q head h reads kv head h // GROUP."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# the dense kernel's K/V TMA issue, ping-pong turn and buffer-release steps, shared (inlined the same in both)
from ..common.gluon_kv_ring import _issue_kv, _issue_one, _release, _turn_pass, _turn_wait

BLOCK_M = 128       # query rows per work item
BLOCK_N = 128       # key/value rows per ring stage (the tile lists' column tile)
NUM_WARPS = 8       # consumer warps: 2 warpgroups of 64 rows, one instruction stream
PINGPONG_WARPS = 4  # with PINGPONG: one warpgroup per consumer partition (the default partition is one of them)
# MASK_MODE of a partial tile: the element predicate of _allowed; per-row key intervals (_row_interval_mask, band
# layouts only: no mixed block mask, globals or key padding); or none at all -- a probe's control that times the
# tile walk without the masks' arithmetic (wrong results: never reachable from the op, see gluon.MASK_MODES)
MASK_ELEMENT: gl.constexpr = gl.constexpr(0)
MASK_INTERVAL: gl.constexpr = gl.constexpr(1)
MASK_NONE_PROBE: gl.constexpr = gl.constexpr(2)
# TRACE build: %clock64 stamps per work item and consumer warpgroup (gluon.launch_args' trace buffer is
# int64 (n_items, 2, TRACE_STAMPS)); in time order 0 start, 11 item decoded, 1 Q ready, 2 S_0 retired, 3 its softmax,
# 4 tile loops done, 5 last P V retired, 8 its slot released, 9 item decoded again, 10 lse stored, 6 O stored
TRACE_STAMPS: gl.constexpr = gl.constexpr(16)


@gluon.jit
def _opaque(x):
    """x, through an inline-asm mov LLVM cannot see through or hoist: values derived from it are
    recomputed where used instead of held in a register across the tile loops (per-item values
    hoisted out of the persistent item loop were what spilled)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stamp(trace_ptr, slot, k: gl.constexpr, WG: gl.constexpr, TRACE: gl.constexpr):
    """TRACE (a probe's build; no code otherwise): this SM's %clock64 into trace[slot, WG, k] (int64 (n_items, 2, TRACE_STAMPS)),
    marking where a work item's time goes (benchmarks/gluon_fa/sparse_trace_probe.py)."""
    _stamp_after(trace_ptr, slot, k, WG, TRACE, slot)


@gluon.jit
def _stamp_after(trace_ptr, slot, k: gl.constexpr, WG: gl.constexpr, TRACE: gl.constexpr, dep):
    """_stamp once the int32 scalar dep is available: the clock read takes dep as its operand, so it waits for the
    load that produces dep (a plain stamp marks when the instructions before it were issued, not completed)."""
    if TRACE:
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(trace_ptr + (slot.to(gl.int64) * 2 + WG) * TRACE_STAMPS + k, t)


@gluon.jit
def _store_o_rows(o, o_ptr, b, h, row0, SQ, s_ob, s_oh, s_os, BM: gl.constexpr, D: gl.constexpr,
                  o_layout: gl.constexpr):
    """O_REGS: o (BM x D, out's dtype, the accumulator layout: 2 adjacent columns per thread) to out rows
    [row0, row0 + BM) of head (b, h), rows past SQ dropped.  The item offset is formed as a multiple of 8 elements
    (the host checks the strides) so the compiler can pair the columns into 4-byte stores: from opaque strides alone
    it knew no alignment and stored 2-byte pieces, twice the instructions.  (A layout with 16 bytes per thread
    would need a conversion through shared memory: ~3.8 KB of scratch, which a 3-stage ring at d128 leaves no room
    for.)  Row offsets are 32-bit (the host checks s_q x row stride < 2^31; 64-bit ones or an item base spilled)."""
    r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    # (opaque strides: their hoisted 64-bit sign extensions were spilled across the loops)
    item = (b.to(gl.int64) * (_opaque(s_ob) >> 3).to(gl.int64) + h.to(gl.int64) * (_opaque(s_oh) >> 3).to(gl.int64)) * 8
    optr = o_ptr + item + gl.expand_dims(r * s_os, 1) + gl.expand_dims(c, 0)
    gl.store(optr, o, mask=gl.expand_dims(r < SQ, 1))


@gluon.jit
def _pid(OPAQUE: gl.constexpr):
    """gl.program_id(0); OPAQUE: read where it is used (LLVM hoisted the shared read to the kernel entry
    and the ping-pong build spilled it there for every partition)."""
    if OPAQUE:
        return gl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    else:
        return gl.program_id(0)


@gluon.jit
def _maybe_opaque(x, OPAQUE: gl.constexpr):
    if OPAQUE:
        return _opaque(x)
    else:
        return x


@gluon.jit
def _work_item(slot, perm_ptr, ORDER: gl.constexpr):
    """The work item at this CTA's slot: ORDER, perm[slot] (gluon.item_order: longest items first, dealt
    so that a persistent grid's CTAs get near-equal tile counts); else the slot itself (round-robin)."""
    if ORDER:
        # volatile: the consumer's second read after the tile loops must not be merged with the first (the
        # merged value stayed live across the loops and spilled)
        return gl.load(perm_ptr + slot, volatile=True)
    else:
        return slot


@gluon.jit
def _item(w, H, n_m, REVERSE: gl.constexpr, OPAQUE: gl.constexpr):
    """(batch, head, query tile) of work item w: items of one head are consecutive (K/V reuse in L2);
    REVERSE: last query tiles first within a head (the longest rows when causal).  OPAQUE (the new
    schedules; the measured default keeps its code): n_m - 1 is not hoisted (it was spilled)."""
    bh = w // n_m
    mt = w % n_m
    if REVERSE:
        mt = _maybe_opaque(n_m, OPAQUE) - 1 - mt
    return bh // H, bh % H, mt, bh


@gluon.jit
def _item_counts(slot, perm_ptr, rows_ptr, s_rb, s_rh, s_rr, H, n_m, n_items, ORDER: gl.constexpr,
                 REVERSE: gl.constexpr, OPAQUE: gl.constexpr):
    """(w, n_part, n_all) of the work item at `slot`; zeros past the last slot (the loads are masked).  O_KSLOT
    reads the next item's counts during the current item's epilogue, so their two dependent loads are not
    waited for at the next item's start (~700 cycles an item on the H200, sparse_trace_probe.py)."""
    ok = slot < n_items
    if ORDER:
        w = gl.load(perm_ptr + slot, mask=ok, other=0, volatile=True)
    else:
        w = slot
    b, h, mt, bh = _item(w, H, n_m, REVERSE, OPAQUE)
    row = rows_ptr + b * s_rb + h * s_rh + mt * s_rr
    return w, gl.load(row, mask=ok, other=0), gl.load(row + 1, mask=ok, other=0)


@gluon.jit
def _tile_col(cols, t, n_part, run0, FULL_RUN: gl.constexpr):
    """Column tile of an item's t-th listed tile: from the list, or (FULL_RUN, t >= n_part) the run."""
    if FULL_RUN:
        if t < n_part:
            kt = gl.load(cols + t)
        else:
            kt = run0 + t
    else:
        kt = gl.load(cols + t)
    return kt


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
              rows_ptr, cols_ptr, perm_ptr, s_rb, s_rh, s_rr, s_cb, s_ch, s_cr, H, GROUP, n_m, n_items,
              REVERSE: gl.constexpr, ORDER: gl.constexpr, FULL_RUN: gl.constexpr, STAGES: gl.constexpr,
              Q_SLOTS: gl.constexpr,
              NWG: gl.constexpr, OPAQUE: gl.constexpr, k_empty, SPLIT_EMPTY: gl.constexpr):
    """1 warp: for each of this CTA's items, Q into slot qi % Q_SLOTS (one 128 / NWG-row part per consumer
    partition, each on its own barriers), then its listed K/V tiles into the ring as fast as the
    consumers free slots.  SPLIT_EMPTY: a K slot is free once its S has retired (k_empty), a V slot
    after its P V (kv_empty); K_{t+1} is loaded before V_t, the order the consumers free them in."""
    BQ: gl.constexpr = q_desc.block_type.shape[2]      # rows per consumer partition
    BN: gl.constexpr = k_desc.block_type.shape[2]
    q_view: gl.constexpr = q_desc.block_type.shape
    kv_view: gl.constexpr = k_desc.block_type.shape
    it = 0          # K/V tiles issued so far (all items): ring slot it % STAGES, lap it // STAGES
    qi = 0          # items started so far: Q slot qi % Q_SLOTS
    for slot in range(_pid(OPAQUE), n_items, gl.num_programs(0)):
        w = _work_item(slot, perm_ptr, ORDER)
        b, h, mt, bh = _item(w, H, n_m, REVERSE, OPAQUE)
        hk = h // GROUP
        row = rows_ptr + b * s_rb + h * s_rh + mt * s_rr
        n_part = gl.load(row)
        n_all = gl.load(row + 1)
        cols = cols_ptr + b * s_cb + h * s_ch + mt * s_cr
        for wg in gl.static_range(NWG):
            qs = (qi % Q_SLOTS) * NWG + wg
            # Parity of the slot's previous release; on a fresh barrier parity 1 passes at once.
            mbarrier.wait(q_empty.index(qs), ((qi // Q_SLOTS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, (mt * NWG + wg) * BQ, 0], q_ready.index(qs),
                                            q_smem.index(qs)._reinterpret(q_desc.dtype, q_view, q_desc.layout))
        if SPLIT_EMPTY:
            run0 = gl.load(cols + n_part, mask=n_part < n_all, other=0) - n_part
            if n_all > 0:
                mbarrier.wait(k_empty.index(it % STAGES), ((it // STAGES) & 1) ^ 1)
                kt = _tile_col(cols, 0, n_part, run0, FULL_RUN)
                _issue_one(k_desc, k_smem, k_ready, b, hk, kt * BN, it % STAGES, kv_view)
            for t in range(0, n_all):
                g = it + t
                if t + 1 < n_all:
                    mbarrier.wait(k_empty.index((g + 1) % STAGES), (((g + 1) // STAGES) & 1) ^ 1)
                    kt = _tile_col(cols, t + 1, n_part, run0, FULL_RUN)
                    _issue_one(k_desc, k_smem, k_ready, b, hk, kt * BN, (g + 1) % STAGES, kv_view)
                mbarrier.wait(kv_empty.index(g % STAGES), ((g // STAGES) & 1) ^ 1)
                kt = _tile_col(cols, t, n_part, run0, FULL_RUN)       # reloaded (L1) rather than kept
                _issue_one(v_desc, v_smem, v_ready, b, hk, kt * BN, g % STAGES, kv_view)
            it += n_all
        else:
            for t in range(0, n_part):                  # partial tiles: ids from the list
                kt = gl.load(cols + t)
                stage = it % STAGES
                mbarrier.wait(kv_empty.index(stage), ((it // STAGES) & 1) ^ 1)
                _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, kt * BN, stage, kv_view)
                it += 1
            run0 = gl.load(cols + n_part, mask=n_part < n_all, other=0) - n_part
            for t in range(n_part, n_all):              # full tiles: a column run, or ids from the list
                if FULL_RUN:
                    kt = run0 + t
                else:
                    kt = gl.load(cols + t)
                stage = it % STAGES
                mbarrier.wait(kv_empty.index(stage), ((it // STAGES) & 1) ^ 1)
                _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, kt * BN, stage, kv_view)
                it += 1
        qi += 1


@gluon.jit
def _allowed(rows, cols, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SQ, SK, OFF, WL, WR, NG, BS,
             CAUSAL: gl.constexpr, HAS_WIN: gl.constexpr, HAS_GLOBAL: gl.constexpr, BM_MODE: gl.constexpr,
             HAS_KPM: gl.constexpr):
    """allowed(i, j) as opsadv.ops.sparse_attention.layout defines it (sparse.py's _allowed without packed segments),
    for query rows `rows` x key columns `cols` of one tile, in the score tile's layout."""
    i = gl.expand_dims(rows, 1)
    j = gl.expand_dims(cols, 0)
    ip = i + OFF                                    # bottom-right aligned query position
    inb = (i < SQ) & (j < SK)
    if BM_MODE == 2:                                # mixed block mask: its bit per element
        ok = gl.load(bm_ptr + (i // BS) * s_bm_q + (j // BS) * s_bm_k, mask=inb, other=0) != 0
    elif BM_MODE == 1:
        ok = inb
    else:
        ok = (i < 0) & (j < 0)                      # all False, tile-shaped
    if HAS_WIN:
        ok = ok | ((j >= ip - WL) & (j <= ip + WR))
    if HAS_GLOBAL:
        ok = ok | (i < NG) | (j < NG)
    if CAUSAL:
        ok = ok & (j <= ip)
    if HAS_KPM:
        kp = gl.load(kpm_ptr + cols, mask=cols < SK, other=0) != 0
        ok = ok & gl.expand_dims(kp, 0)
    return ok & inb


@gluon.jit
def _row_interval_mask(rows, kt, SQ, SK, OFF, WL, WR, CAUSAL: gl.constexpr, HAS_WIN: gl.constexpr,
                       BM_MODE: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr):
    """allowed(i, j) when each row's allowed keys are one interval [lo_i, hi_i] (block mask all False
    with a window, or all True; no globals, no key padding), compared against the column offset
    within tile kt: two per-row bounds instead of per-element column arithmetic (registers)."""
    ip = rows + OFF
    if BM_MODE == 1:
        lo = gl.zeros_like(ip)
    elif HAS_WIN:
        lo = ip - WL
    else:
        lo = gl.zeros_like(ip) + SK                 # block mask all False, no window: nothing
    hi = gl.zeros_like(ip) + (SK - 1)
    if BM_MODE == 0 and HAS_WIN:
        hi = gl.minimum(hi, ip + WR)
    if CAUSAL:
        hi = gl.minimum(hi, ip)
    hi = gl.where(rows < SQ, hi, -1)
    c0 = kt * BN
    c = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout)), 0)
    return (c >= gl.expand_dims(lo - c0, 1)) & (c <= gl.expand_dims(hi - c0, 1))


@gluon.jit
def _softmax_masked(s, m_i, l_i, rows, kt, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SQ, SK, OFF, WL, WR, NG, BS, qk_scale,
                    CAUSAL: gl.constexpr, HAS_WIN: gl.constexpr, HAS_GLOBAL: gl.constexpr, BM_MODE: gl.constexpr,
                    HAS_KPM: gl.constexpr, s_layout: gl.constexpr, MASK_MODE: gl.constexpr = MASK_ELEMENT):
    """Online-softmax step of a partial tile (column tile kt): disallowed scores -inf first (MASK_MODE above)."""
    BN: gl.constexpr = s.shape[1]
    if MASK_MODE == MASK_INTERVAL:
        gl.static_assert(BM_MODE != 2 and not HAS_GLOBAL and not HAS_KPM, "interval masks serve band layouts only")
        ok = _row_interval_mask(rows, kt, SQ, SK, OFF, WL, WR, CAUSAL, HAS_WIN, BM_MODE, BN, s_layout)
        s = gl.where(ok, s, float("-inf"))
    elif MASK_MODE == MASK_ELEMENT:
        cols = kt * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        ok = _allowed(rows, cols, bm_ptr, s_bm_q, s_bm_k, kpm_ptr, SQ, SK, OFF, WL, WR, NG, BS,
                      CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM)
        s = gl.where(ok, s, float("-inf"))
    # scale > 0 commutes with the max; m_i finite: a row masked so far stays at -1e30 and gets p = 0
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _softmax_full(s, m_i, l_i, qk_scale):
    """Online-softmax step of a full tile: scale > 0, so the max commutes with it; one FMA + ex2 each."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _pipelined_step(q_tile, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn, tc, s_acc, p, m_i, l_i, o, g,
                    col_ptr, rows, bmp, s_bm_q, s_bm_k, kpmp, SQ, SK, OFF, WL, WR, NG, BS, qk_scale,
                    MASKED: gl.constexpr, CAUSAL: gl.constexpr, HAS_WIN: gl.constexpr, HAS_GLOBAL: gl.constexpr,
                    BM_MODE: gl.constexpr, HAS_KPM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                    WG: gl.constexpr, SPLIT_EMPTY: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                    MASK_MODE: gl.constexpr = MASK_ELEMENT):
    """One steady-state iteration on ring tile g (the item's tile j; p holds its probabilities): issue
    S_{j+1} = Q K_{j+1}^T and O += P_j V_j (async, in that order), wait for S_{j+1} only, fold it into
    the softmax while P_j V_j runs (MASKED: tile j+1 is partial, its column id at col_ptr), then wait
    for P_j V_j, rescale O and free tile j's slot.  PINGPONG: both GEMMs are issued in this warpgroup's
    turn tc.  SPLIT_EMPTY: K_{j+1}'s slot is freed as soon as S_{j+1} has retired, V_j's after P V.
    Returns (p_{j+1}, m, l, o)."""
    dtype: gl.constexpr = k_smem.dtype
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cur = g % STAGES
    nxt = (g + 1) % STAGES
    if MASKED:
        kt_next = gl.load(col_ptr)                  # issued early: its latency hides behind the waits
    mbarrier.wait(k_ready.index(nxt), ((g + 1) // STAGES) & 1)
    mbarrier.wait(v_ready.index(cur), (g // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    _turn_wait(turn, tc, WG, PINGPONG)
    s_tok = warpgroup_mma(q_tile, k_smem.index(nxt).permute((1, 0)), s_acc, use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p_op, v_smem.index(cur), o, is_async=True)
    _turn_pass(turn, WG, PINGPONG)
    # Groups retire in issue order: 1 outstanding = the PV.
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    if SPLIT_EMPTY:
        _release(k_empty.index(nxt))               # K_{j+1} is read: refilled under this softmax
    if MASKED:
        p, m_i, l_i, alpha = _softmax_masked(s, m_i, l_i, rows, kt_next, bmp, s_bm_q, s_bm_k, kpmp, SQ, SK, OFF,
                                             WL, WR, NG, BS, qk_scale, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE,
                                             HAS_KPM, s_layout, MASK_MODE)
    else:
        p, m_i, l_i, alpha = _softmax_full(s, m_i, l_i, qk_scale)
    # p_op stays alive until its wgmma retired (a register operand).
    o = warpgroup_mma_wait(0, deps=(o_tok, p_op))[0]
    o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    # Tile j (SPLIT_EMPTY: V_j) is consumed by every warp (K_j by S_j earlier, V_j just now): free its slot.
    _release(kv_empty.index(cur))
    return p, m_i, l_i, o


@gluon.jit
def _normalize_store_lse(o, m_i, l_i, rows, bh, lse_ptr, SQ, OPAQUE: gl.constexpr, WRITE_LSE: gl.constexpr,
                         row_o: gl.constexpr):
    """An item's epilogue math: O / l (one reciprocal per row, then a multiply per element: 64 divisions per thread
    cost ~1k cycles an item) and, WRITE_LSE, the natural-log lse of `rows` stored; rows with no allowed key get out 0
    and lse -inf.  Returns the normalized O (float32)."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)
    if WRITE_LSE:                                   # (no-grad calls: nobody reads it)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)   # log2 -> ln
        # (OPAQUE: SQ widened here; a hoisted 64-bit SQ was held, and spilled, across the loops)
        gl.store(lse_ptr + bh.to(gl.int64) * _maybe_opaque(SQ, OPAQUE).to(gl.int64) + rows, lse, mask=rows < SQ)
    return o


@gluon.jit
def _o_copy_through_k_tile(o, k_smem, q_smem, o_desc, k_done, phase, last, b, h, row0, PINGPONG: gl.constexpr,
                           WG: gl.constexpr, NWG: gl.constexpr, STAGES: gl.constexpr):
    """O_KSLOT: o (this partition's BM x D rows, out's dtype) out through its rows of the K tile in ring slot `last`
    by one TMA copy (rows past s_q clipped), once k_done's `phase` says the other warpgroup's last S on that tile has
    retired; returns 1 + last, the slot to release once the copy has read it."""
    BM: gl.constexpr = o.shape[0]
    D: gl.constexpr = o.shape[1]
    dtype: gl.constexpr = k_smem.dtype
    if PINGPONG:
        mbarrier.wait(k_done, phase & 1)
    # (the ring seen as BM-row tiles, indexed: a sliced view gave wrong results in the copy)
    o_tile = k_smem._reinterpret(dtype, [STAGES * NWG, BM, D], q_smem.layout).index(last * NWG + WG)
    o_tile.store(o)
    fence_async_shared()                            # generic-proxy smem writes before the TMA (async proxy) read
    gl.thread_barrier()                             # every warp's part written before one thread issues the copy
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0],
                                    o_tile._reinterpret(dtype, o_desc.block_type.shape, o_desc.layout))
    return last + 1


@gluon.jit
def _early_s0_epilogue(o, m_i, l_i, e_slot, e_qi, e_tiles, e_last, k_smem, k_done, o_desc, lse_ptr, o_ptr, s_ob, s_oh,
                       s_os, perm_ptr, H, n_m, SQ, ORDER: gl.constexpr, REVERSE: gl.constexpr, OPAQUE: gl.constexpr,
                       PINGPONG: gl.constexpr, WRITE_LSE: gl.constexpr, WG: gl.constexpr, NWG: gl.constexpr,
                       STAGES: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr, o_layout: gl.constexpr,
                       q_smem):
    """EARLY_S0: the epilogue of the previous item (slot e_slot, k_done phase e_qi, e_tiles tiles, its last K
    tile in ring slot e_last), run while the next item's S_0 is on the tensor cores: O / l normalized, the lse
    stored, O out through this warpgroup's rows of the item's last K tile by one TMA copy (after k_done: the other
    warpgroup's last S on that tile has retired), or zeros from registers for an item without tiles.  Returns 1 +
    the ring slot the copy reads (0: none), released by the caller once the copy has read it."""
    BM: gl.constexpr = o.shape[0]
    D: gl.constexpr = o.shape[1]
    dtype: gl.constexpr = k_smem.dtype
    w = _work_item(e_slot, perm_ptr, ORDER)
    b, h, mt, bh = _item(_maybe_opaque(w, OPAQUE), H, n_m, REVERSE, OPAQUE)
    rows = (mt * NWG + WG) * BM + gl.arange(0, BM, layout=row_s)
    o = _normalize_store_lse(o, m_i, l_i, rows, bh, lse_ptr, SQ, OPAQUE, WRITE_LSE, row_o)
    pend = 0
    if e_tiles > 0:
        pend = _o_copy_through_k_tile(o.to(dtype), k_smem, q_smem, o_desc, k_done, e_qi, e_last, b, h,
                                      (mt * NWG + WG) * BM, PINGPONG, WG, NWG, STAGES)
    else:                                           # no tile, no slot: the zeros from registers
        _store_o_rows(o.to(dtype), o_ptr, b, h, (mt * NWG + WG) * BM, SQ, s_ob, s_oh, s_os, BM, D, o_layout)
    return pend


@gluon.jit
def _consumer(q_desc, o_desc, lse_ptr, o_ptr, s_ob, s_oh, s_os, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
              v_ready, kv_empty, k_empty, turn, rows_ptr, cols_ptr, perm_ptr, s_rb, s_rh, s_rr, s_cb, s_ch, s_cr,
              bm_ptr, s_bmb, s_bmh, s_bm_q, s_bm_k, kpm_ptr, s_kpmb,
              H, n_m, n_items, SQ, SK, OFF, WL, WR, NG, BS, qk_scale,
              CAUSAL: gl.constexpr, HAS_WIN: gl.constexpr, HAS_GLOBAL: gl.constexpr, BM_MODE: gl.constexpr,
              HAS_KPM: gl.constexpr, REVERSE: gl.constexpr, ORDER: gl.constexpr, STAGES: gl.constexpr,
              Q_SLOTS: gl.constexpr,
              PINGPONG: gl.constexpr, O_REGS: gl.constexpr, SPLIT_EMPTY: gl.constexpr, MASK_MODE: gl.constexpr,
              trace_ptr, TRACE: gl.constexpr, WG: gl.constexpr, k_done, O_KSLOT: gl.constexpr,
              WRITE_LSE: gl.constexpr, num_warps: gl.constexpr, EARLY_S0: gl.constexpr = False):
    """One consumer partition: rows [WG * BM, +BM) of every item (BM = the Q block: 128 with 8 warps, or
    64 per warpgroup with PINGPONG), each item's tiles in list order (partial, then full), FA3
    intra-warpgroup overlap: iteration j issues S_{j+1} and P_j V_j, runs the softmax of S_{j+1} while
    P_j V_j runs.  TRACE: _stamp marks 0 item start, 1 Q ready, 2 S_0 retired, 3 its softmax done, 4 the tile
    loops done, 5 the last P V retired, 6 the item stored (TRACE_STAMPS: the finer ones)."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_smem.shape[1]
    NWG: gl.constexpr = 2 if PINGPONG else 1
    OPAQUE: gl.constexpr = O_REGS                   # the new schedules only (see _item)
    dtype: gl.constexpr = q_desc.dtype
    q_view: gl.constexpr = q_desc.block_type.shape
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_acc = gl.zeros([BM, BN], gl.float32, s_layout)
    it = 0          # K/V tiles consumed so far (all items), as the producer counts them
    qi = 0
    # O_KSLOT: the next item's (w, n_part, n_all), read during the current item's epilogue; pend = 1 + the ring slot
    # whose O copy may still be reading it (0: none), released once the next item's S_0 is issued
    if O_KSLOT:
        w_nx, n_part_nx, n_all_nx = _item_counts(_pid(OPAQUE), perm_ptr, rows_ptr, s_rb, s_rh, s_rr, H, n_m, n_items,
                                                 ORDER, REVERSE, OPAQUE)
    pend = 0
    # EARLY_S0: the previous item's tile count (-1: none), O, m and l, its epilogue still to run (under the next
    # item's S_0); its slot and last ring slot follow from slot - grid and it (nothing else kept across the loops)
    e_tiles = -1
    kp = 0          # EARLY_S0: items with tiles done so far = k_done phases (empty items arrive on it only without
    #                EARLY_S0: with the wait one item later, a warpgroup running through two empty items could
    #                complete a phase on its own and leave the other waiting for a phase two behind)
    o_e = gl.zeros([BM, D], gl.float32, o_layout)
    m_e = gl.full([BM], -1.0e30, gl.float32, row_s)
    l_e = gl.zeros([BM], gl.float32, row_s)
    # EARLY_S0: one more turn of the loop past the CTA's last item (an empty one: its counts load as 0, nothing is
    # waited for) runs that item's epilogue -- a second copy of it after the loop spilled
    for slot in range(_pid(OPAQUE), n_items + (gl.num_programs(0) if EARLY_S0 else 0), gl.num_programs(0)):
        _stamp(trace_ptr, slot, 0, WG, TRACE)
        if O_KSLOT:
            w = w_nx
            n_part = n_part_nx
            n_all = n_all_nx
            b, h, mt, bh = _item(w, H, n_m, REVERSE, OPAQUE)
        else:
            w = _work_item(slot, perm_ptr, ORDER)
            b, h, mt, bh = _item(w, H, n_m, REVERSE, OPAQUE)
            row = rows_ptr + b * s_rb + h * s_rh + mt * s_rr
            n_part = gl.load(row)
            n_all = gl.load(row + 1)
        _stamp_after(trace_ptr, slot, 11, WG, TRACE, n_all)
        cols = cols_ptr + b * s_cb + h * s_ch + mt * s_cr
        bmp = bm_ptr + b * s_bmb + h * s_bmh        # strides are 0 on broadcast dims
        kpmp = kpm_ptr + b * s_kpmb
        rows = (mt * NWG + WG) * BM + gl.arange(0, BM, layout=row_s)
        qs = (qi % Q_SLOTS) * NWG + WG
        q_tile = q_smem.index(qs)
        m_i = gl.full([BM], -1.0e30, gl.float32, row_s)
        l_i = gl.zeros([BM], gl.float32, row_s)
        o = gl.zeros([BM, D], gl.float32, o_layout)
        if EARLY_S0:
            if slot < n_items:                      # (the extra turn past the last item has no Q)
                mbarrier.wait(q_ready.index(qs), (qi // Q_SLOTS) & 1)
        else:
            mbarrier.wait(q_ready.index(qs), (qi // Q_SLOTS) & 1)
        _stamp(trace_ptr, slot, 1, WG, TRACE)
        # Ping-pong: every item takes n_all + 1 GEMM turns (an empty item one idle turn), so the turn
        # counter is it + qi and needs no register of its own across the tile loops.
        tc = it + qi
        if n_all > 0:
            # Prologue: S_0 and its softmax (no PV yet).
            kt = gl.load(cols, mask=n_part > 0, other=0)
            cur = it % STAGES
            mbarrier.wait(k_ready.index(cur), (it // STAGES) & 1)
            _turn_wait(turn, tc, WG, PINGPONG)
            s_tok = warpgroup_mma(q_tile, k_smem.index(cur).permute((1, 0)), s_acc, use_acc=False, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            if EARLY_S0:
                if e_tiles >= 0:                    # the previous item's epilogue and O copy, under S_0
                    pend = _early_s0_epilogue(o_e, m_e, l_e, slot - gl.num_programs(0), kp - 1, e_tiles,
                                              (it - 1) % STAGES, k_smem, k_done, o_desc,
                                              lse_ptr, o_ptr, s_ob, s_oh, s_os, perm_ptr, H, n_m, SQ, ORDER, REVERSE,
                                              OPAQUE, PINGPONG, WRITE_LSE, WG, NWG, STAGES, row_s, row_o, o_layout,
                                              q_smem)
            elif O_KSLOT:
                if pend > 0:                        # the previous item's O copy, under S_0: then free its slot
                    tma.store_wait(0)
                    _release(kv_empty.index(pend - 1))
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            if EARLY_S0:
                if pend > 0:                        # the copy has read the slot: K_2 may land there now
                    tma.store_wait(0)
                    _release(kv_empty.index(pend - 1))
                pend = 0                            # (unconditionally: nothing held across the tile loops)
            _stamp(trace_ptr, slot, 2, WG, TRACE)
            if SPLIT_EMPTY:
                _release(k_empty.index(cur))
            if n_part > 0:
                p, m_i, l_i, alpha = _softmax_masked(s, m_i, l_i, rows, kt, bmp, s_bm_q, s_bm_k, kpmp, SQ, SK, OFF,
                                                     WL, WR, NG, BS, qk_scale, CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE,
                                                     HAS_KPM, s_layout, MASK_MODE)
            else:
                p, m_i, l_i, alpha = _softmax_full(s, m_i, l_i, qk_scale)
            _stamp(trace_ptr, slot, 3, WG, TRACE)
            # Partial tiles come first in the list: iterations j < n_part - 1 fold a partial tile j + 1.
            n_masked = gl.maximum(n_part - 1, 0)
            for j in range(0, n_masked):
                p, m_i, l_i, o = _pipelined_step(q_tile, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn,
                                                 tc + j + 1, s_acc, p, m_i, l_i, o, it + j, cols + j + 1, rows, bmp,
                                                 s_bm_q, s_bm_k, kpmp, SQ, SK, OFF, WL, WR, NG, BS, qk_scale, True,
                                                 CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, STAGES, PINGPONG, WG,
                                                 SPLIT_EMPTY, s_layout, o_layout, MASK_MODE)
            for j in range(n_masked, n_all - 1):
                p, m_i, l_i, o = _pipelined_step(q_tile, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn,
                                                 tc + j + 1, s_acc, p, m_i, l_i, o, it + j, cols, rows, bmp, s_bm_q,
                                                 s_bm_k, kpmp, SQ, SK, OFF, WL, WR, NG, BS, qk_scale, False, CAUSAL,
                                                 HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, STAGES, PINGPONG, WG,
                                                 SPLIT_EMPTY, s_layout, o_layout, MASK_MODE)
            _stamp(trace_ptr, slot, 4, WG, TRACE)
            if EARLY_S0:                            # the next item's counts, loaded under the last P V
                w_nx, n_part_nx, n_all_nx = _item_counts(slot + gl.num_programs(0), perm_ptr, rows_ptr, s_rb, s_rh,
                                                         s_rr, H, n_m, n_items, ORDER, REVERSE, OPAQUE)
            if O_KSLOT and PINGPONG:
                # This warpgroup's last S = Q K^T has retired: the other one may write its O over that K tile.
                _release(k_done)
            if O_REGS:
                # Every S = Q K^T of the item has retired: the producer may load the next item's Q now.
                _release(q_empty.index(qs))
            # Epilogue: the last P V, then free the last slot too (the ring continues with the next item).
            g = it + n_all - 1
            last = g % STAGES
            mbarrier.wait(v_ready.index(last), (g // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            _turn_wait(turn, tc + n_all, WG, PINGPONG)
            o_tok = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            o = warpgroup_mma_wait(0, deps=(o_tok, p_op))[0]
            _stamp(trace_ptr, slot, 5, WG, TRACE)
            if not O_KSLOT:                         # (O_KSLOT: once O has left through the slot's K tile)
                _release(kv_empty.index(last))
            _stamp(trace_ptr, slot, 8, WG, TRACE)
        else:
            _turn_wait(turn, tc, WG, PINGPONG)      # the empty item's idle turn (see tc above)
            _turn_pass(turn, WG, PINGPONG)
            if EARLY_S0:
                if e_tiles >= 0:                    # the previous item's epilogue (nothing to hide it under), before
                    # this item's k_done arrive: its wait on the previous phase must come first
                    pend = _early_s0_epilogue(o_e, m_e, l_e, slot - gl.num_programs(0), kp - 1, e_tiles,
                                              (it - 1) % STAGES, k_smem, k_done, o_desc,
                                              lse_ptr, o_ptr, s_ob, s_oh, s_os, perm_ptr, H, n_m, SQ, ORDER, REVERSE,
                                              OPAQUE, PINGPONG, WRITE_LSE, WG, NWG, STAGES, row_s, row_o, o_layout,
                                              q_smem)
                w_nx, n_part_nx, n_all_nx = _item_counts(slot + gl.num_programs(0), perm_ptr, rows_ptr, s_rb, s_rh,
                                                         s_rr, H, n_m, n_items, ORDER, REVERSE, OPAQUE)
            if O_REGS:
                _release(q_empty.index(qs))         # no tile: the slot was only waited for (phase bookkeeping)
            if O_KSLOT and PINGPONG and not EARLY_S0:
                _release(k_done)                    # one k_done phase per item, empty ones too (EARLY_S0: see kp)
            if O_KSLOT:
                if pend > 0:
                    tma.store_wait(0)
                    _release(kv_empty.index(pend - 1))
                    pend = 0
        n_tiles = n_all
        it += n_all

        if EARLY_S0:                                # this item's epilogue runs under the next item's S_0
            kp += (n_tiles > 0).to(gl.int32)
            e_tiles = n_tiles
            o_e = o
            m_e = m_i
            l_e = l_i
        else:
            # (b, h, tile) again from w rather than kept live across the tile loop (register pressure; with
            # OPAQUE an opaque copy of w keeps LLVM from merging this with the computation above)
            # (with ORDER the item is read again rather than kept: one more live register spilled)
            w = _work_item(slot, perm_ptr, ORDER)
            _stamp_after(trace_ptr, slot, 9, WG, TRACE, w)
            b, h, mt, bh = _item(_maybe_opaque(w, OPAQUE), H, n_m, REVERSE, OPAQUE)
            if O_KSLOT:                                 # the next item's counts, loaded under this epilogue
                w_nx, n_part_nx, n_all_nx = _item_counts(slot + gl.num_programs(0), perm_ptr, rows_ptr, s_rb, s_rh,
                                                         s_rr, H, n_m, n_items, ORDER, REVERSE, OPAQUE)
            rows = (mt * NWG + WG) * BM + gl.arange(0, BM, layout=row_s)
            o = _normalize_store_lse(o, m_i, l_i, rows, bh, lse_ptr, SQ, OPAQUE, WRITE_LSE, row_o)
            _stamp(trace_ptr, slot, 10, WG, TRACE)
            if O_KSLOT:
                if n_tiles > 0:
                    # O out through this partition's rows of the item's last K tile: every S that read it has retired
                    # (this warpgroup's in the tile loops, the other's by k_done), and the ring slot is released
                    # only once the copy has read it (pend: at the next item's S_0), so the producer cannot refill it
                    # under the store.
                    last = (it - 1) % STAGES
                    pend = _o_copy_through_k_tile(o.to(dtype), k_smem, q_smem, o_desc, k_done, qi, last, b, h,
                                                  (mt * NWG + WG) * BM, PINGPONG, WG, NWG, STAGES)
                else:                                   # no tile, no slot: the zeros from registers
                    _store_o_rows(o.to(dtype), o_ptr, b, h, (mt * NWG + WG) * BM, SQ, s_ob, s_oh, s_os, BM, D, o_layout)
                    pend = 0
            elif O_REGS:
                # The slot may already hold the next item's Q: O goes out from registers (32-bit row offsets; 64-bit
                # ones or an item base cost spills).
                _store_o_rows(o.to(dtype), o_ptr, b, h, (mt * NWG + WG) * BM, SQ, s_ob, s_oh, s_os, BM, D, o_layout)
            else:
                # O out through this item's Q slot (every wgmma reading it has retired); TMA clips rows past s_q.
                q_tile.store(o.to(dtype))
                fence_async_shared()                    # generic-proxy smem writes before the TMA (async proxy) read
                gl.thread_barrier()                     # every warp's part written before one thread issues the copy
                tma.async_copy_shared_to_global(o_desc, [b, h, (mt * NWG + WG) * BM, 0],
                                                q_tile._reinterpret(dtype, q_view, o_desc.layout))
                tma.store_wait(0)                       # the copy has read the slot ...
                _release(q_empty.index(qs))             # ... in the issuing thread; then release it to the producer
        _stamp(trace_ptr, slot, 6, WG, TRACE)
        qi += 1
    if O_KSLOT:
        tma.store_wait(0)                           # the last item's copy has read its slot before the CTA exits


@gluon.jit
def sparse_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, o_ptr, rows_ptr, cols_ptr, bm_ptr, kpm_ptr, perm_ptr,
                      s_ob, s_oh, s_os, s_rb, s_rh, s_rr, s_cb, s_ch, s_cr, s_bmb, s_bmh, s_bm_q, s_bm_k, s_kpmb,
                      H, GROUP, n_m, n_items, SQ, SK, OFF, WL, WR, NG, BS, qk_scale, trace_ptr,
                      q_smem_layout: gl.constexpr, kv_smem_layout: gl.constexpr,
                      CAUSAL: gl.constexpr, HAS_WIN: gl.constexpr, HAS_GLOBAL: gl.constexpr, BM_MODE: gl.constexpr,
                      HAS_KPM: gl.constexpr, FULL_RUN: gl.constexpr, REVERSE: gl.constexpr, ORDER: gl.constexpr,
                      STAGES: gl.constexpr,
                      Q_SLOTS: gl.constexpr, PINGPONG: gl.constexpr, O_REGS: gl.constexpr, SPLIT_EMPTY: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
                      MASK_MODE: gl.constexpr = MASK_ELEMENT, TRACE: gl.constexpr = False,
                      O_KSLOT: gl.constexpr = False, WRITE_LSE: gl.constexpr = True, EARLY_S0: gl.constexpr = False):
    """Grid (min(n_items, SMs) persistent, or n_items,).  n_items = n_m query tiles x b x H.
    q/o descriptors: block (1, 1, 128, d), or (1, 1, 64, d) with PINGPONG (then num_warps = 4, one
    warpgroup per consumer partition); k/v: (1, 1, 128, d); *_smem_layout: the 2-D NVMMA layouts of
    the same swizzle.  o_ptr/s_o*: out and its (b, h, s) strides, for the O_REGS register store.
    rows/cols: TileIndex.rows/cols at 128 x 128 with their (b, h, row) strides (0 on broadcast dims);
    bm/kpm: the int8 block mask / key padding (or any tensor when unused); perm: with ORDER the int32 work item of
    each slot (gluon.item_order), CTA c walking slots c, c + grid, ..."""
    BQ: gl.constexpr = q_desc.block_type.shape[2]                    # rows per consumer partition
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    NWG: gl.constexpr = 2 if PINGPONG else 1                         # consumer partitions
    NQ: gl.constexpr = Q_SLOTS * NWG
    gl.static_assert(O_REGS or Q_SLOTS == 2, "one Q slot per partition needs O stored from registers")
    gl.static_assert(not O_KSLOT or (O_REGS and not SPLIT_EMPTY), "O_KSLOT: Q freed early, K slots freed with V")
    gl.static_assert(not EARLY_S0 or O_KSLOT, "EARLY_S0: the epilogue moves with the O copy through the K tile")
    gl.static_assert(not (EARLY_S0 and TRACE), "EARLY_S0 runs a turn past the last item: no TRACE stamps for it")
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NQ, BQ, D], q_smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D], kv_smem_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if PINGPONG:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    else:
        turn = kv_empty                                 # never used without PINGPONG
    if SPLIT_EMPTY:                                     # K slots freed apart from V slots (kv_empty: V only)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_empty.index(i), count=NWG)
    else:
        k_empty = kv_empty                              # never used without SPLIT_EMPTY
    if O_KSLOT and PINGPONG:                            # both warpgroups' last S of an item retired (2 arrives)
        k_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        mbarrier.init(k_done, count=2)
    else:
        k_done = kv_empty                               # never used
    for i in gl.static_range(NQ):
        mbarrier.init(q_ready.index(i), count=1)        # completed by the TMA transaction bytes
        mbarrier.init(q_empty.index(i), count=1)        # one arrive from the slot's consumer partition
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NWG)     # one arrive per consumer partition
    # (the argument lists are written out: a JIT tuple cannot hold the partition functions)
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)         # warpgroup 0 issues first
        gl.warp_specialize([
            (_consumer, (q_desc, o_desc, lse_ptr, o_ptr, s_ob, s_oh, s_os, q_smem, k_smem, v_smem, q_ready, q_empty,
                         k_ready, v_ready, kv_empty, k_empty, turn, rows_ptr, cols_ptr, perm_ptr, s_rb, s_rh, s_rr,
                         s_cb, s_ch, s_cr, bm_ptr, s_bmb, s_bmh, s_bm_q, s_bm_k, kpm_ptr, s_kpmb,
                         H, n_m, n_items, SQ, SK, OFF, WL, WR, NG, BS, qk_scale,
                         CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, REVERSE, ORDER, STAGES, Q_SLOTS, PINGPONG,
                         O_REGS, SPLIT_EMPTY, MASK_MODE, trace_ptr, TRACE, 0, k_done, O_KSLOT, WRITE_LSE, 4, EARLY_S0)),
            (_consumer, (q_desc, o_desc, lse_ptr, o_ptr, s_ob, s_oh, s_os, q_smem, k_smem, v_smem, q_ready, q_empty,
                         k_ready, v_ready, kv_empty, k_empty, turn, rows_ptr, cols_ptr, perm_ptr, s_rb, s_rh, s_rr,
                         s_cb, s_ch, s_cr, bm_ptr, s_bmb, s_bmh, s_bm_q, s_bm_k, kpm_ptr, s_kpmb,
                         H, n_m, n_items, SQ, SK, OFF, WL, WR, NG, BS, qk_scale,
                         CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, REVERSE, ORDER, STAGES, Q_SLOTS, PINGPONG,
                         O_REGS, SPLIT_EMPTY, MASK_MODE, trace_ptr, TRACE, 1, k_done, O_KSLOT, WRITE_LSE, 4, EARLY_S0)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                         rows_ptr, cols_ptr, perm_ptr, s_rb, s_rh, s_rr, s_cb, s_ch, s_cr, H, GROUP, n_m, n_items,
                         REVERSE, ORDER, FULL_RUN, STAGES, Q_SLOTS, NWG, O_REGS, k_empty, SPLIT_EMPTY)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_desc, o_desc, lse_ptr, o_ptr, s_ob, s_oh, s_os, q_smem, k_smem, v_smem, q_ready, q_empty,
                         k_ready, v_ready, kv_empty, k_empty, turn, rows_ptr, cols_ptr, perm_ptr, s_rb, s_rh, s_rr,
                         s_cb, s_ch, s_cr, bm_ptr, s_bmb, s_bmh, s_bm_q, s_bm_k, kpm_ptr, s_kpmb,
                         H, n_m, n_items, SQ, SK, OFF, WL, WR, NG, BS, qk_scale,
                         CAUSAL, HAS_WIN, HAS_GLOBAL, BM_MODE, HAS_KPM, REVERSE, ORDER, STAGES, Q_SLOTS, PINGPONG,
                         O_REGS, SPLIT_EMPTY, MASK_MODE, trace_ptr, TRACE, 0, k_done, O_KSLOT, WRITE_LSE, num_warps,
                         EARLY_S0)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                         rows_ptr, cols_ptr, perm_ptr, s_rb, s_rh, s_rr, s_cb, s_ch, s_cr, H, GROUP, n_m, n_items,
                         REVERSE, ORDER, FULL_RUN, STAGES, Q_SLOTS, NWG, O_REGS, k_empty, SPLIT_EMPTY)),
        ], [1], [PRODUCER_REGS])
    for i in gl.static_range(NQ):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(q_empty.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
    if PINGPONG:
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))
    if SPLIT_EMPTY:
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_empty.index(i))
    if O_KSLOT and PINGPONG:
        mbarrier.invalidate(k_done)
