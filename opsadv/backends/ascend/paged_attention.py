"""paged_attention through torch_npu.npu_fused_infer_attention_score with its PageAttention arguments (Atlas A2/A3).

Written from the torch_npu API reference (not run on an NPU):
- npu_fused_infer_attention_score: https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_001232.html
  (the same text: github.com/Ascend/op-plugin, docs/context/torch_npu-npu_fused_infer_attention_score.md);
- npu_scatter_nd_update_: github.com/Ascend/op-plugin, docs/context/torch_npu-npu_scatter_nd_update_.md;
- npu_incre_flash_attention (docs/context/torch_npu-npu_incre_flash_attention.md) is not used: it returns no lse.

Mapping:
- the cache (num_pages, page_size, Hkv, D) goes in as the documented (blocknum, blocksize, H) layout, a free view
  (H = Hkv * D must stay below 64k for that layout); block_table as is (int32, (B, >= the pages a sequence uses));
  block_size = page_size; actual_seq_lengths_kv = seqlens_k as a host list (the op takes SymInt[]: one
  device-to-host read of seqlens_k, and of cu_seqlens_q, per call).
- q in layout BSND: a fixed (B, s_q, Hq, D) q as is; a packed (total_q, Hq, D) q is scattered into
  (B, max count, Hq, D) with actual_seq_lengths = each sequence's query count (per batch, not cumulative), and the
  rows gathered back: TND does not combine with PageAttention (the docs allow it only for MLA with D = 512).
- Q_S = 1 (decode) runs the op's IncreFlashAttention branch: block_size a multiple of 16 (fp16 / bf16 caches);
  sparse_mode is ignored there, and a single query sees all its keys under bottom-right causal anyway.
- Q_S > 1 (chunked prefill, speculative decoding) runs the PromptFlashAttention branch: block_size in 128..512,
  a multiple of 128, and D a multiple of 16; causal = sparse_mode 3 (bottom-right, aligned per batch at
  actual_seq_lengths / actual_seq_lengths_kv) with the compressed 2048 x 2048 mask.  Those limits depend on the
  query count, which the dispatch key does not hold, so they are refused at call time (NoKernelError with reasons).
- num_heads = Hq, num_key_value_heads = Hkv (GQA native, Hq / Hkv <= 64); `scale` always passed (default 1.0).
- lse: softmax_lse_flag=True gives (B, N, Q_S, 1) float32.
- rows that see no key (seqlens_k 0, or causal rows when a sequence has more queries than keys) are not specified
  by the docs: they are set to 0 / lse -inf here.  The docs require blocknum >= the sum of the pages every
  sequence uses, so block tables that share pages between sequences (a shared prompt) may undercount: refused.
- k_new / v_new: npu_scatter_nd_update_ into the cache viewed as (num_pages, page_size, Hkv, D) with indices
  (T, 2) = (page, slot) of each new token, before the attention call reads the cache."""
from __future__ import annotations

import torch

from opsadv.core.errors import InvalidArgumentError, NoKernelError
from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_VENDOR, KernelImpl

from . import _npu
from .attention import FULL, SPARSE_MODE_CAUSAL_BR, compressed_causal_mask

OP = "paged_attention"
IMPL_ID = "ascend.npu_fused_infer_attention_score.paged"
MAX_HEAD_DIM = 512                  # both branches: D <= 512
MAX_GROUP = 64                      # num_heads / num_key_value_heads <= 64
MAX_HEADS = 256                     # N <= 256
MAX_BATCH = 65536
MAX_KV_HIDDEN = 65535               # (blocknum, blocksize, H) layout: H = Hkv * D below 64k
DECODE_PAGE_ALIGN = 16              # IncreFlashAttention branch, fp16 / bf16 caches
PREFILL_PAGES = (128, 512)          # PromptFlashAttention branch: 128..512, a multiple of 128
PREFILL_D_ALIGN = 16


def _reject(reasons: list[str]):
    raise NoKernelError(OP, "backend='ascend'", {IMPL_ID: reasons}, " (limits that depend on the call's values)")


def call_reasons(k_cache, hq: int, batch: int, s_max: int, lens: list[int]) -> list[str]:
    """The documented limits that the dispatch key does not decide (query count per sequence, exact head counts,
    the pages the sequences use)."""
    npages, ps, hkv, d = k_cache.shape
    why = []
    if s_max > 1:
        lo, hi = PREFILL_PAGES
        if not (lo <= ps <= hi and ps % lo == 0):
            why.append(f"page_size {ps}: with more than one query per sequence (the op's PromptFlashAttention "
                       f"branch) PageAttention needs block_size in {lo}..{hi}, a multiple of {lo}")
        if d % PREFILL_D_ALIGN:
            why.append(f"head_dim {d}: with more than one query per sequence float16 / bfloat16 need D a multiple "
                       f"of {PREFILL_D_ALIGN}")
    if hkv * d > MAX_KV_HIDDEN:
        why.append(f"Hkv x D = {hkv * d} > {MAX_KV_HIDDEN}: the (blocknum, blocksize, H) cache layout's limit")
    if hq > MAX_HEADS:
        why.append(f"{hq} query heads > {MAX_HEADS}")
    if batch > MAX_BATCH:
        why.append(f"batch {batch} > {MAX_BATCH}")
    used = sum(-(-n // ps) for n in lens)
    if used > npages:
        why.append(f"the sequences use {used} pages in all, more than the cache's {npages} (the op requires "
                   "blocknum >= the sum of every sequence's pages: block tables sharing pages are not mapped)")
    if not (k_cache.is_contiguous()):
        why.append("a non-contiguous cache (the op reads (blocknum, blocksize, H) in place)")
    return why


def _append(npu, k_cache, v_cache, block_table, lens, counts, k_new, v_new):
    """k_new / v_new rows (q's order) scattered in place to (page, slot) of positions lens[b] - n_b .. lens[b] - 1."""
    npages, ps, hkv, d = k_cache.shape
    for b, (n, length) in enumerate(zip(counts, lens)):
        if length < n:          # (CPU calls were checked by the op; this read is here anyway)
            raise InvalidArgumentError(OP, "seqlens_k", f"seqlens_k[{b}] >= the {n} tokens appended to sequence {b} "
                                       "(seqlens_k counts the tokens after appending)", f"seqlens_k[{b}] = {length}")
    total = sum(counts)
    if not total:
        return
    bidx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    pos = torch.cat([torch.arange(length - n, length) for n, length in zip(counts, lens)])
    dev = block_table.device
    pages = block_table[bidx.to(dev), (pos // ps).to(dev)]
    idx = torch.stack([pages.to(torch.int32), (pos % ps).to(device=dev, dtype=torch.int32)], -1)
    npu.npu_scatter_nd_update_(k_cache, idx, k_new.reshape(total, hkv, d))
    npu.npu_scatter_nd_update_(v_cache, idx, v_new.reshape(total, hkv, d))


def paged_fwd(ctx, q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal, scale,
              k_scale=None, v_scale=None):
    # k_scale / v_scale belong to fp8 caches, which this impl does not declare (fp8_kv): never given here
    npu = _npu.torch_npu()
    npages, ps, hkv, d = k_cache.shape
    hq = q.shape[-2]
    batch = block_table.shape[0]
    dev = q.device
    lens = [int(x) for x in seqlens_k.tolist()]
    packed = cu_seqlens_q is not None
    if packed:
        cu = [int(x) for x in cu_seqlens_q.tolist()]
        counts = [e - s for s, e in zip(cu, cu[1:])]
    else:
        counts = [q.shape[1]] * batch
    s_max = max(counts, default=0)
    why = call_reasons(k_cache, hq, batch, s_max, lens)
    if why:
        _reject(why)
    if k_new is not None:
        _append(npu, k_cache, v_cache, block_table, lens, counts, k_new, v_new)
    if packed:                          # rows of sequence b -> (b, 0 .. n_b - 1) of a zero-padded BSND batch
        bidx = torch.repeat_interleave(torch.arange(batch), torch.tensor(counts)).to(dev)
        offs = torch.cat([torch.arange(n) for n in counts]).to(dev)
        qb = q.new_zeros((batch, s_max, hq, d))
        qb[bidx, offs] = q
    else:
        qb = q.contiguous()
    kw = dict(block_table=block_table, block_size=ps, actual_seq_lengths_kv=lens, num_heads=hq,
              num_key_value_heads=hkv, input_layout="BSND", scale=float(scale), softmax_lse_flag=True)
    if s_max > 1:
        kw["actual_seq_lengths"] = counts
        if causal:
            kw.update(atten_mask=compressed_causal_mask(dev), sparse_mode=SPARSE_MODE_CAUSAL_BR, pre_tokens=FULL,
                      next_tokens=FULL)
    out, lse = npu.npu_fused_infer_attention_score(qb, k_cache.view(npages, ps, hkv * d),
                                                   v_cache.view(npages, ps, hkv * d), **kw)[:2]
    lse = lse[..., 0].float().transpose(1, 2)                    # (B, N, Q_S, 1) -> (B, Q_S, N)
    # rows with no key: sequences with no cached token; causal rows i < n_b - L_b (more queries than keys)
    dead = [[length == 0 or (causal and i < n - length) for i in range(s_max)] for n, length in zip(counts, lens)]
    if any(any(r) for r in dead):
        dm = torch.tensor(dead, device=dev)
        out = out.masked_fill(dm[..., None, None], 0)
        lse = lse.masked_fill(dm[..., None], float("-inf"))
    if packed:
        return out[bidx, offs].contiguous(), lse[bidx, offs].contiguous()
    return out.contiguous(), lse.contiguous()


def _check(soc):
    def check(spec, env) -> list[str]:
        why = []
        if not soc.infer_attention:
            why.append(f"npu_fused_infer_attention_score needs Atlas A2/A3; this NPU is {soc.description} "
                       f"(SoC {soc.code})")
        ps = spec.shapes[1][1] if len(spec.shapes) >= 2 else None        # k_cache (num_pages, page_size, Hkv, D)
        if ps is not None and ps % DECODE_PAGE_ALIGN:
            why.append(f"page_size {ps}: PageAttention needs block_size a multiple of {DECODE_PAGE_ALIGN} for "
                       f"float16 / bfloat16 caches (and 128..512, a multiple of 128, with more than one query per "
                       "sequence)")
        if spec.shapes and len(spec.shapes) >= 2:
            hq, hkv = spec.shapes[0][-2], spec.shapes[1][2]
            if hkv and hq // hkv > MAX_GROUP:
                why.append(f"{hq} query heads per {hkv} kv heads: num_heads / num_key_value_heads > {MAX_GROUP}")
        return why
    return check


def impls(soc) -> list[KernelImpl]:
    return [KernelImpl(
        id=IMPL_ID, op=OP, backend="ascend", fn=paged_fwd, priority=PRIORITY_VENDOR,
        device_types=_npu.device_types(), dtypes=(torch.float16, torch.bfloat16), max_head_dim=MAX_HEAD_DIM,
        features=frozenset({"causal", "gqa", "varlen", "append"}), check=_check(soc), memory=MEMORY_FLASH,
        description="npu_fused_infer_attention_score with block_table / block_size (cache as (blocknum, blocksize, "
                    "H), q BSND, packed q padded per sequence), causal sparse_mode 3 with more than one query per "
                    "sequence, softmax_lse_flag; k_new / v_new by npu_scatter_nd_update_")]
