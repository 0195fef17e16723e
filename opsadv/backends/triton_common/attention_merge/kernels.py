"""Triton kernel of the attention_merge_ op (attention_merge.py).  One program per (block of BLOCK_S rows, b * h)
on a 1-D grid: it reads the rows' acc_lse and lse once, computes the merged lse and both weights in float32, writes
acc_lse, then streams acc_out and out over D in tiles of BLOCK_D (one tile up to d = 128, two up to 256) and writes
acc_out once.  Any strides; out in any float dtype, read and widened to float32.

    m = max(a, l), e = exp(min(a, l) - m), new = m + log(1 + e), weights 1 / (1 + e) (the larger side) and
    e / (1 + e) (the other): exp(a - new) and exp(l - new) without forming new first.  Rows with a = l = -inf:
    new = -inf, both weights 0 (the reference's exponents against 0)."""
import triton
import triton.language as tl


@triton.jit
def merge_kernel(ACC_O, ACC_L, O, L, S, H, NBLK,
                 s_ab, s_ah, s_as, s_ad, s_lb, s_lh, s_ls,
                 s_ob, s_oh, s_os, s_od, s_2b, s_2h, s_2s,
                 D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    bh = pid // NBLK
    blk = pid - bh * NBLK
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    rm = rows < S
    r = rows.to(tl.int64)
    p_acc_l = ACC_L + b * s_lb + h * s_lh + r * s_ls
    a = tl.load(p_acc_l, mask=rm, other=float("-inf")).to(tl.float32)
    l = tl.load(L + b * s_2b + h * s_2h + r * s_2s, mask=rm, other=float("-inf")).to(tl.float32)
    m = tl.maximum(a, l)
    empty = m == float("-inf")
    e = tl.where(empty, 0.0, tl.exp(tl.minimum(a, l) - tl.where(empty, 0.0, m)))
    inv = 1.0 / (1.0 + e)
    w_big = tl.where(empty, 0.0, inv)
    w_small = e * inv
    a_big = a >= l
    w_a = tl.where(a_big, w_big, w_small)
    w_l = tl.where(a_big, w_small, w_big)
    new = tl.where(empty, float("-inf"), m + tl.log(1.0 + e))
    tl.store(p_acc_l, new, mask=rm)
    p_acc_o = ACC_O + b * s_ab + h * s_ah + r[:, None] * s_as
    p_o = O + b * s_ob + h * s_oh + r[:, None] * s_os
    for d0 in tl.static_range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = rm[:, None] & (cols < D)[None, :]
        x = tl.load(p_acc_o + cols[None, :] * s_ad, mask=mask, other=0.0)
        y = tl.load(p_o + cols[None, :] * s_od, mask=mask, other=0.0).to(tl.float32)
        tl.store(p_acc_o + cols[None, :] * s_ad, x * w_a[:, None] + y * w_l[:, None], mask=mask)
