"""An in-process test double for torch_npu: the documented semantics of the ops opsadv's ascend
backend calls, computed with plain torch on CPU tensors, and a record of every call.

It is what the contract tests run the backend against when no NPU is present.  It follows the
torch_npu documentation, not the hardware's numerics:
- npu_fusion_attention: `scale` defaults to 1.0; atten_mask True = masked out; layouts BNSD, BSND,
  BSH, SBH and TND (the varlen layout: actual_seq_qlen/kvlen are cumulative lengths, at most 1K sequences and
  1M tokens, a sequence may have no queries but queries need keys); GQA by head_num = query heads;
  sparse_mode 0 (mask as given, plus the pre/next band, top-left origin, when a mask is given),
  1 (full mask), 2/3 (causal top-left / bottom-right) and 4 (band, bottom-right origin), the last
  three requiring the compressed 2048x2048 upper-triangular mask; with atten_mask=None the op
  computes full attention whatever sparse_mode says.  Returns (out, softmax_max, softmax_sum,
  softmax_out, seed, offset, numels) with softmax_max/sum (B, N, S_q, 8) float32 ((T, N, 8) for
  TND), each row's value replicated over the last dim.  A row with every key masked is not
  specified by the docs: the double returns NaN there, so a caller must handle such rows itself.
- npu_fused_infer_attention_score: the same masking (spelled pre_tokens/next_tokens), GQA by
  num_key_value_heads, softmax_lse (B, N, S_q, 1) when softmax_lse_flag=True.
- npu_fused_infer_attention_score with block_table (PageAttention): _paged_infer's docstring;
  npu_scatter_nd_update_: in-place scatter of rows by (..., a) indices.
- npu_fusion_attention_grad: recomputes p = exp(s - softmax_max) / softmax_sum from the given
  statistics and uses attention_in for the softmax backward; dk/dv summed over a GQA group.
- npu_rms_norm / npu_rms_norm_backward / npu_add_rms_norm / npu_gelu / npu_swiglu, and
  npu.get_soc_version / get_device_name / is_available / set_aoe.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

FULL = 2147483647
LAYOUTS = ("BNSD", "BSND", "BSH", "SBH", "TND")


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict[str, Any]


@dataclass
class FakeNPU:
    """Configuration and call log of one double instance."""
    soc_version: int = 220
    device_name: str = "Ascend910B3"
    available: bool = True
    calls: list[Call] = field(default_factory=list)
    aoe_dump_paths: list[str] = field(default_factory=list)

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]


# ---- attention semantics ---------------------------------------------------------------------------
def _to_bnsd(t, layout, heads):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)
    raise ValueError(layout)


def _from_bnsd(t, layout):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)   # SBH


def _kv_heads(t, layout, q_heads, q_t):
    """Number of kv heads: explicit in BNSD/BSND/TND; from the hidden size in BSH/SBH."""
    if layout in ("BNSD",):
        return t.shape[1]
    if layout in ("BSND", "TND"):
        return t.shape[-2]
    d = q_t.shape[-1] // q_heads
    return t.shape[-1] // d


def _is_compressed(mask) -> bool:
    return (mask is not None and mask.dim() == 2 and tuple(mask.shape) == (2048, 2048)
            and bool(torch.equal(mask.bool().cpu(), torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))))


def _masked_out(sparse_mode, atten_mask, sq, sk, pre, nxt, device, batch_index=None):
    """bool (..., sq, sk), True = masked out, or None for none."""
    if atten_mask is None:
        return None                                   # documented: full attention whatever sparse_mode
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    if sparse_mode in (2, 3, 4):
        if not _is_compressed(atten_mask):
            raise RuntimeError(f"sparse_mode {sparse_mode} needs the compressed 2048x2048 triu mask, got "
                               f"{tuple(atten_mask.shape)}")
        if sparse_mode == 2:
            return j > i
        ip = i + (sk - sq)                            # bottom-right origin
        if sparse_mode == 3:
            return j > ip
        return (j > ip + nxt) | (j < ip - pre)
    if sparse_mode not in (0, 1):
        raise NotImplementedError(f"the double does not model sparse_mode {sparse_mode}")
    m = atten_mask.bool()
    if m.dim() == 4 and batch_index is not None:
        m = m[batch_index if m.shape[0] > 1 else 0]
    if tuple(m.shape[-2:]) != (sq, sk):
        raise RuntimeError(f"atten_mask must end in (S_q, S_kv) = {(sq, sk)}, got {tuple(m.shape)}")
    if sparse_mode == 0:                              # plus the pre/next band, top-left origin
        m = m | (j > i + nxt) | (j < i - pre)
    return m


def _scores(q, k, scale, masked):
    """q (N, sq, d), k (N2, sk, d) -> float64 scores (N, sq, sk) with -inf where masked."""
    rep = q.shape[0] // k.shape[0]
    s = (q.double() @ k.double().repeat_interleave(rep, 0).transpose(-1, -2)) * scale
    return s if masked is None else s.masked_fill(masked, float("-inf"))


def _tnd_bounds(q, k, qlen, kvlen):
    """Cumulative lengths -> segment bounds, checked as the docs describe them."""
    if qlen is None or kvlen is None:
        raise RuntimeError("TND needs actual_seq_qlen and actual_seq_kvlen")
    qs, ks = [0, *[int(x) for x in qlen]], [0, *[int(x) for x in kvlen]]
    if len(qs) != len(ks):
        raise RuntimeError("actual_seq_qlen and actual_seq_kvlen must have one entry per sequence")
    if any(b < a for a, b in zip(qs, qs[1:])) or any(b < a for a, b in zip(ks, ks[1:])):
        raise RuntimeError("actual_seq_qlen/kvlen are cumulative (non-decreasing) lengths, e.g. [2, 4, 6]")
    if qs[-1] != q.shape[0] or ks[-1] != k.shape[0]:
        raise RuntimeError(f"cumulative lengths end at {qs[-1]}/{ks[-1]}, tensors have {q.shape[0]}/{k.shape[0]} tokens")
    if len(qs) - 1 > 1024:
        raise RuntimeError(f"varlen: actual_seq_qlen has {len(qs) - 1} entries (at most 1K)")
    if max(qs[-1], ks[-1]) > 1 << 20:
        raise RuntimeError(f"varlen: T {max(qs[-1], ks[-1])} > 1M")
    for n, (a, b, c, e) in enumerate(zip(qs, qs[1:], ks, ks[1:])):
        if b > a and e == c:                          # documented: S = 0 for queries, not keys under queries
            raise RuntimeError(f"varlen sequence {n} has {b - a} queries and no keys (not documented)")
    return qs, ks


def _int_list(name, xs, batch):
    """A documented SymInt[] length argument: plain ints, length 1 (every batch) or >= batch (the first batch)."""
    if isinstance(xs, torch.Tensor) or not all(isinstance(x, int) for x in xs):
        raise TypeError(f"{name} is an int list (SymInt[]), got {type(xs).__name__}")
    xs = list(xs)
    if len(xs) == 1:
        return xs * batch
    if len(xs) < batch:
        raise RuntimeError(f"{name} has {len(xs)} entries for batch {batch} (1 or >= batch)")
    if any(x < 0 for x in xs):
        raise RuntimeError(f"{name} must not be negative: {xs}")
    return xs[:batch]


def _paged_infer(query, key, value, block_table, block_size, qlens, kvlens, num_heads, num_kv, scale, layout,
                 sparse_mode, atten_mask, lse_flag):
    """npu_fused_infer_attention_score with PageAttention, as its reference documents it (float64 here):
    - key / value: the cache as (blocknum, blocksize, H) (any of BSH/BSND/BNSD queries) or (blocknum, KV_N,
      blocksize, D) (BNSD queries only), contiguous, same shape; block_table int32 (B, >= max pages per sequence);
      actual_seq_lengths_kv required (key lengths per batch); blocknum >= the sum of the pages the batches use;
    - Q_S = 1 (IncreFlashAttention branch): block_size a multiple of 16 (fp16 / bf16); sparse_mode, the mask and
      actual_seq_lengths are ignored: the query sees its L keys;
    - Q_S > 1 (PromptFlashAttention branch): block_size in 128..512, a multiple of 128; D a multiple of 16;
      actual_seq_lengths (per batch, <= Q_S; default Q_S) are the valid leading query rows; sparse_mode 0 without
      a mask (all L keys) or 3 (bottom-right causal aligned per batch: row i sees j <= i + L - n) with the
      compressed 2048 x 2048 mask;
    - out has query's layout; softmax_lse (B, N, Q_S, 1) float32 with softmax_lse_flag, else a [1] zero tensor.
    Rows the docs leave unspecified (padding rows past actual_seq_lengths, rows that see no key) come back NaN."""
    if layout not in ("BSH", "BSND", "BNSD"):
        raise NotImplementedError(f"the double models PageAttention with BSH/BSND/BNSD queries, got {layout!r}")
    if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        raise RuntimeError(f"PageAttention takes float16/bfloat16 query, key, value of one dtype, got "
                           f"{query.dtype}/{key.dtype}/{value.dtype}")
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        raise RuntimeError("query, key and value must be contiguous")
    if tuple(key.shape) != tuple(value.shape):
        raise RuntimeError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise RuntimeError(f"block_table must be 2-D int32, got {block_table.dim()}-D {block_table.dtype}")
    qb = _to_bnsd(query, layout, num_heads)
    b, n, q_s, d = qb.shape
    if n != num_heads:
        raise RuntimeError(f"num_heads {num_heads} does not match the query's {n} heads")
    n2 = num_kv or num_heads
    if num_heads % n2 or num_heads // n2 > 64:
        raise RuntimeError(f"num_heads {num_heads} must be a multiple of num_key_value_heads {n2}, ratio <= 64")
    if d > 512:
        raise RuntimeError(f"D {d} > 512")
    if key.dim() == 3:
        blocknum, bs, h = key.shape
        if h != n2 * d:
            raise RuntimeError(f"cache H {h} != num_key_value_heads {n2} x D {d}")
        if h > 65535:
            raise RuntimeError(f"cache (blocknum, blocksize, H) with H {h} >= 64k")
        kc, vc = key.view(blocknum, bs, n2, d), value.view(blocknum, bs, n2, d)
    elif key.dim() == 4:
        if layout != "BNSD":
            raise RuntimeError("a (blocknum, KV_N, blocksize, D) cache needs BNSD queries")
        blocknum, kvn, bs, dk = key.shape
        if kvn != n2 or dk != d:
            raise RuntimeError(f"cache {tuple(key.shape)} does not match num_key_value_heads {n2} / D {d}")
        kc, vc = key.transpose(1, 2), value.transpose(1, 2)
    else:
        raise RuntimeError(f"a paged key is 3-D or 4-D, got {key.dim()}-D")
    if bs != block_size:
        raise RuntimeError(f"block_size {block_size} != the cache's block dim {bs}")
    if q_s == 1:
        if block_size % 16:
            raise RuntimeError(f"block_size {block_size}: a multiple of 16 for float16/bfloat16 (Q_S = 1)")
    else:
        if not (128 <= block_size <= 512 and block_size % 128 == 0):
            raise RuntimeError(f"block_size {block_size}: 128..512, a multiple of 128 (Q_S > 1)")
        if d % 16:
            raise RuntimeError(f"D {d}: a multiple of 16 for float16/bfloat16 (Q_S > 1)")
    if block_table.shape[0] != b:
        raise RuntimeError(f"block_table has {block_table.shape[0]} rows for batch {b}")
    if kvlens is None:
        raise RuntimeError("PageAttention needs actual_seq_lengths_kv")
    lens = _int_list("actual_seq_lengths_kv", kvlens, b)
    need = [-(-x // bs) for x in lens]
    if block_table.shape[1] < max(need, default=0):
        raise RuntimeError(f"block_table has {block_table.shape[1]} columns, a batch needs {max(need)}")
    if blocknum < sum(need):
        raise RuntimeError(f"blocknum {blocknum} < the {sum(need)} blocks actual_seq_lengths_kv needs in all")
    if q_s == 1:
        nq, causal = [1] * b, False                   # sparse_mode / mask / actual_seq_lengths are ignored
    else:
        nq = [q_s] * b if qlens is None else _int_list("actual_seq_lengths", qlens, b)
        if any(x > q_s for x in nq):
            raise RuntimeError(f"actual_seq_lengths {nq} exceed Q_S {q_s}")
        if sparse_mode == 3:
            if not _is_compressed(atten_mask):
                raise RuntimeError("sparse_mode 3 needs the compressed 2048x2048 triu mask")
            causal = True
        elif sparse_mode == 0 and atten_mask is None:
            causal = False
        else:
            raise NotImplementedError(f"the double models PageAttention with sparse_mode 0 (no mask) or 3, got "
                                      f"{sparse_mode}")
    out = torch.full((b, n, q_s, d), float("nan"), dtype=torch.float64)
    lse = torch.full((b, n, q_s), float("nan"), dtype=torch.float64)
    table = block_table.cpu().long()
    for bi in range(b):
        pages = table[bi, :need[bi]]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= blocknum):
            raise RuntimeError(f"block_table[{bi}] reads block {pages.tolist()} outside [0, {blocknum})")
        length, rows = lens[bi], nq[bi]
        k = kc[pages].reshape(-1, n2, d)[:length].transpose(0, 1)     # (N2, L, D)
        v = vc[pages].reshape(-1, n2, d)[:length].transpose(0, 1)
        i = torch.arange(rows)[:, None]
        j = torch.arange(length)[None, :]
        s = _scores(qb[bi, :, :rows], k, scale, (j > i + length - rows) if causal else None)
        m = torch.logsumexp(s, -1)                                      # -inf where no key is visible
        p = torch.exp(s - m[..., None])
        o = p @ v.double().repeat_interleave(num_heads // n2, 0)
        dead = torch.isneginf(m)                                        # unspecified: NaN
        out[bi, :, :rows] = o.masked_fill(dead[..., None], float("nan"))
        lse[bi, :, :rows] = m.masked_fill(dead, float("nan"))
    res = _from_bnsd(out.to(query.dtype), layout).contiguous()
    return res, (lse[..., None].float() if lse_flag else torch.zeros(1, dtype=torch.float32))


def _scatter_nd_update(input, indices, updates):
    """input[indices[..., 0], ..., indices[..., a - 1]] = updates, in place (npu_scatter_nd_update_'s contract:
    indices int32/int64, >= 2-D, last dim a <= input.dim(); updates shape indices.shape[:-1] + input.shape[a:],
    input's dtype; indices must be in range)."""
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() < 2:
        raise RuntimeError(f"indices must be int32/int64 with >= 2 dims, got {indices.dim()}-D {indices.dtype}")
    if input.dtype not in (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8):
        raise RuntimeError(f"input dtype {input.dtype} not supported")
    a = indices.shape[-1]
    if a > input.dim():
        raise RuntimeError(f"indices' last dim {a} > input's {input.dim()} dims")
    want = (*indices.shape[:-1], *input.shape[a:])
    if tuple(updates.shape) != want or updates.dtype != input.dtype:
        raise RuntimeError(f"updates must be {want} {input.dtype}, got {tuple(updates.shape)} {updates.dtype}")
    flat = indices.reshape(-1, a).long().cpu()
    for c in range(a):
        if flat.numel() and (int(flat[:, c].min()) < 0 or int(flat[:, c].max()) >= input.shape[c]):
            raise RuntimeError(f"indices column {c} out of range [0, {input.shape[c]})")
    input[tuple(flat.T.to(input.device))] = updates.reshape(-1, *input.shape[a:])
    return input


class _Double:
    def __init__(self, state: FakeNPU):
        self.state = state

    def _log(self, name, args, kwargs):
        self.state.calls.append(Call(name, args, dict(kwargs)))

    # npu_fusion_attention --------------------------------------------------------------------------
    def npu_fusion_attention(self, query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1., keep_prob=1., pre_tockens=FULL, next_tockens=FULL,
                             inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                             sparse_mode=0, gen_mask_parallel=True, sync=False):
        kw = dict(head_num=head_num, input_layout=input_layout, pse=pse, atten_mask=atten_mask, scale=scale,
                  keep_prob=keep_prob, pre_tockens=pre_tockens, next_tockens=next_tockens,
                  actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode)
        self._log("npu_fusion_attention", (query, key, value), kw)
        self._check(query, key, value, input_layout, pse, keep_prob, self.state.soc_version)
        out = torch.full_like(query, float("nan"))   # poisoned: every row must be written
        per_row = []
        for idx, q, k, v, put in self._split(query, key, value, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen):
            masked = _masked_out(sparse_mode, atten_mask, q.shape[1], k.shape[1], pre_tockens, next_tockens,
                                 q.device, idx if input_layout != "TND" else None)
            s = _scores(q, k, scale, masked)
            mx = (s.amax(-1, keepdim=True) if s.shape[-1] else      # -inf on fully masked rows -> NaN below
                  s.new_full((*s.shape[:-1], 1), float("-inf")))      # (unspecified by the docs)
            e = torch.exp(s - mx)
            sm = e.sum(-1, keepdim=True)
            rep = q.shape[0] // k.shape[0]
            o = (e / sm) @ v.double().repeat_interleave(rep, 0)
            put(out, o.to(query.dtype))
            per_row.append((mx[..., 0].float(), sm[..., 0].float()))   # (N, sq) each
        smax, ssum = self._stats(per_row, input_layout, query)
        return out, smax, ssum, query.new_empty((0,)), 0, 0, 0

    def npu_fusion_attention_grad(self, query, key, value, dy, head_num, input_layout, *, pse=None,
                                  padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None,
                                  softmax_in=None, attention_in=None, scale_value=1., keep_prob=1.,
                                  pre_tockens=FULL, next_tockens=FULL, inner_precise=0, seed=0, offset=0,
                                  numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                                  gen_mask_parallel=True, sync=False):
        kw = dict(head_num=head_num, input_layout=input_layout, atten_mask=atten_mask, softmax_max=softmax_max,
                  softmax_sum=softmax_sum, attention_in=attention_in, scale_value=scale_value,
                  pre_tockens=pre_tockens, next_tockens=next_tockens, actual_seq_qlen=actual_seq_qlen,
                  actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode)
        self._log("npu_fusion_attention_grad", (query, key, value, dy), kw)
        self._check(query, key, value, input_layout, pse, keep_prob, self.state.soc_version)
        if softmax_max is None or softmax_sum is None or attention_in is None:
            raise RuntimeError("npu_fusion_attention_grad needs softmax_max, softmax_sum and attention_in")
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (query, key, value))   # poisoned
        rows = self._row_stats(softmax_max, softmax_sum, input_layout, actual_seq_qlen)
        parts = zip(self._split(query, key, value, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen),
                    self._split(dy, key, value, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen),
                    self._split(attention_in, key, value, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen),
                    rows)
        for (idx, q, k, v, put), (_, g, _, _, _), (_, o, _, _, _), (mx, sm) in parts:
            masked = _masked_out(sparse_mode, atten_mask, q.shape[1], k.shape[1], pre_tockens, next_tockens,
                                 q.device, idx if input_layout != "TND" else None)
            if q.shape[1] == 0:                       # an empty packed sequence: nothing attends its keys
                put(dq, q.new_zeros(q.shape), dk, k.new_zeros(k.shape), dv, v.new_zeros(v.shape))
                continue
            s = _scores(q, k, scale_value, masked)
            p = torch.exp(s - mx.double()[..., None]) / sm.double()[..., None]
            rep = q.shape[0] // k.shape[0]
            kf, vf, gd = k.double().repeat_interleave(rep, 0), v.double().repeat_interleave(rep, 0), g.double()
            delta = (gd * o.double()).sum(-1, keepdim=True)
            ds = p * (gd @ vf.transpose(-1, -2) - delta)
            gq = (ds @ kf) * scale_value
            gk = (ds.transpose(-1, -2) @ q.double()) * scale_value
            gv = p.transpose(-1, -2) @ gd
            n2 = k.shape[0]
            gk = gk.reshape(n2, rep, *gk.shape[1:]).sum(1)
            gv = gv.reshape(n2, rep, *gv.shape[1:]).sum(1)
            put(dq, gq.to(query.dtype), dk, gk.to(key.dtype), dv, gv.to(value.dtype))
        return dq, dk, dv, query.new_empty((0,))

    # npu_fused_infer_attention_score (A2/A3 inference) --------------------------------------------
    def npu_fused_infer_attention_score(self, query, key, value, *, pse_shift=None, atten_mask=None,
                                        actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None,
                                        num_heads=1, scale=1.0, pre_tokens=FULL, next_tokens=FULL, input_layout="BSH",
                                        num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                        antiquant_mode=0, softmax_lse_flag=False, **quant_and_more):
        """Same masking semantics as npu_fusion_attention (pre_tokens/next_tokens spelled so here);
        GQA by num_key_value_heads (0 = num_heads); softmax_lse (B, N, S_q, 1) float32 only with
        softmax_lse_flag=True, else a 0-element tensor.  With block_table: PageAttention (_paged_infer)."""
        kw = dict(atten_mask=atten_mask, num_heads=num_heads, scale=scale, pre_tokens=pre_tokens,
                  next_tokens=next_tokens, input_layout=input_layout, num_key_value_heads=num_key_value_heads,
                  sparse_mode=sparse_mode, softmax_lse_flag=softmax_lse_flag, block_table=block_table,
                  block_size=block_size, actual_seq_lengths=actual_seq_lengths,
                  actual_seq_lengths_kv=actual_seq_lengths_kv)
        self._log("npu_fused_infer_attention_score", (query, key, value), kw)
        if any(v is not None for v in quant_and_more.values()) or pse_shift is not None:
            raise NotImplementedError("the double does not model quantized, prefix, rope or pse inputs")
        if self.state.soc_version not in range(220, 226) and self.state.soc_version not in range(250, 257):
            raise RuntimeError(f"npu_fused_infer_attention_score: SoC {self.state.soc_version} is not Atlas A2/A3")
        if block_table is not None:
            return _paged_infer(query, key, value, block_table, block_size, actual_seq_lengths, actual_seq_lengths_kv,
                                num_heads, num_key_value_heads, scale, input_layout, sparse_mode, atten_mask,
                                softmax_lse_flag)
        if actual_seq_lengths is not None or actual_seq_lengths_kv is not None:
            raise NotImplementedError("the double models actual_seq_lengths(_kv) only with PageAttention")
        if input_layout not in ("BNSD", "BSND", "BSH") or query.shape[-1] > 512:
            raise RuntimeError("the double models BNSD/BSND/BSH with head_dim <= 512")
        n2 = num_key_value_heads or num_heads
        if _kv_heads(key, input_layout, num_heads, query) != n2:
            raise RuntimeError(f"num_key_value_heads {n2} does not match key")
        state_calls = len(self.state.calls)
        out, smax, ssum = self.npu_fusion_attention(query, key, value, num_heads, input_layout, atten_mask=atten_mask,
                                                    scale=scale, pre_tockens=pre_tokens, next_tockens=next_tokens,
                                                    sparse_mode=sparse_mode)[:3]
        del self.state.calls[state_calls:]          # record only the op the caller called
        lse = (smax[..., :1] + torch.log(ssum[..., :1])) if softmax_lse_flag else query.new_empty((0,), dtype=torch.float32)
        return out, lse

    def npu_scatter_nd_update_(self, input, indices, updates):
        self._log("npu_scatter_nd_update_", (input, indices.clone(), updates), {})
        return _scatter_nd_update(input, indices, updates)

    # helpers ---------------------------------------------------------------------------------------
    @staticmethod
    def _check(q, k, v, layout, pse, keep_prob, soc):
        if not 220 <= soc <= 260:
            raise RuntimeError(f"npu_fusion_attention is not supported on SoC {soc} (Atlas A2/A3/950 only)")
        if layout not in LAYOUTS:
            raise RuntimeError(f"input_layout must be one of {LAYOUTS}, got {layout!r}")
        for t in (q, k, v):
            if t.dtype not in (torch.float16, torch.bfloat16):
                raise RuntimeError(f"npu_fusion_attention takes float16/bfloat16, got {t.dtype}")
        if pse is not None or keep_prob != 1.0:
            raise NotImplementedError("the double does not model pse or dropout")

    @staticmethod
    def _split(query, key, value, heads, layout, qlen, kvlen):
        """(index, q (N, sq, d), k, v, put) per batch entry (or packed sequence for TND)."""
        if layout == "TND":
            qs, ks = _tnd_bounds(query, key, qlen, kvlen)
            for n in range(len(qs) - 1):
                def put(*pairs, n=n):   # (dst, src) pairs: the first is q-sized, the others kv-sized
                    for i, (dst, src) in enumerate(zip(pairs[0::2], pairs[1::2])):
                        bounds = qs if i == 0 else ks
                        dst[bounds[n]:bounds[n + 1]] = src.transpose(0, 1)
                q, k, v = (t[b[n]:b[n + 1]].transpose(0, 1) for t, b in ((query, qs), (key, ks), (value, ks)))
                if q.shape[0] != heads:
                    raise RuntimeError(f"head_num {heads} does not match the query's {q.shape[0]} heads")
                yield n, q, k, v, put
            return
        if heads != _to_bnsd(query, layout, heads).shape[1]:
            raise RuntimeError(f"head_num {heads} does not match the query's heads")
        qb = _to_bnsd(query, layout, heads)
        n2 = _kv_heads(key, layout, heads, query)
        if heads % n2:
            raise RuntimeError(f"query heads {heads} must be a multiple of kv heads {n2}")
        kb, vb = _to_bnsd(key, layout, n2), _to_bnsd(value, layout, n2)
        for bi in range(qb.shape[0]):
            def put(*pairs, bi=bi):
                for dst, src in zip(pairs[0::2], pairs[1::2]):
                    h = src.shape[0]
                    view = _to_bnsd(dst, layout, h)
                    view[bi] = src
            yield bi, qb[bi], kb[bi], vb[bi], put

    @staticmethod
    def _stats(per_row, layout, query):
        if layout == "TND":   # (T, N, 8)
            mx = torch.cat([m for m, _ in per_row], dim=1).transpose(0, 1) if per_row else query.new_empty((0, 0))
            sm = torch.cat([s for _, s in per_row], dim=1).transpose(0, 1) if per_row else query.new_empty((0, 0))
        else:                 # (B, N, S_q, 8)
            mx = torch.stack([m for m, _ in per_row])
            sm = torch.stack([s for _, s in per_row])
        return (mx.float().unsqueeze(-1).expand(*mx.shape, 8).contiguous(),
                sm.float().unsqueeze(-1).expand(*sm.shape, 8).contiguous())

    @staticmethod
    def _row_stats(smax, ssum, layout, qlen):
        if layout == "TND":
            bounds = [0, *list(qlen)]
            return [(smax[a:b, :, 0].transpose(0, 1), ssum[a:b, :, 0].transpose(0, 1))
                    for a, b in zip(bounds, bounds[1:])]
        return [(smax[bi, :, :, 0], ssum[bi, :, :, 0]) for bi in range(smax.shape[0])]

    # norms and activations -------------------------------------------------------------------------
    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self._log("npu_rms_norm", (x, gamma), dict(epsilon=epsilon))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        self._log("npu_add_rms_norm", (x1, x2, gamma), dict(epsilon=epsilon))
        s = x1.float() + x2.float()
        rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + epsilon)
        return (s * rstd * gamma.float()).to(x1.dtype), rstd, s.to(x1.dtype)

    def npu_rms_norm_backward(self, dy, x, gamma, rstd):
        self._log("npu_rms_norm_backward", (dy, x, gamma, rstd), {})
        xf, g, r = x.float(), dy.float(), rstd.float()
        xhat = xf * r
        dxhat = g * gamma.float()
        dx = r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        dgamma = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dgamma.float()

    def npu_gelu(self, input, *, approximate="none"):
        self._log("npu_gelu", (input,), dict(approximate=approximate))
        return F.gelu(input.float(), approximate=approximate).to(input.dtype)

    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half"):
        """x * r1 + rotate_half(x) * r2 with r1 / r2 broadcast over x (its documented "half" mode)."""
        self._log("npu_rotary_mul", (input, r1, r2), dict(rotary_mode=rotary_mode))
        if rotary_mode != "half":
            raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} not in the double")
        if r1.shape[-1] != input.shape[-1] or r1.dim() != 4 or input.dim() != 4:
            raise RuntimeError("npu_rotary_mul: 4-D input and tables of the head size")
        x = input.float()
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), -1)
        return (x * r1.float() + rot * r2.float()).to(input.dtype)

    def npu_swiglu(self, input, dim=-1):
        self._log("npu_swiglu", (input,), dict(dim=dim))
        a, b = input.float().chunk(2, dim=dim)
        return (F.silu(a) * b).to(input.dtype)


def make_module(state: FakeNPU | None = None) -> types.ModuleType:
    """A module object that stands in for `torch_npu` in sys.modules."""
    state = state or FakeNPU()
    dbl = _Double(state)
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.__version__ = "0.0.0+opsadv.testdouble"
    mod.OPSADV_TEST_DOUBLE = True
    mod.state = state
    for name in ("npu_fusion_attention", "npu_fusion_attention_grad", "npu_fused_infer_attention_score", "npu_rms_norm", "npu_add_rms_norm",
                 "npu_rms_norm_backward", "npu_gelu", "npu_swiglu", "npu_rotary_mul", "npu_scatter_nd_update_"):
        setattr(mod, name, getattr(dbl, name))
    npu = types.SimpleNamespace()

    def get_soc_version():
        state.calls.append(Call("npu.get_soc_version", (), {}))
        return state.soc_version

    def set_aoe(dump_path):
        state.calls.append(Call("npu.set_aoe", (dump_path,), {}))
        state.aoe_dump_paths.append(dump_path)

    npu.get_soc_version = get_soc_version
    npu.get_device_name = lambda *a: state.device_name
    npu.is_available = lambda: state.available
    npu.device_count = lambda: 1 if state.available else 0
    npu.set_aoe = set_aoe
    mod.npu = npu
    return mod


def install(monkeypatch, state: FakeNPU | None = None) -> types.ModuleType:
    """Put the double into sys.modules as torch_npu (undone by monkeypatch)."""
    mod = make_module(state)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod


__all__ = ["FakeNPU", "Call", "make_module", "install"]
