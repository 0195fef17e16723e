"""The cross-entropy kernel of one chunk of logits (linear_cross_entropy.py): one program per token row.

Pass 1 walks the row's logits once (online max and sum of exponentials, the sum of the logits for label smoothing,
softcapped where asked) and stores the row's loss and lse; pass 2 (WRITE_GRAD) walks it again and overwrites each
logit with d loss / d logit times the row's gradient, in the buffer's dtype, so the logits' memory holds the
gradient the two GEMMs that follow read."""
import triton
import triton.language as tl


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # softcap * tanh(x / softcap), tanh(a) = 2 sigmoid(2a) - 1 (exact at both ends: exp overflow gives -1)
        return softcap * (2.0 / (1.0 + tl.exp(-2.0 * (x / softcap))) - 1.0)
    return x


@triton.jit
def ce_chunk_kernel(z_ptr, z_row, labels_ptr, rowgrad_ptr, rowgrad_stride, loss_ptr, lse_ptr, V, ignore_index,
                    eps, z_loss, softcap, HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * z_row
    label = tl.load(labels_ptr + row).to(tl.int32)
    valid = label != ignore_index
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
    safe = tl.where(valid, label, 0)
    tgt = _capped(tl.load(base + safe).to(tl.float32), softcap, HAS_SOFTCAP)
    loss = (1.0 - eps) * (lse - tgt) + eps * (lse - tl.sum(zsum, 0) / V) + z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row, lse)
    if WRITE_GRAD:
        g = tl.where(valid, tl.load(rowgrad_ptr + row * rowgrad_stride).to(tl.float32), 0.0)
        scale = 1.0 + 2.0 * z_loss * lse
        for start in range(0, V, BLOCK_V):
            c = start + cols
            inb = c < V
            z = _capped(tl.load(base + c, mask=inb, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
            d = tl.exp(z - lse) * scale - eps / V - tl.where(c == label, 1.0 - eps, 0.0)
            if HAS_SOFTCAP:
                t = z / softcap
                d = d * (1.0 - t * t)            # d softcap(x) / dx = 1 - tanh(x / softcap)^2
            tl.store(base + c, (d * g).to(z_ptr.dtype.element_ty), mask=inb)
