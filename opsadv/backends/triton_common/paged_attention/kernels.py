"""Triton kernels of the paged_attention op (paged_attention.py).

paged_attn_kernel: one program per (KV split, sequence x kv head, query-row block).  Its rows are (query, head)
pairs of the G = Hq / Hkv query heads that share the program's kv head (row r: query r // G, head r % G), so a
decode step (one query) puts the whole GQA group in one tile and K / V are read once per kv head.  Keys are read
through the block table a BLOCK_N-key tile at a time (each key's page looked up: any page size), online softmax
in float32 (exp2), causal bottom-right (query i of n sees keys j <= L - n + i).  With SPLIT the program covers
one of NUM_SPLITS slices of the key range (flash-decoding) and writes its normalized partial out and lse in
float32; merge_kernel then combines the slices.  append_kernel writes k_new / v_new into the pages first.

FP8 (an e4m3 cache with per-kv-head scales): the attention kernel widens each K / V tile exactly to q's dtype (e4m3
fits in fp16 / bf16 / fp32) and folds k_scale into the qk scale and v_scale into the normalized output, so the
tile loop does no extra multiply; the append kernel quantizes (_quantize_e4m3).  F16_DOT (bf16 q over an fp8
cache): the tiles widen to fp16 instead (one cvt per two values on sm_89+, where bf16 takes a detour through
fp32); q is brought into fp16's range by a power of two (exact; its inverse folded into the qk scale) and the
probabilities enter the P @ V dot as fp16, which holds them more precisely than bf16.

KV_CONTIG (varlen_attention): K / V are packed (total_k, Hkv, D) tensors instead of pages; BT is cu_seqlens_k, and
sequence b's key j is row cu_seqlens_k[b] + j (SEQ, PAGE and the page strides are unused).  The flag is a
constexpr: with it off the kernel compiles to the paged code as before."""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _segment(CU, b, S, VARLEN: tl.constexpr):
    """Sequence b's first row and row count: from cu_seqlens (packed) or S rows each."""
    if VARLEN:
        r0 = tl.load(CU + b)
        n = tl.load(CU + b + 1) - r0
    else:
        r0 = b * S
        n = S
    return r0, n


@triton.jit
def _quantize_e4m3(x, scale):
    """clamp(x / scale, -448, 448) rounded to nearest even onto the e4m3 grid, as float32 values the cast to e4m3
    then keeps exactly: torch's .to(float8_e4m3fn) bit for bit.  The rounding is done here rather than by the
    cast because triton 3.6's interpreter casts float32 -> e4m3 wrongly (ties away from zero, and a round-up that
    carries into the exponent loses it: 124.7 -> 64)."""
    y = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF                                           # biased float32 exponent of |y|
    ulp = ((tl.maximum(e, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)   # e4m3's spacing (2^-9 below 2^-6)
    r = tl.abs(y) / ulp                                               # exact: a power of two; r < 2^4
    r = (r + 12582912.0) - 12582912.0                                 # round half to even (1.5 * 2^23)
    a = (r * ulp).to(tl.int32, bitcast=True)
    return (a | (bits & -2147483648)).to(tl.float32, bitcast=True)   # y's sign back (-0.0 too)


@triton.jit
def append_kernel(KN, VN, KC, VC, BT, SEQ, CU, S_NEW, HKV, KS, VS, sks, svs,
                  snt, snh, snd, svnt, svnh, svnd,
                  skp, skt, skh, skd, svp, svt, svh, svd, sbb, sbp,
                  PAGE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                  VARLEN: tl.constexpr, FP8: tl.constexpr):
    """Program (sequence b, block of its new tokens): token i of the n new ones goes to cache position
    seqlens_k[b] - n + i, page block_table[b, pos // PAGE], slot pos % PAGE, every kv head.  FP8: quantized with
    kv head h's scales KS[h * sks] / VS[h * svs] (stride 0: one scale)."""
    b = tl.program_id(0)
    tb = tl.program_id(1)
    r0, n = _segment(CU, b, S_NEW, VARLEN)
    if tb * BLOCK_T >= n:
        return
    kv_len = tl.load(SEQ + b)
    i = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    pos = kv_len - n + i
    tm = (i < n) & (pos >= 0)
    page = tl.load(BT + b.to(tl.int64) * sbb + (pos // PAGE) * sbp, mask=tm, other=0).to(tl.int64)
    slot = pos % PAGE
    d = tl.arange(0, BLOCK_D)
    m = tm[:, None] & (d < D)[None, :]
    row = (r0 + i).to(tl.int64)
    for h in range(HKV):
        k = tl.load(KN + row[:, None] * snt + h * snh + d[None, :] * snd, mask=m)
        v = tl.load(VN + row[:, None] * svnt + h * svnh + d[None, :] * svnd, mask=m)
        if FP8:
            k = _quantize_e4m3(k.to(tl.float32), tl.load(KS + h * sks))
            v = _quantize_e4m3(v.to(tl.float32), tl.load(VS + h * svs))
        tl.store(KC + (page * skp + slot * skt + h * skh)[:, None] + d[None, :] * skd, k.to(KC.dtype.element_ty),
                 mask=m)
        tl.store(VC + (page * svp + slot * svt + h * svh)[:, None] + d[None, :] * svd, v.to(VC.dtype.element_ty),
                 mask=m)


@triton.jit
def paged_attn_kernel(Q, KC, VC, BT, SEQ, CU, O, LSE, S_Q, HKV, G, NUM_SPLITS, qk_scale, KS, VS, sks, svs,
                      sqt, sqh, sqd, skp, skt, skh, skd, svp, svt, svh, svd, sbb, sbp,
                      sot, soh, sod, slt, slh, sos, sls,
                      PAGE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                      IEEE: tl.constexpr, FP8: tl.constexpr, KV_CONTIG: tl.constexpr = False,
                      F16_DOT: tl.constexpr = False):
    """qk_scale = scale * log2(e).  O / LSE: the output and lse ((rows, Hq, D) / (rows, Hq)), or with SPLIT the
    float32 partials, split s at offset s * sos / s * sls.  FP8: e4m3 K / V with the kv head's scales at
    KS[kvh * sks] / VS[kvh * svs] (stride 0: one scale)."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    mb = tl.program_id(2)
    b = bh // HKV
    kvh = bh % HKV
    r0, n = _segment(CU, b, S_Q, VARLEN)
    if mb * BLOCK_M >= n * G:                 # past this sequence's rows (packed q: the grid's bound is total_q)
        return
    if KV_CONTIG:
        k0 = tl.load(BT + b)                   # BT is cu_seqlens_k: keys are rows k0 .. k0 + kv_len - 1
        kv_len = tl.load(BT + b + 1) - k0
    else:
        kv_len = tl.load(SEQ + b)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    head = kvh * G + rows % G
    row_ok = qi < n
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q_off = (r0 + qi).to(tl.int64) * sqt + head.to(tl.int64) * sqh
    q = tl.load(Q + q_off[:, None] + d[None, :] * sqd, mask=row_ok[:, None] & dm[None, :], other=0.0)
    if FP8:
        qk_scale = qk_scale * tl.load(KS + kvh * sks)      # K = fp8 * k_scale: one multiply per program
    if F16_DOT:
        # per row, a power of two that brings |q| under 2^14 (fp16 holds 65504): exact, undone in the row's qk scale
        # (per row, so an inf in one head's query makes that row NaN, as without the shift, and no other)
        qf = q.to(tl.float32)
        qmax = tl.max(tl.abs(qf), 1)
        shift = tl.where(qmax > 16384.0, tl.exp2(tl.ceil(tl.log2(qmax * (1.0 / 16384.0)))), 1.0)
        q = (qf / shift[:, None]).to(tl.float16)
        qk_rows = qk_scale * shift
    # this program's keys: its split's slice of [0, L), cut at the last key its rows see (causal)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_len)
    else:
        lo = 0
        hi = kv_len
    if CAUSAL:
        last_q = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G, n - 1)
        hi = tl.minimum(hi, kv_len - n + last_q + 1)
    diag = kv_len - n + qi                     # causal: row sees keys <= diag
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BT + b.to(tl.int64) * sbb
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        km = kpos < hi
        if KV_CONTIG:
            krow = (k0 + kpos).to(tl.int64)
            k = tl.load(KC + (krow * skt + kvh * skh)[:, None] + d[None, :] * skd,
                        mask=km[:, None] & dm[None, :], other=0.0)
        else:
            page = tl.load(bt_row + (kpos // PAGE) * sbp, mask=km, other=0).to(tl.int64)
            slot = kpos % PAGE
            k = tl.load(KC + (page * skp + slot * skt + kvh * skh)[:, None] + d[None, :] * skd,
                        mask=km[:, None] & dm[None, :], other=0.0)      # (BLOCK_N, BLOCK_D): rows of d contiguous
        if FP8:
            k = k.to(q.dtype)                                            # exact: e4m3 fits fp16 / bf16 / fp32
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if F16_DOT:
            s = s * qk_rows[:, None]
        else:
            s = s * qk_scale
        ok = km[None, :] & row_ok[:, None]
        if CAUSAL:
            ok = ok & (kpos[None, :] <= diag[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_CONTIG:
            v = tl.load(VC + (krow * svt + kvh * svh)[:, None] + d[None, :] * svd,
                        mask=km[:, None] & dm[None, :], other=0.0)
        else:
            v = tl.load(VC + (page * svp + slot * svt + kvh * svh)[:, None] + d[None, :] * svd,
                        mask=km[:, None] & dm[None, :], other=0.0)
        if FP8:
            v = v.to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    none = l_i == 0.0                          # no key seen: 0 and -inf (a NaN / +inf score: NaN goes through)
    out = acc / tl.where(none, 1.0, l_i)[:, None]
    if FP8:
        out = out * tl.load(VS + kvh * svs)                # V = fp8 * v_scale (the merge is linear in out)
    lse = tl.where(none, float("-inf"), (m_i + tl.log2(tl.where(none, 1.0, l_i))) * LN2)
    o_off = (r0 + qi).to(tl.int64) * sot + head.to(tl.int64) * soh
    l_off = (r0 + qi).to(tl.int64) * slt + head.to(tl.int64) * slh
    if SPLIT:
        o_off += split.to(tl.int64) * sos
        l_off += split.to(tl.int64) * sls
    tl.store(O + o_off[:, None] + d[None, :] * sod, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
    tl.store(LSE + l_off, lse, mask=row_ok)


@triton.jit
def merge_kernel(OP, LP, O, LSE, H, NUM_SPLITS, sos, sls, sot, soh, slt,
                 D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (query row t, block of heads): out = sum_s w_s o_s, w_s = exp(lse_s - lse), lse = log sum_s
    exp(lse_s) over the splits' partials (float32, contiguous (splits, rows, H, D) / (splits, rows, H)); a row no
    split saw gives 0 and -inf."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, BLOCK_D)
    m2 = hm[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        ls = tl.load(LP + s * sls + t * H + h, mask=hm, other=float("-inf"))
        os = tl.load(OP + s * sos + t * H * D + h[:, None] * D + d[None, :], mask=m2, other=0.0)
        m_new = tl.maximum(m, ls)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        w = tl.exp(ls - m_safe)
        den = den * a + w
        acc = acc * a[:, None] + w[:, None] * os
        m = m_new
    none = den == 0.0
    out = acc / tl.where(none, 1.0, den)[:, None]
    lse = tl.where(none, float("-inf"), m + tl.log(tl.where(none, 1.0, den)))
    tl.store(O + t * sot + h[:, None] * soh + d[None, :], out.to(O.dtype.element_ty), mask=m2)
    tl.store(LSE + t * slt + h, lse, mask=hm)
