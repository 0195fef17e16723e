"""varlen_attention through torch_npu.npu_fusion_attention in its varlen layout TND (Atlas A2/A3/950).

Written from the torch_npu API reference (not run on an NPU):
- npu_fusion_attention: github.com/Ascend/op-plugin, docs/context/torch_npu-npu_fusion_attention.md (the same text:
  https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000850.html).  It documents TND
  as "the varlen scenario": q (T_q, N, D), k / v (T_kv, N_kv, D) packed, actual_seq_qlen / actual_seq_kvlen the
  cumulative lengths per sequence (host int lists), each sequence's queries attending only its own keys.
- npu_fused_infer_attention_score is not used: its TND layouts come with their own constraint set (see
  paged_attention.py, which found TND there tied to MLA), while npu_fusion_attention's varlen is the documented,
  general one, and it already serves sparse_attention's packed batches here (attention.py).

Mapping:
- cu_seqlens_q / cu_seqlens_k read on the host once (the op takes int lists): one device-to-host read per call;
  actual_seq_qlen / actual_seq_kvlen = the cumulative lengths without the leading 0.
- causal (bottom-right, per sequence) = sparse_mode 3 (rightDownCausal) with the compressed 2048 x 2048 mask; the docs
  align it per sequence in varlen (their sparse_mode 7 example splits a sparse_mode 3 varlen batch with Sq != Skv).
- rows that see no key are never sent: the docs forbid mask rows with every key masked in varlen ("atten_mask 输入不支持
  补pad") and say nothing of sequences with no keys.  So a sequence with no keys is dropped from the call, and a causal
  sequence with more queries n than keys L sends only its last L queries (a square causal block); the rows left out
  get out 0 and lse -inf (the op contract).  Sequences with no queries but keys stay (documented: S = 0 allowed in
  actual_seq_qlen).  When every row is sent, q goes in as is (no gather).
- GQA native (head_num = query heads, Nq / Nkv an integer); `scale` always passed (the op's default is 1.0).
- lse from softmax_max / softmax_sum through attention.lse_from_softmax_stats (the one place that knows their shape).
- documented limits refused at call time with reasons (NoKernelError): varlen batch (the length of actual_seq_qlen)
  up to 1K, T up to 1M tokens, Nq up to 256; dtypes float16 / bfloat16 (as the backend's flash_attention declares).
- forward only, as the op (varlen_attention has no backward).  The docs file npu_fusion_attention under training
  ("该接口仅在训练场景下使用"); its forward is the computation wanted here."""
from __future__ import annotations

import torch

from opsadv.core.errors import NoKernelError
from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_VENDOR, KernelImpl

from . import _npu
from .attention import SPARSE_MODE_CAUSAL_BR, SPARSE_MODE_MASK, _check as _soc_check, compressed_causal_mask, \
    lse_from_softmax_stats

OP = "varlen_attention"
IMPL_ID = "ascend.npu_fusion_attention.varlen"
MAX_BATCH = 1024                    # varlen: actual_seq_qlen holds at most 1K entries
MAX_TOKENS = 1 << 20                # varlen: T in 1..1M
MAX_HEADS = 256                     # Nq in 1..256


def _reject(reasons: list[str]):
    raise NoKernelError(OP, "backend='ascend'", {IMPL_ID: reasons}, " (limits that depend on the call's values)")


def plan_rows(nq: list[int], nk: list[int], causal: bool) -> tuple[list[int], list[int]]:
    """Per sequence: the first query row sent (rows before it see no key) and whether the sequence is sent at all
    (1) or dropped (0: no keys)."""
    first, sent = [], []
    for n, length in zip(nq, nk):
        if length == 0:
            first.append(n)
            sent.append(0)
        else:
            first.append(max(0, n - length) if causal else 0)
            sent.append(1)
    return first, sent


def call_reasons(batch: int, total_q: int, total_k: int, hq: int) -> list[str]:
    why = []
    if batch > MAX_BATCH:
        why.append(f"{batch} sequences > {MAX_BATCH} (npu_fusion_attention's varlen batch: actual_seq_qlen holds at "
                   "most 1K entries)")
    for side, t in (("query", total_q), ("key", total_k)):
        if t > MAX_TOKENS:
            why.append(f"{t} packed {side} tokens > {MAX_TOKENS} (varlen T in 1..1M)")
    if hq > MAX_HEADS:
        why.append(f"{hq} query heads > {MAX_HEADS}")
    return why


def varlen_fwd(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    total_q, hq, d = q.shape
    dev = q.device
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    nq = [b - a for a, b in zip(cq, cq[1:])]
    nk = [b - a for a, b in zip(ck, ck[1:])]
    first, sent = plan_rows(nq, nk, causal)
    seqs = [b for b, s in enumerate(sent) if s]
    counts = [nq[b] - first[b] for b in seqs]
    rows_sent = sum(counts)
    if rows_sent:
        why = call_reasons(len(seqs), rows_sent, k.shape[0], hq)
        if why:
            _reject(why)
        every = rows_sent == total_q
        if every:
            qs = q.contiguous()
            rows = None
        else:                           # the rows that see a key, in order
            rows = torch.cat([torch.arange(cq[b] + first[b], cq[b + 1]) for b in seqs]).to(dev)
            qs = q.index_select(0, rows)
        qlen, kvlen, a, c = [], [], 0, 0
        for b, n in zip(seqs, counts):
            a += n
            c += nk[b]
            qlen.append(a)
            kvlen.append(c)
        kw = dict(actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, sparse_mode=SPARSE_MODE_MASK)
        if causal:
            kw.update(atten_mask=compressed_causal_mask(dev), sparse_mode=SPARSE_MODE_CAUSAL_BR)
        res = _npu.torch_npu().npu_fusion_attention(qs, k.contiguous(), v.contiguous(), hq, "TND",
                                                    scale=float(scale), keep_prob=1.0, **kw)
        o = res[0]
        ls = lse_from_softmax_stats(res[1], res[2], "TND")[0].transpose(0, 1)      # (1, N, T) -> (T, N)
        if every:
            return o.contiguous(), ls.contiguous()
        return (q.new_zeros(q.shape).index_copy_(0, rows, o.to(q.dtype)),
                torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=dev).index_copy_(0, rows, ls))
    return q.new_zeros(q.shape), torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=dev)


def impls(soc) -> list[KernelImpl]:
    return [KernelImpl(
        id=IMPL_ID, op=OP, backend="ascend", fn=varlen_fwd, priority=PRIORITY_VENDOR,
        device_types=_npu.device_types(), dtypes=(torch.float16, torch.bfloat16), max_head_dim=256,
        features=frozenset({"causal", "gqa"}), check=_soc_check(soc), memory=MEMORY_FLASH,
        description="npu_fusion_attention, TND with cumulative actual_seq_qlen / actual_seq_kvlen, causal sparse_mode 3 "
                    "(bottom-right per sequence); rows that see no key are not sent (out 0, lse -inf)")]
