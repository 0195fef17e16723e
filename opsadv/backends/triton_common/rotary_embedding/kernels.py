"""Triton kernel of the rotary_embedding op (rotary.py).  One program per token (b, s): it loads that
position's cos / sin row once and rotates every head of q and then of k (BLOCK_H heads at a time), so each
element of q and k is read once and written once and the tables are read once per token.  float32 math.
BACKWARD rotates by the negative angle (the transpose of the rotation): the same kernel maps dq' to dq."""
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, O, H, x_tok, o_tok, sxh, soh, c1, c2, s1, s2, o1, o2, im, j, jm,
                  R: tl.constexpr, PASS_P2: tl.constexpr, BLOCK_H: tl.constexpr):
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        xh = X + x_tok + h.to(tl.int64)[:, None] * sxh
        oh = O + o_tok + h.to(tl.int64)[:, None] * soh
        m = hm[:, None] & im[None, :]
        x1 = tl.load(xh + o1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xh + o2[None, :], mask=m, other=0.0).to(tl.float32)
        y1 = x1 * c1[None, :] - x2 * s1[None, :]
        y2 = x2 * c2[None, :] + x1 * s2[None, :]
        tl.store(oh + o1[None, :], y1.to(O.dtype.element_ty), mask=m)
        tl.store(oh + o2[None, :], y2.to(O.dtype.element_ty), mask=m)
        if PASS_P2 > 0:                      # partial rotary: features R.. pass through
            pm = hm[:, None] & jm[None, :]
            xp = tl.load(xh + R + j[None, :], mask=pm, other=0.0)
            tl.store(oh + R + j[None, :], xp, mask=pm)


@triton.jit
def rotary_kernel(Q, K, OQ, OK, COS, SIN, POS, S, HQ, HK,
                  sqb, sqh, sqs, skb, skh, sks, soqb, soqh, soqs, sokb, sokh, soks,
                  scb, scs, spb, sps,
                  R: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr, PASS_P2: tl.constexpr,
                  BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
                  BACKWARD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // S
    s = tok - b * S
    if HAS_POS:
        row = tl.load(POS + b * spb + s * sps).to(tl.int64) * scs
    else:
        row = b * scb + s * scs
    i = tl.arange(0, HALF_P2)
    im = i < R // 2
    if INTERLEAVED:                          # the feature offsets of each pair, in the tables and in q / k
        t1 = 2 * i
        t2 = 2 * i + 1
    else:
        t1 = i
        t2 = i + R // 2
    c1 = tl.load(COS + row + t1, mask=im, other=0.0).to(tl.float32)
    c2 = tl.load(COS + row + t2, mask=im, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + row + t1, mask=im, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + row + t2, mask=im, other=0.0).to(tl.float32)
    if BACKWARD:
        tmp = s1
        s1 = -s2
        s2 = -tmp
    if PASS_P2 > 0:
        j = tl.arange(0, PASS_P2)
    else:
        j = tl.arange(0, 1)
    jm = j < D - R
    _rotate_heads(Q, OQ, HQ, b * sqb + s * sqs, b * soqb + s * soqs, sqh, soqh, c1, c2, s1, s2, t1, t2, im, j, jm,
                  R, PASS_P2, BLOCK_H)
    _rotate_heads(K, OK, HK, b * skb + s * sks, b * sokb + s * soks, skh, sokh, c1, c2, s1, s2, t1, t2, im, j, jm,
                  R, PASS_P2, BLOCK_H)
