"""FA3-style flash-attention forward for Hopper (sm_90) in Gluon (triton.experimental.gluon, Triton 3.6).

Imported only by gluon.py, and only when triton.experimental.gluon imports (this module
needs it at import time).  q/k/v/out are any (b, h, s, d) strided views with unit stride along d
and 16-byte aligned strides; d in {64, 128}; bf16 or fp16.

Tiles come through 4-D TMA descriptors over (b, h, s, d) with block (1, 1, rows, d): rows past a
head's s are zero-filled on load and clipped on the O store, so any s_q / s_k works and a tile never
straddles two heads (a (b*h*s, d) view would need s % 128 == 0).  GQA/MQA: a q head h reads kv head
h // GROUP through the same descriptors (no repeated K/V).  Causal is bottom-right aligned (query i
sees keys j <= i + s_k - s_q); K tiles past the last key a q block sees are never loaded, and only
the tiles that hold a masked column (the causal diagonal, the s_k tail) pay for the mask.  A row that
sees no key gets out = 0 and lse = -inf.

Per CTA: BLOCK_M = 128 query rows.  K/V tiles (BLOCK_N = 128 rows) stream through a STAGES-deep ring
filled by TMA; per stage one "ready" mbarrier for K and one for V (expect-tx) and one "empty" barrier
the consumers arrive on.  S = Q K^T is an async wgmma from shared memory; P stays in registers as
the A operand of O += P V.  Intra-warpgroup overlap (FA3 3.2): iteration j issues S_{j+1} and
P_j V_j, waits for S_{j+1} only, runs the softmax of S_{j+1} while P_j V_j runs, then waits for
P_j V_j and rescales O.

Schedules (constexpr):
  * WARP_SPEC, not PINGPONG: 8 consumer warps (2 warpgroups of 64 rows, one instruction stream) plus
    one producer warp issuing every K/V TMA load.
  * not WARP_SPEC: the 8 consumer warps issue the loads themselves, STAGES-1 tiles ahead.
  * PINGPONG (needs WARP_SPEC): each consumer warpgroup is its own partition owning 64 of the 128
    rows (own Q/O slot, own barrier), and the two take turns issuing their GEMMs through a pair of
    "turn" mbarriers, so one warpgroup's softmax runs while the other's GEMMs hold the tensor cores
    (FA3 3.1).  The empty barrier then counts one arrive per warpgroup.  Registers (setmaxnreg):
    240 per consumer warpgroup, 24 for the producer (2 x 240 + 24 = 504 of the 512 per thread that
    3 warpgroups have).  The "inc 120" / "dec 120" in the PTX is the idle level of Triton's worker
    switch loop (between partitions), not a partition's budget."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ..common.gluon_kv_ring import _issue_kv, _issue_one, _release, _turn_pass, _turn_wait

BLOCK_M = 128       # query rows per CTA
BLOCK_N = 128       # key/value rows per ring stage
NUM_WARPS = 8       # consumer warps without ping-pong (2 warpgroups, one partition)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, b, hk, n_tiles,
              STAGES: gl.constexpr, SPLIT_EMPTY: gl.constexpr):
    """Warp-specialized loader (1 warp): fills the ring as fast as the consumers free slots.
    SPLIT_EMPTY: k_empty frees a K slot (its S has retired), kv_empty only the V slot (its P V has)."""
    BN: gl.constexpr = k_desc.block_type.shape[2]
    kv_view: gl.constexpr = k_desc.block_type.shape
    if SPLIT_EMPTY:
        # The consumers free K_{t+1} (its S retires in iteration t) before V_t (end of iteration t), and
        # iteration j reads K_{j+1} and V_j: load in that order, K_{j+1} before V_j.  Parities as below.
        if n_tiles > 0:
            mbarrier.wait(k_empty.index(0), 1)
            _issue_one(k_desc, k_smem, k_ready, b, hk, 0, 0, kv_view)
        for j in range(n_tiles):
            if j + 1 < n_tiles:
                kst = (j + 1) % STAGES
                mbarrier.wait(k_empty.index(kst), (((j + 1) // STAGES) & 1) ^ 1)
                _issue_one(k_desc, k_smem, k_ready, b, hk, (j + 1) * BN, kst, kv_view)
            stage = j % STAGES
            mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
            _issue_one(v_desc, v_smem, v_ready, b, hk, j * BN, stage, kv_view)
    else:
        for j in range(n_tiles):
            stage = j % STAGES
            # Parity of the slot's previous use; on the first lap waiting on parity 1 of a fresh barrier
            # returns at once, so the first STAGES loads go out without waiting.
            mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, j * BN, stage, kv_view)


# ---- exp2 on the FMA pipe (EXP_EMU) ----------------------------------------------------------------------
# At d64 a 128x128 tile's two wgmmas take about as many cycles as its 16,384 exp2s on the MUFU unit (16 per
# clock per SM), so the forward is bound by the exponentials (FA3 d64 ~0.75x of d128's TFLOP/s).  EXP_EMU
# computes 1 in EXP_EMU of them with FMA / integer instructions instead (FA4's trick): 2^x = 2^n * 2^f with
# n = round(x) (the 1.5 * 2^23 addition rounds in the mantissa), f in [-0.5, 0.5], 2^f a degree-3 minimax
# polynomial (relative error 7.5e-5 < half an ulp of bf16 / fp16 P), and 2^n added to the exponent bits.
# x is clamped at -125 (2^-125 is 0 to the row sum, which is >= 1); only finite x (the unmasked tiles).
_EXP2_POLY = """max.f32 t, {x}, 0fC2FA0000;
add.rn.f32 j, t, 0f4B400000;
sub.rn.f32 r, j, 0f4B400000;
sub.rn.f32 f, t, r;
fma.rn.f32 p, f, 0f3D61FB59, 0f3E786ED8;
fma.rn.f32 p, p, f, 0f3F31798D;
fma.rn.f32 p, p, f, 0f3F7FFB4A;
mov.b32 jb, j;
mov.b32 pb, p;
shl.b32 jb, jb, 23;
add.s32 pb, pb, jb;
mov.b32 {y}, pb;"""


def _exp2_mixed_asm(pack: int) -> str:
    """PTX for `pack` elements: the last through the polynomial, the others through ex2.approx."""
    lines = ["{", ".reg .f32 t, j, r, f, p;", ".reg .b32 jb, pb;"]
    lines += [f"ex2.approx.ftz.f32 ${i}, ${pack + i};" for i in range(pack - 1)]
    lines += [_EXP2_POLY.format(x=f"${2 * pack - 1}", y=f"${pack - 1}"), "}"]
    return "\n".join(lines)


EXP2_ASM_2 = gl.constexpr(_exp2_mixed_asm(2))
EXP2_ASM_4 = gl.constexpr(_exp2_mixed_asm(4))


@gluon.jit
def _exp2(x, EXP_EMU: gl.constexpr):
    """exp2(x) of finite x <= 0; EXP_EMU = 2 / 4: one element in 2 / 4 on the FMA pipe (see above)."""
    if EXP_EMU == 2:
        y = gl.inline_asm_elementwise(EXP2_ASM_2, "=f,=f,f,f", [x], dtype=gl.float32, is_pure=True, pack=2)
    elif EXP_EMU == 4:
        y = gl.inline_asm_elementwise(EXP2_ASM_4, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32, is_pure=True,
                                      pack=4)
    else:
        y = gl.exp2(x)
    return y


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, col0, SK, OFFSET, qk_scale,
                  CAUSAL: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr, EXP_EMU: gl.constexpr = 0):
    """Fold raw scores s of one K tile into the running max m_i (log2 units, scale folded in) and sum
    l_i.  Returns (p, m_new, l_new, alpha).  MASKED: columns >= SK, and with CAUSAL columns
    > row + OFFSET, score -inf (m_i starts finite, so a fully masked row gives p = 0, never NaN)."""
    if MASKED:
        BN: gl.constexpr = s.shape[1]
        cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < SK, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + OFFSET, 1))
        qk = gl.where(keep, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, axis=1))
        p = gl.exp2(qk - gl.expand_dims(m_new, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)     # scale > 0: max commutes with it
        p = _exp2(s * qk_scale - gl.expand_dims(m_new, 1), EXP_EMU)   # one FMA + ex2 per element
        # (masked tiles keep ex2 alone: their -inf must give exactly 0, which the polynomial's clamp does not)
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _sreg(dep, name: gl.constexpr):
    """Special register `name` (e.g. "%ctaid.x") read by a non-pure asm, which LLVM can neither CSE with
    an earlier read nor hoist: what is derived from it is computed where it is called.  `dep` is only
    an operand (the asm needs one)."""
    return gl.inline_asm_elementwise("mov.u32 $0, " + name + ";", "=r,r", [dep], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
              kv_empty, turn, b, h, hk, bh, m0, SQ, SK, OFFSET, n_tiles, first_masked, qk_scale,
              CAUSAL: gl.constexpr, STAGES: gl.constexpr, PRODUCE: gl.constexpr, PINGPONG: gl.constexpr,
              WG: gl.constexpr, H, REMAT: gl.constexpr, k_empty, SPLIT_EMPTY: gl.constexpr,
              EXP_EMU: gl.constexpr, num_warps: gl.constexpr):
    """Rows [m0 + WG*BM, +BM) of head (b, h): BM = the Q block of q_desc (128, or 64 per warpgroup
    with PINGPONG).  Every consumer partition walks the same n_tiles K/V tiles.  REMAT (PINGPONG only):
    b, h, bh and the rows are recomputed from the CTA id after the K/V loop instead of being held
    through it (H: heads per batch, only used then).  SPLIT_EMPTY (with a producer): each K slot is
    freed on k_empty as soon as its S has retired, the V slot on kv_empty after its P V."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    q_view: gl.constexpr = q_desc.block_type.shape
    kv_view: gl.constexpr = k_desc.block_type.shape
    # wgmma accumulator layouts: warps stacked along M (each warp owns 16 rows, so row reductions stay
    # inside a warp); instr N = the whole tile width, K = 16 for 16-bit inputs.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    # P as the register A operand of P V: k_width = 32 bits / 16-bit element.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_row = m0 + WG * BM
    rows = q_row + gl.arange(0, BM, layout=row_s)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, q_row, 0], q_bar,
                                    q_smem._reinterpret(dtype, q_view, q_desc.layout))
    if PRODUCE:     # no producer warp: prefetch the first STAGES-1 tiles ourselves
        for t in gl.static_range(STAGES - 1):
            if t < n_tiles:
                _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, t * BN, t, kv_view)

    m_i = gl.full([BM], -1.0e30, gl.float32, row_s)     # finite: a fully masked tile gives p = 0, not NaN
    l_i = gl.zeros([BM], gl.float32, row_s)
    o = gl.zeros([BM, D], gl.float32, o_layout)
    # Also when no K tile is visible (n_tiles == 0): O goes out through Q's slot, which the Q load
    # must have finished writing first.
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        # Prologue: S_0 and its softmax (no PV yet).
        s_acc = gl.zeros([BM, BN], gl.float32, s_layout)
        mbarrier.wait(k_ready.index(0), 0)
        _turn_wait(turn, 0, WG, PINGPONG)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_acc, use_acc=False, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        if SPLIT_EMPTY:
            _release(k_empty.index(0))
        if first_masked == 0:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, SK, OFFSET, qk_scale, CAUSAL, True, s_layout)
        else:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, SK, OFFSET, qk_scale, CAUSAL, False, s_layout,
                                               EXP_EMU)

        for j in range(0, n_tiles - 1):
            cur = j % STAGES
            nxt = (j + 1) % STAGES
            if PRODUCE:
                # Slot (j-1) % STAGES held tile j-1, whose wgmmas all retired at the end of iteration j-1.
                t_load = j + STAGES - 1
                if t_load < n_tiles:
                    _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, t_load * BN,
                              t_load % STAGES, kv_view)
            mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
            mbarrier.wait(v_ready.index(cur), (j // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            _turn_wait(turn, j + 1, WG, PINGPONG)
            # 1) S_{j+1} = Q K_{j+1}^T, async.  2) O += P_j V_j, async, queued behind it (O already
            # holds the rescale for m_j).
            s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_acc, use_acc=False,
                                  is_async=True)
            o_tok = warpgroup_mma(p_op, v_smem.index(cur), o, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            # 3) Wait for S_{j+1} only: groups retire in issue order, so 1 outstanding = the PV.
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            if SPLIT_EMPTY:     # K_{j+1} is read: the producer may refill its slot under the softmax
                _release(k_empty.index(nxt))
            # 4) Online softmax of S_{j+1} while P_j V_j runs; the mask only where a column can be masked.
            if j + 1 >= first_masked:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, (j + 1) * BN, SK, OFFSET, qk_scale,
                                                   CAUSAL, True, s_layout)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, (j + 1) * BN, SK, OFFSET, qk_scale,
                                                   CAUSAL, False, s_layout, EXP_EMU)
            # 5) P_j V_j done (p_op must stay alive until then: it is a wgmma register operand).
            o = warpgroup_mma_wait(0, deps=(o_tok, p_op))[0]
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            if not PRODUCE:
                # Tile j (with SPLIT_EMPTY: V_j) is fully consumed by every warp of this partition; only
                # then free its slot.
                _release(kv_empty.index(cur))

        # Epilogue: the last P V.
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        _turn_wait(turn, n_tiles, WG, PINGPONG)
        o_tok = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        o = warpgroup_mma_wait(0, deps=(o_tok, p_op))[0]

    if REMAT:
        # d128 ping-pong: the loop uses up to R237 of a consumer's 240 registers, and ptxas spilled the
        # O store's coordinates and slot address (kept in uniform registers from the Q load on) around
        # it: 8 B of stack, 24 B causal.  Same values as fa_fwd_kernel's, read again from the CTA id.
        pid_m = _sreg(n_tiles, "%ctaid.x")
        if CAUSAL:
            pid_m = _sreg(n_tiles, "%nctaid.x") - 1 - pid_m
        bh = _sreg(n_tiles, "%ctaid.y")
        b = bh // H
        h = bh % H
        q_row = pid_m * (2 * BM) + WG * BM
        rows = q_row + gl.arange(0, BM, layout=row_s)
    # A row that saw no key (causal, s_q > s_k): out 0, lse -inf.
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = o / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)   # log2 -> ln
    gl.store(lse_ptr + bh.to(gl.int64) * SQ + rows, lse, mask=rows < SQ)
    # O goes out through Q's slot (same shape, dtype and layout; every wgmma reading Q has retired);
    # the TMA store clips rows past s_q.
    q_smem.store(o.to(dtype))
    fence_async_shared()            # order the generic-proxy smem writes before the TMA (async proxy) read
    tma.async_copy_shared_to_global(o_desc, [b, h, q_row, 0], q_smem._reinterpret(dtype, q_view, o_desc.layout))
    tma.store_wait(0)


@gluon.jit
def fa_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, H, GROUP, SQ, SK, OFFSET, qk_scale,
                  q_smem_layout: gl.constexpr, kv_smem_layout: gl.constexpr,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr, WARP_SPEC: gl.constexpr,
                  PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                  REMAT: gl.constexpr, SPLIT_EMPTY: gl.constexpr, EXP_EMU: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(SQ, 128), b * H).  q/o descriptors have block (1, 1, 128 or 64 with PINGPONG, d),
    k/v (1, 1, 128, d); the *_smem_layout are the 2-D NVMMA layouts of the same swizzle.  REMAT: see
    _consumer (the host sets it for ping-pong at d128).  SPLIT_EMPTY (needs WARP_SPEC): separate "empty"
    barriers for the K and V slots (FA3's K and V pipelines), see _producer."""
    BQ: gl.constexpr = q_desc.block_type.shape[2]                    # rows per consumer partition
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    BM: gl.constexpr = 2 * BQ if PINGPONG else BQ                    # rows per CTA
    dtype: gl.constexpr = q_desc.dtype
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m      # longest q blocks start first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP                                 # GQA: the kv head this q head reads
    m0 = pid_m * BM
    if CAUSAL:   # bottom-right: query i sees keys j <= i + OFFSET (OFFSET = s_k - s_q)
        hi = gl.maximum(gl.minimum(SK, m0 + BM + OFFSET), 0)         # keys the block's last row sees
        n_full = gl.maximum(gl.minimum(SK, m0 + OFFSET + 1), 0)      # keys the block's first row sees
    else:
        hi = SK
        n_full = SK
    n_tiles = gl.cdiv(hi, BN)
    first_masked = n_full // BN                     # tiles before it have no masked column in any row

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D], kv_smem_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)        # completed by the TMA transaction bytes
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2 if PINGPONG else 1)   # one arrive per consumer partition
    if SPLIT_EMPTY:
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_empty.index(i), count=2 if PINGPONG else 1)
    else:
        k_empty = kv_empty                          # not used

    if PINGPONG:
        q_smem = gl.allocate_shared_memory(dtype, [2, BQ, D], q_smem_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bar.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        mbarrier.arrive(turn.index(0), count=1)         # warpgroup 0 issues first
        gl.warp_specialize([
            (_consumer, (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, q_bar.index(0),
                         k_ready, v_ready, kv_empty, turn, b, h, hk, bh, m0, SQ, SK, OFFSET, n_tiles, first_masked,
                         qk_scale, CAUSAL, STAGES, False, True, 0, H, REMAT, k_empty, SPLIT_EMPTY, EXP_EMU, 4)),
            (_consumer, (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem.index(1), k_smem, v_smem, q_bar.index(1),
                         k_ready, v_ready, kv_empty, turn, b, h, hk, bh, m0, SQ, SK, OFFSET, n_tiles, first_masked,
                         qk_scale, CAUSAL, STAGES, False, True, 1, H, REMAT, k_empty, SPLIT_EMPTY, EXP_EMU, 4)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, b, hk, n_tiles,
                         STAGES, SPLIT_EMPTY)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        for i in gl.static_range(2):
            mbarrier.invalidate(q_bar.index(i))
            mbarrier.invalidate(turn.index(i))
    else:
        q_smem = gl.allocate_shared_memory(dtype, [BQ, D], q_smem_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        if WARP_SPEC:
            gl.warp_specialize([
                (_consumer, (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready,
                             v_ready, kv_empty, q_bar, b, h, hk, bh, m0, SQ, SK, OFFSET, n_tiles, first_masked,
                             qk_scale, CAUSAL, STAGES, False, False, 0, H, False, k_empty, SPLIT_EMPTY, EXP_EMU,
                             num_warps)),
                (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, b, hk, n_tiles,
                             STAGES, SPLIT_EMPTY)),
            ], [1], [PRODUCER_REGS])
        else:
            _consumer(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                      kv_empty, q_bar, b, h, hk, bh, m0, SQ, SK, OFFSET, n_tiles, first_masked, qk_scale,
                      CAUSAL, STAGES, True, False, 0, H, False, kv_empty, False, EXP_EMU, num_warps)
        mbarrier.invalidate(q_bar)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
        if SPLIT_EMPTY:
            mbarrier.invalidate(k_empty.index(i))
