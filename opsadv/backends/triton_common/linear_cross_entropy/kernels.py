"""The cross-entropy kernels of one chunk of logits (linear_cross_entropy.py): one program per token row.

ce_chunk_kernel (linear_cross_entropy): pass 1 walks the row's logits once (online max and sum of exponentials, the
sum of the logits for label smoothing, softcapped where asked) and stores the row's loss and lse; pass 2
(WRITE_GRAD) walks it again and overwrites each logit with d loss / d logit times the row's gradient, in the
buffer's dtype, so the logits' memory holds the gradient the two GEMMs that follow read.

stats_chunk_kernel / stats_grad_kernel (linear_cross_entropy_stats, the per-shard work of the vocab-parallel loss):
the same pass 1 storing (lse, target logit, logit sum) of a slice of the vocabulary, and the overwrite of each
logit with its gradient for given per-row gradients of those three numbers."""
import triton
import triton.language as tl


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # softcap * tanh(x / softcap), tanh(a) = 2 sigmoid(2a) - 1 (exact at both ends: exp overflow gives -1)
        return softcap * (2.0 / (1.0 + tl.exp(-2.0 * (x / softcap))) - 1.0)
    return x


@triton.jit
def _row_lse(base, V, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """(logsumexp, sum) of the V (softcapped) logits at base: one pass, online max and sum of exponentials."""
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    zsum = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        inb = c < V
        z = _capped(tl.load(base + c, mask=inb, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
        zm = tl.where(inb, z, float("-inf"))
        m_new = tl.maximum(m, zm)
        # (lanes that saw no column yet stay at -inf with s = 0: no -inf - -inf is formed)
        alpha = tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new))
        s = s * alpha + tl.exp(tl.where(inb, zm - m_new, float("-inf")))
        m = m_new
        zsum += tl.where(inb, z, 0.0)
    mx = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - mx), 0)
    lse = mx + tl.log(total)
    return lse, tl.sum(zsum, 0)


@triton.jit
def ce_chunk_kernel(z_ptr, z_row, labels_ptr, rowgrad_ptr, rowgrad_stride, loss_ptr, lse_ptr, V, ignore_index,
                    eps, z_loss, softcap, HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * z_row
    label = tl.load(labels_ptr + row).to(tl.int32)
    valid = label != ignore_index
    lse, zsum = _row_lse(base, V, softcap, HAS_SOFTCAP, BLOCK_V)
    safe = tl.where(valid, label, 0)
    tgt = _capped(tl.load(base + safe).to(tl.float32), softcap, HAS_SOFTCAP)
    loss = (1.0 - eps) * (lse - tgt) + eps * (lse - zsum / V) + z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row, lse)
    if WRITE_GRAD:
        g = tl.where(valid, tl.load(rowgrad_ptr + row * rowgrad_stride).to(tl.float32), 0.0)
        scale = 1.0 + 2.0 * z_loss * lse
        cols = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            c = start + cols
            inb = c < V
            z = _capped(tl.load(base + c, mask=inb, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
            d = tl.exp(z - lse) * scale - eps / V - tl.where(c == label, 1.0 - eps, 0.0)
            if HAS_SOFTCAP:
                t = z / softcap
                d = d * (1.0 - t * t)            # d softcap(x) / dx = 1 - tanh(x / softcap)^2
            tl.store(base + c, (d * g).to(z_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _label_in_slice(labels_ptr, row, V, ignore_index, vocab_start):
    """(the row's label as a column of this slice of the vocabulary, whether it falls in the slice)."""
    label = tl.load(labels_ptr + row).to(tl.int64)
    idx = label - vocab_start
    mine = (label != ignore_index) & (idx >= 0) & (idx < V)
    return tl.where(mine, idx, 0), mine


@triton.jit
def stats_chunk_kernel(z_ptr, z_row, labels_ptr, stats_ptr, stats_row, V, ignore_index, vocab_start, softcap,
                       HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * z_row
    idx, mine = _label_in_slice(labels_ptr, row, V, ignore_index, vocab_start)
    lse, zsum = _row_lse(base, V, softcap, HAS_SOFTCAP, BLOCK_V)
    tgt = _capped(tl.load(base + idx).to(tl.float32), softcap, HAS_SOFTCAP)
    tl.store(stats_ptr + row, lse)
    tl.store(stats_ptr + stats_row + row, tl.where(mine, tgt, 0.0))
    tl.store(stats_ptr + 2 * stats_row + row, zsum)


@triton.jit
def stats_grad_kernel(z_ptr, z_row, labels_ptr, grad_ptr, grad_row, lse_ptr, V, ignore_index, vocab_start, softcap,
                      HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    # d / d z_j of (g_lse lse + g_tgt z_y + g_sum sum z) = g_lse softmax_j + g_tgt [j = y] + g_sum
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * z_row
    idx, mine = _label_in_slice(labels_ptr, row, V, ignore_index, vocab_start)
    g_lse = tl.load(grad_ptr + row).to(tl.float32)
    g_tgt = tl.where(mine, tl.load(grad_ptr + grad_row + row).to(tl.float32), 0.0)
    g_sum = tl.load(grad_ptr + 2 * grad_row + row).to(tl.float32)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        inb = c < V
        z = _capped(tl.load(base + c, mask=inb, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
        d = tl.exp(z - lse) * g_lse + g_sum + tl.where(c == idx, g_tgt, 0.0)
        if HAS_SOFTCAP:
            t = z / softcap
            d = d * (1.0 - t * t)
        tl.store(base + c, d.to(z_ptr.dtype.element_ty), mask=inb)
