"""Vendor flash attention impls: PyTorch's SDPA kernels (cuDNN, FlashAttention-2, memory-efficient)
called through the aten ops that return the log-sum-exp, so the op contract's (out, lse) and a
backward without recomputation come straight from the vendor kernels.

  cuDNN      aten._scaled_dot_product_cudnn_attention      lse (b, h, s_q, 1) float32, natural log
  flash      aten._scaled_dot_product_flash_attention      lse (b, h, s_q) float32
  efficient  aten._scaled_dot_product_efficient_attention  lse (b, h, ceil(s_q/32)*32) float32

SDPA's is_causal is aligned TOP-LEFT when s_q != s_k, opsadv's causal bottom-right: causal with
different lengths is rejected (the Triton or reference impl serves it).  GQA: cuDNN and flash read
the kv heads natively (cuDNN's forward and backward take h_kv < h_q: checked on the H200 with torch
2.11, 0.99 ms vs 1.24 ms when expanding, b4 h32/8 s4096 d128 causal);
efficient gets K/V expanded to the q heads (and dK/dV summed back).
Dropout is never used, so the philox seed/offset placeholders passed to the backward ops are unread.

sparse_attention, packed batches: FlashAttention-2's varlen kernel (aten._flash_attention_forward /
_backward with cu_seqlens) serves exactly a plain varlen layout: segments (s_q == s_k each, so FA2's
causal alignment equals opsadv's), block mask all True (the layout's dense_blocks fact), no key padding,
window or global tokens, max_seqlen known on the host (FA2's grid; no device read, so CUDA graphs
capture it).  Inputs (1, h, N, d) are handed over as (N, h, d) views (no copy for the (1, N, h, d)
memory transformers' projections give); its lse (h, N) float32 natural-log is the op's (1, h, N)."""
from __future__ import annotations

import torch

from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_VENDOR, KernelImpl, MemoryTraits
from opsadv.core.sparse_tiles import live_segments

BASE_FEATURES = frozenset({"causal", "gqa", "cross_length"})
MASK_FEATURES = frozenset({"attn_mask_bool", "attn_mask_float"})


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _reduce(t: torch.Tensor, group: int) -> torch.Tensor:
    if group == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // group, group, s, d).sum(2)


def _philox(device) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.zeros((), dtype=torch.int64, device=device)
    return z, z


def _causal_rule(spec, env) -> list[str]:
    if "causal" in spec.features and "cross_length" in spec.features:
        return ["causal with s_q != s_k: SDPA's is_causal is top-left aligned, opsadv's bottom-right"]
    return []


def _mult8(spec, env) -> list[str]:
    why = _causal_rule(spec, env)
    if spec.head_dim is not None and spec.head_dim % 8:
        why.append(f"head_dim {spec.head_dim} is not a multiple of 8")
    return why


def _cudnn_rule(spec, env) -> list[str]:
    why = _mult8(spec, env)
    q_shape, k_shape = spec.shapes[0], spec.shapes[1]
    if q_shape[2] == 1 and k_shape[2] == 1:
        why.append("cuDNN frontend rejects s_q = s_kv = 1")
    return why


DECODE_MAX_Q = 16     # query rows of a decode step (the s_q length bucket's floor): cuDNN ranks below flash there


def _cudnn_rank(spec, env) -> tuple[int, str] | None:
    """KernelImpl.rank: below FlashAttention-2 for decode-shaped forwards (a few queries against a longer cache).
    H200, llama3-0.5b generate (b8, prompt 512, 32 new tokens, norms and rotary converted): 742 ms with cuDNN,
    689 ms with FA2, 678 ms with the efficient kernel; cuDNN's host cost per call is the difference."""
    if spec.backward or len(spec.bucket) != 3:
        return None
    s_q, s_k, _ = spec.bucket        # (s_q, s_k, batch * heads) buckets: opsadv.ops.flash_attention._spec
    if s_q > DECODE_MAX_Q or s_k <= s_q:
        return None
    return PRIORITY_VENDOR - 15, f"decode-shaped (s_q <= {DECODE_MAX_Q}, longer keys): FA2 measured faster in generate"


# ---- cuDNN ---------------------------------------------------------------------------------------
def cudnn_fwd(ctx, q, k, v, attn_mask, causal, scale):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    b, h, sq, _ = q.shape
    return r[0], r[1].reshape(b, h, sq)


def cudnn_infer(ctx, q, k, v, attn_mask, causal, scale):
    """No-grad calls that do not return lse (KernelImpl.inference): cuDNN without its log-sum-exp output,
    as SDPA runs it under no_grad (the lse is a (b, h, s_q) float32 write and an extra reduction)."""
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, causal, False, scale=scale)
    return r[0], None


def _like_q(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """t in the layout cuDNN's forward gave its output (that of torch.empty_like(q)).  Its backward
    assumes out and dout share it: given out/dout in another layout (e.g. contiguous, as compiled
    graphs pass them) it returned wrong gradients on the H200."""
    ref = torch.empty_like(q, dtype=t.dtype)
    if t.stride() == ref.stride():
        return t
    return ref.copy_(t)


def cudnn_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    seed, offset = _philox(q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _like_q(dout, q), q, k, v, _like_q(out, q), lse.float().unsqueeze(-1).contiguous(),
        seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)


# ---- FlashAttention-2 ----------------------------------------------------------------------------
def flash_fwd(ctx, q, k, v, attn_mask, causal, scale):
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def flash_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    seed, offset = _philox(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out, lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        seed, offset, scale=scale)
    return dq, dk, dv


# ---- memory-efficient (takes masks) ----------------------------------------------------------------
def _bias(attn_mask, q, sk):
    """Additive bias (b, h, s_q, s_k) with a 16-aligned row stride, as the kernel requires.  A row
    the mask empties entirely gets a zero bias (the kernel turns an all -inf row into NaN in its
    backward); such rows are zeroed in the output and get lse = -inf / +inf around the kernel."""
    if attn_mask is None:
        return None
    b, h, sq, _ = q.shape
    m = attn_mask
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill_(~m, float("-inf"))
    m = m.masked_fill(torch.isneginf(m).all(-1, keepdim=True), 0.0)   # no host sync: a device-side fill
    pad = (-sk) % 16
    if pad or m.stride(-1) != 1:
        full = torch.zeros((b, h, sq, sk + pad), dtype=q.dtype, device=q.device)
        full[..., :sk] = m
        return full[..., :sk]
    return m.expand(b, h, sq, sk)


def _empty_rows(attn_mask, shape):
    """(b, h, s_q) bool: rows in which the mask allows no key."""
    dead = ~attn_mask.any(-1) if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask).all(-1)
    return dead.expand(shape[:3])


def efficient_fwd(ctx, q, k, v, attn_mask, causal, scale):
    group = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand(k, group), _expand(v, group), _bias(attn_mask, q, sk), True, 0.0, causal, scale=scale)
    lse = lse[:, :, :sq]
    if attn_mask is not None:  # a row the mask empties: zeros and lse = -inf (the contract), never NaN
        empty = _empty_rows(attn_mask, q.shape) | ~torch.isfinite(lse)
        out = out.masked_fill(empty[..., None], 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse.contiguous()


def _masked_bwd_recompute(dout, q, k, v, attn_mask, causal, scale):
    """Masked half-precision backward through aten's own autograd of the efficient kernel (forward
    recomputed): calling the aten backward op directly gave wrong gradients with a bias in fp16/bf16
    on the H200 (conformance mask_bool / mask_float, torch 2.11), fp32 was right.  A row the mask
    (with causal) empties has zero output by contract: its bias row is zeroed (finite) and its dout
    zeroed, so it contributes no gradient.
    Differentiated with torch.func.vjp, not torch.autograd.grad: a compiled backward runs this inside the
    opsadv::flash_attention_backward custom op, where autograd records no graph (functorch's grad transform
    re-enables it for the recompute), so the same aten autograd formula runs eager and compiled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[1] // k.shape[1]
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    m = attn_mask                   # kept at its own shape (a (b, 1, s_q, s_k) mask is not copied per head)
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill_(~m, float("-inf"))
    if causal:                                            # equal lengths here (the impl refuses others)
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        m = m.masked_fill(~keep, float("-inf"))
    empty = torch.isneginf(m).all(-1, keepdim=True)
    m = m.masked_fill(empty, 0.0).expand(b, h, sq, sk)
    dout = dout.masked_fill(empty, 0.0)
    def attend(qq, kk, vv):
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=scale)

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        _, pull = torch.func.vjp(attend, q.detach(), _expand(k, group).detach(), _expand(v, group).detach())
        dq, dk, dv = pull(dout)
    return dq, _reduce(dk, group), _reduce(dv, group)


def _bmhk(t: torch.Tensor) -> torch.Tensor:
    """t (b, h, s, d) with (b, s, h, d) memory, as the efficient forward writes it.  The cutlass backward
    takes out's row stride as heads * head_dim (kernel_backward.h, o_strideM), whatever the tensor's
    strides say: out from cuDNN ((b, h, s, d) memory) gave NaN dq on the H200 until copied."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def efficient_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    if attn_mask is not None and q.dtype != torch.float32:
        return _masked_bwd_recompute(dout, q, k, v, attn_mask, causal, scale)
    group = q.shape[1] // k.shape[1]
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    padded = torch.zeros((b, h, -(-sq // 32) * 32), dtype=torch.float32, device=q.device)
    # an empty row (lse = -inf) gets +inf so its probabilities, hence its gradients, are 0
    padded[:, :, :sq] = lse.float().masked_fill(torch.isneginf(lse), float("inf"))
    seed, offset = _philox(q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, _expand(k, group), _expand(v, group), _bias(attn_mask, q, sk), _bmhk(out), padded,
        seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _reduce(dk, group), _reduce(dv, group)


# ---- FlashAttention-2 varlen: sparse_attention over packed batches ------------------------------------
VARLEN_FEATURES = frozenset({"causal", "gqa", "varlen"})   # the check also requires the hints below


def _varlen_rule(spec, env) -> list[str]:
    why = []
    if "varlen" not in spec.features:
        why.append("needs a packed layout (cu_seqlens): FA2's varlen kernel applies no other mask")
    if "dense_blocks" not in spec.features:
        why.append("the layout's block mask is not known to be all True (a block pattern, or a layout built "
                   "by hand without dense_blocks=True)")
    if "varlen" in spec.features and "max_seqlen_known" not in spec.features:
        why.append("the layout carries no max_seqlen (FA2's grid size must be a host int; SparseLayout.varlen sets it)")
    if spec.head_dim is not None and spec.head_dim % 8:
        why.append(f"head_dim {spec.head_dim} is not a multiple of 8")
    return why


def _thd(t: torch.Tensor) -> torch.Tensor:
    """(1, h, N, d) -> the (N, h, d) view FA2's varlen API takes (any row / head strides, unit d stride)."""
    t = t[0].transpose(0, 1)
    return t if t.stride(-1) == 1 else t.contiguous()


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)        # (N, h, d) -> (1, h, N, d), a view


def _cu32(cu: torch.Tensor) -> torch.Tensor:
    cu = live_segments(cu)                       # (FA2's grid spans the segments: not the empty trailing ones)
    return cu if cu.dtype == torch.int32 and cu.is_contiguous() else cu.to(torch.int32).contiguous()


def flash_varlen_fwd(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks=False,
                     max_seqlen=-1):
    if max_seqlen < 0:       # the check requires the fact; a direct call without it is a caller bug
        raise ValueError("cuda.sdpa.flash_varlen: max_seqlen (a host bound on the segment lengths) is required")
    cu = _cu32(cu)
    out, lse = torch.ops.aten._flash_attention_forward(_thd(q), _thd(k), _thd(v), cu, cu, max_seqlen, max_seqlen,
                                                       0.0, causal, False, scale=scale)[:2]
    h, n = q.shape[1], q.shape[2]
    if tuple(lse.shape) != (h, n):
        raise RuntimeError(f"cuda.sdpa.flash_varlen: FA2 returned lse {tuple(lse.shape)}, expected (heads, total) "
                           f"= {(h, n)} (this torch's FA2 lays varlen lse out differently)")
    return _bhsd(out), lse.unsqueeze(0)


def flash_varlen_bwd(ctx, dout, q, k, v, out, lse, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale,
                     dense_blocks=False, max_seqlen=-1):
    if max_seqlen < 0:
        raise ValueError("cuda.sdpa.flash_varlen: max_seqlen (a host bound on the segment lengths) is required")
    cu = _cu32(cu)
    seed, offset = _philox(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _thd(dout), _thd(q), _thd(k), _thd(v), _thd(out), lse[0].float().contiguous(), cu, cu, max_seqlen,
        max_seqlen, 0.0, causal, seed, offset, scale=scale)
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def impls(env) -> list[KernelImpl]:
    half = (torch.float16, torch.bfloat16)
    return [
        KernelImpl(id="cuda.sdpa.cudnn", op="flash_attention", backend="cuda", fn=cudnn_fwd, backward=cudnn_bwd,
                   inference=cudnn_infer, train=cudnn_fwd, priority=PRIORITY_VENDOR, dtypes=half, max_head_dim=128, min_cc=(8, 0), features=BASE_FEATURES,
                   check=_cudnn_rule, rank=_cudnn_rank, memory=MEMORY_FLASH, description="cuDNN fused attention through aten (native GQA)"),
        KernelImpl(id="cuda.sdpa.flash", op="flash_attention", backend="cuda", fn=flash_fwd, backward=flash_bwd,
                   priority=PRIORITY_VENDOR - 10, dtypes=half, max_head_dim=256, min_cc=(8, 0),
                   features=BASE_FEATURES, check=_mult8, memory=MEMORY_FLASH,
                   description="PyTorch's FlashAttention-2 through aten (native GQA)"),
        KernelImpl(id="cuda.sdpa.efficient", op="flash_attention", backend="cuda", fn=efficient_fwd,
                   backward=efficient_bwd, priority=PRIORITY_VENDOR - 20,
                   dtypes=(torch.float16, torch.bfloat16, torch.float32), min_cc=(5, 0),
                   features=BASE_FEATURES | MASK_FEATURES, check=_mult8,
                   memory=MemoryTraits("flash", expands_kv=True),     # GQA: K/V repeated to the query heads
                   description="memory-efficient attention (xformers/cutlass) through aten; bool/additive masks"),
        KernelImpl(id="cuda.sdpa.flash_varlen", op="sparse_attention", backend="cuda", fn=flash_varlen_fwd,
                   backward=flash_varlen_bwd, priority=PRIORITY_VENDOR, dtypes=half, max_head_dim=256, min_cc=(8, 0),
                   features=VARLEN_FEATURES, check=_varlen_rule, memory=MEMORY_FLASH,
                   description="PyTorch's FlashAttention-2 varlen kernel through aten: packed batches with an "
                               "all-True block mask (plain varlen layouts), causal or not, native GQA"),
    ]
