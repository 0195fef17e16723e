"""Triton kernels of the qk_norm_rotary op (qk_norm_rotary.py).

Forward: one program per token (b, s).  It loads that position's cos / sin row and the two weights once, then for
BLOCK_H heads of q at a time (and then of k) loads each whole row (the rotated pairs x1 = x[t1], x2 = x[t2] and the
pass-through part xp = x[R:]), takes the sum of squares in float32, scales by rstd * (offset + w), rotates and
stores: each element of q and k is read once and written once.

Backward: a persistent grid, each program walking a contiguous run of tokens.  Per row it recomputes rstd from x
(the row is read anyway), rotates dy back (the transpose of the rotation: by -angle) to the gradient of the
normed row gn, and writes dx = rstd * (dxhat - xhat * mean(dxhat * xhat)) with dxhat = gn * (offset + w).  The
weight gradients sum gn * xhat over the program's rows in float32 registers; each program writes its partial row
(one per program, for q and for k) and the host sums the partials in a fixed order (deterministic)."""
import triton
import triton.language as tl


@triton.jit
def _norm_rotate_heads(X, O, W, H, x_tok, o_tok, sxh, soh, c1, c2, s1, s2, o1, o2, im, j, jm, eps, offset,
                       R: tl.constexpr, D: tl.constexpr, PASS_P2: tl.constexpr, BLOCK_H: tl.constexpr):
    w1 = offset + tl.load(W + o1, mask=im, other=0.0).to(tl.float32)
    w2 = offset + tl.load(W + o2, mask=im, other=0.0).to(tl.float32)
    if PASS_P2 > 0:
        wp = offset + tl.load(W + R + j, mask=jm, other=0.0).to(tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        xh = X + x_tok + h.to(tl.int64)[:, None] * sxh
        oh = O + o_tok + h.to(tl.int64)[:, None] * soh
        m = hm[:, None] & im[None, :]
        x1 = tl.load(xh + o1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xh + o2[None, :], mask=m, other=0.0).to(tl.float32)
        ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if PASS_P2 > 0:                      # partial rotary: features R.. are normalized, not rotated
            pm = hm[:, None] & jm[None, :]
            xp = tl.load(xh + R + j[None, :], mask=pm, other=0.0).to(tl.float32)
            ss += tl.sum(xp * xp, 1)
        rstd = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        n1 = x1 * rstd * w1[None, :]
        n2 = x2 * rstd * w2[None, :]
        y1 = n1 * c1[None, :] - n2 * s1[None, :]
        y2 = n2 * c2[None, :] + n1 * s2[None, :]
        tl.store(oh + o1[None, :], y1.to(O.dtype.element_ty), mask=m)
        tl.store(oh + o2[None, :], y2.to(O.dtype.element_ty), mask=m)
        if PASS_P2 > 0:
            tl.store(oh + R + j[None, :], (xp * rstd * wp[None, :]).to(O.dtype.element_ty), mask=pm)


@triton.jit
def _pairs(COS, SIN, POS, tok, S, scb, scs, spb, sps, HALF_P2: tl.constexpr, R: tl.constexpr,
           INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, BACKWARD: tl.constexpr):
    """(b, s, c1, c2, s1, s2, t1, t2, im) of token tok: its cos / sin pairs in float32 and their feature offsets."""
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
    if BACKWARD:                             # the transpose of the rotation: by -angle
        tmp = s1
        s1 = -s2
        s2 = -tmp
    return b, s, c1, c2, s1, s2, t1, t2, im


@triton.jit
def qk_norm_rotary_fwd_kernel(Q, K, OQ, OK, QW, KW, COS, SIN, POS, S, HQ, HK,
                              sqb, sqh, sqs, skb, skh, sks, soqb, soqh, soqs, sokb, sokh, soks,
                              scb, scs, spb, sps, eps, offset,
                              R: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr, PASS_P2: tl.constexpr,
                              BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b, s, c1, c2, s1, s2, t1, t2, im = _pairs(COS, SIN, POS, tok, S, scb, scs, spb, sps, HALF_P2, R, INTERLEAVED,
                                              HAS_POS, False)
    if PASS_P2 > 0:
        j = tl.arange(0, PASS_P2)
    else:
        j = tl.arange(0, 1)
    jm = j < D - R
    _norm_rotate_heads(Q, OQ, QW, HQ, b * sqb + s * sqs, b * soqb + s * soqs, sqh, soqh, c1, c2, s1, s2, t1, t2,
                       im, j, jm, eps, offset, R, D, PASS_P2, BLOCK_H)
    _norm_rotate_heads(K, OK, KW, HK, b * skb + s * sks, b * sokb + s * soks, skh, sokh, c1, c2, s1, s2, t1, t2,
                       im, j, jm, eps, offset, R, D, PASS_P2, BLOCK_H)


@triton.jit
def _norm_rotate_heads_bwd(G, X, DX, H, g_tok, x_tok, dx_tok, sgh, sxh, sdxh, w1, w2, wp, dw1, dw2, dwp,
                           c1, c2, s1, s2, o1, o2, im, j, jm, eps,
                           R: tl.constexpr, D: tl.constexpr, PASS_P2: tl.constexpr, BLOCK_H: tl.constexpr):
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        h64 = h.to(tl.int64)[:, None]
        gh = G + g_tok + h64 * sgh
        xh = X + x_tok + h64 * sxh
        dh = DX + dx_tok + h64 * sdxh
        m = hm[:, None] & im[None, :]
        x1 = tl.load(xh + o1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xh + o2[None, :], mask=m, other=0.0).to(tl.float32)
        g1 = tl.load(gh + o1[None, :], mask=m, other=0.0).to(tl.float32)
        g2 = tl.load(gh + o2[None, :], mask=m, other=0.0).to(tl.float32)
        gn1 = g1 * c1[None, :] - g2 * s1[None, :]           # (s1, s2 are the negated angle's)
        gn2 = g2 * c2[None, :] + g1 * s2[None, :]
        ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if PASS_P2 > 0:
            pm = hm[:, None] & jm[None, :]
            xp = tl.load(xh + R + j[None, :], mask=pm, other=0.0).to(tl.float32)
            gp = tl.load(gh + R + j[None, :], mask=pm, other=0.0).to(tl.float32)
            ss += tl.sum(xp * xp, 1)
        rstd = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        xh1 = x1 * rstd
        xh2 = x2 * rstd
        d1 = gn1 * w1[None, :]
        d2 = gn2 * w2[None, :]
        dw1 += tl.sum(gn1 * xh1, 0)
        dw2 += tl.sum(gn2 * xh2, 0)
        dot = tl.sum(d1 * xh1, 1) + tl.sum(d2 * xh2, 1)
        if PASS_P2 > 0:
            xhp = xp * rstd
            dp = gp * wp[None, :]
            dwp += tl.sum(gp * xhp, 0)
            dot += tl.sum(dp * xhp, 1)
        dot = (dot / D)[:, None]
        tl.store(dh + o1[None, :], (rstd * (d1 - xh1 * dot)).to(DX.dtype.element_ty), mask=m)
        tl.store(dh + o2[None, :], (rstd * (d2 - xh2 * dot)).to(DX.dtype.element_ty), mask=m)
        if PASS_P2 > 0:
            tl.store(dh + R + j[None, :], (rstd * (dp - xhp * dot)).to(DX.dtype.element_ty), mask=pm)
    return dw1, dw2, dwp


@triton.jit
def qk_norm_rotary_bwd_kernel(GQ, GK, Q, K, DQ, DK, QW, KW, DWQ, DWK, COS, SIN, POS, T, S, HQ, HK,
                              sgqb, sgqh, sgqs, sgkb, sgkh, sgks, sqb, sqh, sqs, skb, skh, sks,
                              sdqb, sdqh, sdqs, sdkb, sdkh, sdks, scb, scs, spb, sps, eps, offset, per_prog,
                              R: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr, PASS_P2: tl.constexpr,
                              BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.arange(0, HALF_P2)
    im = i < R // 2
    if INTERLEAVED:
        t1 = 2 * i
        t2 = 2 * i + 1
    else:
        t1 = i
        t2 = i + R // 2
    if PASS_P2 > 0:
        j = tl.arange(0, PASS_P2)
    else:
        j = tl.arange(0, 1)
    jm = j < D - R
    wq1 = offset + tl.load(QW + t1, mask=im, other=0.0).to(tl.float32)
    wq2 = offset + tl.load(QW + t2, mask=im, other=0.0).to(tl.float32)
    wk1 = offset + tl.load(KW + t1, mask=im, other=0.0).to(tl.float32)
    wk2 = offset + tl.load(KW + t2, mask=im, other=0.0).to(tl.float32)
    wqp = offset + tl.load(QW + R + j, mask=jm, other=0.0).to(tl.float32)
    wkp = offset + tl.load(KW + R + j, mask=jm, other=0.0).to(tl.float32)
    dq1 = tl.zeros((HALF_P2,), dtype=tl.float32)
    dq2 = tl.zeros((HALF_P2,), dtype=tl.float32)
    dk1 = tl.zeros((HALF_P2,), dtype=tl.float32)
    dk2 = tl.zeros((HALF_P2,), dtype=tl.float32)
    dqp = tl.zeros(j.shape, dtype=tl.float32)
    dkp = tl.zeros(j.shape, dtype=tl.float32)
    start = pid.to(tl.int64) * per_prog
    end = tl.minimum(start + per_prog, T)
    for tok in range(start, end):
        b, s, c1, c2, s1, s2, _u1, _u2, _um = _pairs(COS, SIN, POS, tok, S, scb, scs, spb, sps, HALF_P2, R,
                                                     INTERLEAVED, HAS_POS, True)
        dq1, dq2, dqp = _norm_rotate_heads_bwd(GQ, Q, DQ, HQ, b * sgqb + s * sgqs, b * sqb + s * sqs,
                                               b * sdqb + s * sdqs, sgqh, sqh, sdqh, wq1, wq2, wqp, dq1, dq2, dqp,
                                               c1, c2, s1, s2, t1, t2, im, j, jm, eps, R, D, PASS_P2, BLOCK_H)
        dk1, dk2, dkp = _norm_rotate_heads_bwd(GK, K, DK, HK, b * sgkb + s * sgks, b * skb + s * sks,
                                               b * sdkb + s * sdks, sgkh, skh, sdkh, wk1, wk2, wkp, dk1, dk2, dkp,
                                               c1, c2, s1, s2, t1, t2, im, j, jm, eps, R, D, PASS_P2, BLOCK_H)
    row = pid.to(tl.int64) * D                  # this program's partial weight gradients
    tl.store(DWQ + row + t1, dq1, mask=im)
    tl.store(DWQ + row + t2, dq2, mask=im)
    tl.store(DWK + row + t1, dk1, mask=im)
    tl.store(DWK + row + t2, dk2, mask=im)
    if PASS_P2 > 0:
        tl.store(DWQ + row + R + j, dqp, mask=jm)
        tl.store(DWK + row + R + j, dkp, mask=jm)
