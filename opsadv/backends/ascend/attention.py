"""flash_attention and sparse_attention through torch_npu.npu_fusion_attention (Atlas A2/A3/950).

Mapping onto the NPU op (see docs/backends/ascend.md):
- layout BNSD (TND for packed varlen), head_num = query heads (GQA is native);
- `scale` is always passed: the op's default is 1.0, not 1/sqrt(d);
- mask polarity: the NPU's atten_mask is True = masked out; opsadv's bool mask is True = attend;
- causal: sparse_mode 3 (bottom-right, as opsadv's contract; for s_q == s_k it equals mode 2) with the
  compressed 2048x2048 upper-triangular mask, cached per device;
- window: sparse_mode 4 (band, bottom-right origin) with pre_tockens/next_tockens (that spelling);
- packed varlen: TND with actual_seq_qlen/kvlen as cumulative lengths; key padding: an explicit
  (B, 1, S_q, S_kv) mask with sparse_mode 0; block-sparse patterns and globals are not mapped;
- rows with no allowed key: the NPU's result there is unspecified, so they are set to 0 / lse -inf here;
- lse from (softmax_max, softmax_sum): `lse_from_softmax_stats`;
- inference: when no input requires grad (torch.no_grad / inference_mode / detached inputs) and
  head_dim <= 512 on Atlas A2/A3, the forward runs npu_fused_infer_attention_score (spelled
  pre_tokens/next_tokens, num_key_value_heads for GQA, softmax_lse_flag=True).  Either forward
  gives the same (out, lse), and the backward needs only those, so the choice is always safe;
- backward: npu_fusion_attention_grad with softmax_max = lse, softmax_sum = 1 (the documented
  recomputation p = exp(s - max) / sum then equals exp(s - lse)) and attention_in = out."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from opsadv.core.errors import NoKernelError
from opsadv.core.kernel import PRIORITY_VENDOR, KernelImpl
from opsadv.ops.sparse_attention.layout import dense_mask

from . import _npu

NAME = "ascend"
MAX_HEAD_DIM = 768                  # npu_fusion_attention
INFER_MAX_HEAD_DIM = 512            # npu_fused_infer_attention_score
FULL = 2147483647                   # the op's "no limit" for pre_tockens / next_tockens
COMPRESSED = 2048                   # side of the compressed causal mask of sparse_modes 2/3/4
STAT_LANES = 8                      # softmax_max / softmax_sum replicate each row value over 8 lanes
SPARSE_MODE_MASK, SPARSE_MODE_CAUSAL_BR, SPARSE_MODE_BAND = 0, 3, 4
DEAD_ROW_MAX = 1e30                 # softmax_max for rows with no key: exp(s - 1e30) = 0 in backward

_causal_masks: dict[torch.device, Tensor] = {}


def compressed_causal_mask(device: torch.device) -> Tensor:
    """torch.triu(ones(2048, 2048), 1) as bool on `device`, built once per device."""
    m = _causal_masks.get(device)
    if m is None:
        m = torch.triu(torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=device), diagonal=1)
        _causal_masks[device] = m
    return m


# ---- the one place that knows the shape of the NPU's softmax statistics --------------------------
def lse_from_softmax_stats(softmax_max: Tensor, softmax_sum: Tensor, layout: str) -> Tensor:
    """npu_fusion_attention's row statistics -> the contract's lse (b, h, s_q) float32.

    Documented shapes (float32): BNSD/BSND/BSH/SBH -> (B, N, S_q, 8), TND -> (T, N, 8); the row
    max of the scaled, masked scores (resp. the sum of exp(score - max)) is replicated over the
    last dim of 8.  lse = max + log(sum).  TND comes back as (1, N, T) (the packed batch)."""
    lse = softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())
    return lse.transpose(0, 1).unsqueeze(0) if layout == "TND" else lse


def softmax_stats_from_lse(lse: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """Inverse of lse_from_softmax_stats for the backward: max = lse, sum = 1, same shapes.
    Rows with no key (lse = -inf) get a huge max so their recomputed probabilities are 0."""
    m = lse.float().masked_fill(torch.isneginf(lse), DEAD_ROW_MAX)
    if layout == "TND":
        m = m[0].transpose(0, 1)                      # (1, N, T) -> (T, N)
    m = m.unsqueeze(-1).expand(*m.shape, STAT_LANES).contiguous()
    return m, torch.ones_like(m)


# ---- mapping a call onto npu_fusion_attention's arguments -----------------------------------------
@dataclass
class Plan:
    layout: str = "BNSD"
    atten_mask: Tensor | None = None   # NPU polarity: True = masked out
    sparse_mode: int = SPARSE_MODE_MASK
    pre_tockens: int = FULL
    next_tockens: int = FULL
    seqlens: list[int] | None = None   # TND: cumulative lengths, e.g. [2, 4, 6] for three of 2
    dead: Tensor | None = None         # explicit mask: rows with no allowed key (broadcastable to (b, h, s_q))
    dead_prefix: int = 0               # causal / band: the first rows see no key (s_q > s_k)
    nothing: bool = False              # no key allowed anywhere: zeros without calling the NPU

    def kwargs(self) -> dict:
        kw = dict(atten_mask=self.atten_mask, sparse_mode=self.sparse_mode, pre_tockens=self.pre_tockens,
                  next_tockens=self.next_tockens)
        if self.seqlens is not None:
            kw.update(actual_seq_qlen=self.seqlens, actual_seq_kvlen=self.seqlens)
        return kw


def _band_dead_prefix(sq: int, sk: int, nxt: int) -> int:
    """Rows i whose key range [i' - pre, i' + nxt] (i' = i + sk - sq, pre, nxt >= 0) misses [0, sk):
    exactly those with i' + nxt < 0, a prefix of the rows (computed on the host: no device sync)."""
    return max(0, min(sq, sq - sk - nxt))


def _dense_plan(q: Tensor, k: Tensor, attn_mask: Tensor | None, causal: bool) -> Plan:
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    if attn_mask is None:
        if not causal:
            return Plan()
        return Plan(atten_mask=compressed_causal_mask(q.device), sparse_mode=SPARSE_MODE_CAUSAL_BR,
                    dead_prefix=_band_dead_prefix(sq, sk, 0))
    allowed = attn_mask
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        allowed = allowed & (j <= i + (sk - sq))
    mb = b if allowed.shape[0] != 1 or allowed.shape[1] != 1 else 1   # NPU shapes: BNSS, B1SS, 11SS
    allowed = allowed.expand(mb, allowed.shape[1], sq, sk)
    return Plan(atten_mask=(~allowed).contiguous(), dead=~allowed.any(-1))   # applied without a host sync


def _fix_dead(out: Tensor, lse: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
    """Rows with no allowed key: 0 and lse = -inf (the NPU leaves them unspecified).  `out` and
    `lse` are this call's own fresh tensors, so the prefix case writes in place."""
    if plan.dead is not None:
        out, lse = out.masked_fill(plan.dead[..., None], 0), lse.masked_fill(plan.dead, float("-inf"))
    if plan.dead_prefix:
        out[..., :plan.dead_prefix, :] = 0
        lse[..., :plan.dead_prefix] = float("-inf")
    return out, lse


# ---- flash_attention -------------------------------------------------------------------------------
def flash_fwd(ctx, q, k, v, attn_mask, causal, scale):
    plan = _dense_plan(q, k, attn_mask, causal)
    return _run_fwd(q, k, v, plan, scale)


def flash_bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    plan = _dense_plan(q, k, attn_mask, causal)
    return _run_bwd(dout, q, k, v, out, lse, plan, scale)


def _use_infer(q, k, v, plan: Plan) -> bool:
    soc = _npu.STATE.soc
    return (soc is not None and soc.infer_attention and plan.layout == "BNSD" and q.shape[-1] <= INFER_MAX_HEAD_DIM
            and not (q.requires_grad or k.requires_grad or v.requires_grad)
            and (plan.atten_mask is None or plan.atten_mask.dim() == 2 or plan.atten_mask.shape[1] == 1))


def _run_infer(npu, q, k, v, plan: Plan, scale: float):
    """npu_fused_infer_attention_score: its softmax_lse is (B, N, S_q, 1) float32, already the lse."""
    out, lse = npu.npu_fused_infer_attention_score(
        q.contiguous(), k.contiguous(), v.contiguous(), atten_mask=plan.atten_mask, num_heads=q.shape[1],
        num_key_value_heads=k.shape[1], input_layout="BNSD", scale=float(scale), pre_tokens=plan.pre_tockens,
        next_tokens=plan.next_tockens, sparse_mode=plan.sparse_mode, softmax_lse_flag=True)[:2]
    return _fix_dead(out, lse[..., 0].float().contiguous(), plan)


def _run_fwd(q, k, v, plan: Plan, scale: float):
    if plan.nothing:
        return torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    npu = _npu.torch_npu()
    if _use_infer(q, k, v, plan):
        return _run_infer(npu, q, k, v, plan, scale)
    qn, kn, vn = (_to_layout(t, plan.layout) for t in (q, k, v))
    res = npu.npu_fusion_attention(qn, kn, vn, q.shape[1], plan.layout, scale=float(scale), keep_prob=1.0,
                                   **plan.kwargs())
    out, smax, ssum = res[0], res[1], res[2]
    lse = lse_from_softmax_stats(smax, ssum, plan.layout)
    return _fix_dead(_from_layout(out, plan.layout), lse, plan)


def _run_bwd(dout, q, k, v, out, lse, plan: Plan, scale: float):
    if plan.nothing:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    npu = _npu.torch_npu()
    smax, ssum = softmax_stats_from_lse(lse, plan.layout)
    qn, kn, vn, don, outn = (_to_layout(t, plan.layout) for t in (q, k, v, dout, out))
    res = npu.npu_fusion_attention_grad(qn, kn, vn, don, q.shape[1], plan.layout, softmax_max=smax,
                                        softmax_sum=ssum, attention_in=outn, scale_value=float(scale),
                                        keep_prob=1.0, **plan.kwargs())
    return tuple(_from_layout(g, plan.layout) for g in res[:3])


def _to_layout(t: Tensor, layout: str) -> Tensor:
    """(b, h, s, d) -> the NPU layout: BNSD as is; TND (batch 1) as (s, h, d)."""
    return t[0].transpose(0, 1).contiguous() if layout == "TND" else t.contiguous()


def _from_layout(t: Tensor, layout: str) -> Tensor:
    return t.transpose(0, 1).unsqueeze(0).contiguous() if layout == "TND" else t


# ---- sparse_attention --------------------------------------------------------------------------------
SPARSE_UNSUPPORTED = ("block-sparse patterns (a block_mask that is neither all True nor all False) have no "
                      "npu_fusion_attention sparse_mode; only dense, causal, sliding-window and packed varlen layouts map")


def _reject(reason: str):
    raise NoKernelError("sparse_attention", "backend='ascend'", {"ascend.npu_fusion_attention.sparse": [reason]})


def _sparse_plan(q, k, block_mask, kpm, cu, bs, causal, wl, wr) -> Plan:
    sq, sk = q.shape[2], k.shape[2]
    every, some = torch.stack([block_mask.all(), block_mask.any()]).tolist()   # one host sync
    if some and not every:
        _reject(SPARSE_UNSUPPORTED)
    if not some and wl < 0:      # nothing allowed at all: every row is empty
        return Plan(nothing=True)
    if kpm is not None:          # key padding: an explicit (B, 1, S_q, S_kv) mask, sparse_mode 0
        if cu is not None:
            _reject("key padding together with a packed (cu_seqlens) batch is not mapped")
        window = None if every else (wl, wr)
        allowed = dense_mask(sq, sk, bs, block_mask, causal, window, 0, kpm, None, device=q.device)
        return _dense_plan(q, k, allowed, False)
    if every:            # the block rule allows everything: dense (causal) attention, window irrelevant
        plan = _dense_plan(q, k, None, causal) if cu is None else (
            Plan(atten_mask=compressed_causal_mask(q.device), sparse_mode=SPARSE_MODE_CAUSAL_BR) if causal else Plan())
    else:                # window only: a band, bottom-right origin like opsadv's window
        nxt = min(wr, 0) if causal else wr
        plan = Plan(atten_mask=compressed_causal_mask(q.device), sparse_mode=SPARSE_MODE_BAND, pre_tockens=wl,
                    next_tockens=nxt)
        if cu is None:   # packed segments are self-attention and the band holds the diagonal: no dead rows
            plan.dead_prefix = _band_dead_prefix(sq, sk, nxt)
    if cu is not None:   # packed varlen: TND with cumulative lengths
        plan.layout = "TND"
        plan.seqlens = [int(x) for x in cu[1:].tolist()]
    return plan


def sparse_fwd(ctx, q, k, v, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale, dense_blocks=False,
               max_seqlen=-1):
    return _run_fwd(q, k, v, _sparse_plan(q, k, block_mask, kpm, cu, bs, causal, wl, wr), scale)


def sparse_bwd(ctx, dout, q, k, v, out, lse, block_mask, kpm, cu, bs, causal, wl, wr, ng, scale,
               dense_blocks=False, max_seqlen=-1):
    return _run_bwd(dout, q, k, v, out, lse, _sparse_plan(q, k, block_mask, kpm, cu, bs, causal, wl, wr), scale)


# ---- registration ------------------------------------------------------------------------------------
def _check(soc):
    def check(spec, env) -> list[str]:
        why = []
        if not soc.fusion_attention:
            why.append(f"npu_fusion_attention needs Atlas A2/A3/950; this NPU is {soc.description} (SoC {soc.code})"
                       + ("; its npu_prompt_flash_attention returns no log-sum-exp, which the flash_attention "
                          "contract needs" if soc.family == "310P" else ""))
        if spec.dtype == torch.bfloat16 and not soc.bf16:
            why.append(f"bfloat16 needs Atlas A2 (910B) or newer; this NPU is {soc.family} (SoC {soc.code})")
        return why
    return check


def impls(soc) -> list[KernelImpl]:
    common = dict(backend=NAME, priority=PRIORITY_VENDOR, device_types=_npu.device_types(),
                  dtypes=(torch.float16, torch.bfloat16), max_head_dim=MAX_HEAD_DIM)
    return [
        KernelImpl(id="ascend.npu_fusion_attention", op="flash_attention", fn=flash_fwd, backward=flash_bwd,
                   features=frozenset({"causal", "gqa", "cross_length", "attn_mask_bool"}),
                   check=_check(soc),
                   description="torch_npu.npu_fusion_attention, BNSD, sparse_mode 3 for causal (inputs without "
                               "grad, head_dim <= 512, A2/A3: npu_fused_infer_attention_score); backward "
                               "npu_fusion_attention_grad", **common),
        KernelImpl(id="ascend.npu_fusion_attention.sparse", op="sparse_attention", fn=sparse_fwd, backward=sparse_bwd,
                   features=frozenset({"causal", "gqa", "cross_length", "window", "varlen", "key_padding"}),
                   check=_check(soc),
                   description="npu_fusion_attention: window -> sparse_mode 4 band, cu_seqlens -> TND with "
                               "cumulative actual_seq_qlen/kvlen, key padding -> explicit (B,1,S,S) mask; block-sparse "
                               "patterns rejected at call time",
                   **common),
    ]
