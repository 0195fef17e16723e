"""The paged_attention op (opsadv.ops.paged_attention) for the cuda backend (and rocm / jetson, which run the same
kernels): impl "cuda.triton.paged_attention".

Per call: the append kernel (k_new / v_new into their pages, when given), then the attention kernel over a grid
(KV splits, batch x kv heads, query-row blocks) and, with more than one split, the merge kernel (kernels.py).

Split-KV (flash-decoding): a decode batch has batch x kv_heads programs, 8 for b1 with 8 kv heads, which leaves
most of a 132-SM GPU idle however long the context.  When the programs fall short of two waves of the SM count
(num_splits), the key range is cut into slices of at least MIN_SPLIT_KEYS keys, as many as bring the grid to two
waves (at most MAX_SPLITS), each slice's partial (out, lse) kept in float32 and merged by a second kernel.  The
count comes from the host-known bound on the context (block_table's width x page_size), so choosing it reads no
tensor value; each program cuts its own sequence's length into the same number of slices.

varlen_attention (impl "cuda.triton.varlen_attention", varlen_fwd) runs the same attention and merge kernels with
KV_CONTIG: K / V packed (total_k, Hkv, D), sequence b's keys at rows cu_seqlens_k[b]:cu_seqlens_k[b+1].  Its split
count takes max_seqlen_k (else total_k) as the context bound; max_seqlen_q only sharpens the idle-SM estimate.
Neither bounds the grid (that stays total_q rows), so a wrong hint costs speed, never a row."""
from __future__ import annotations

import torch

from opsadv.core.envvars import env_bool
from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_TRITON, KernelImpl

from .. import interpreter_bf16_reasons, triton_device_types

LOG2E = 1.4426950408889634
CPU_SMS = 132                 # the SM count the split heuristic assumes where there is no GPU (an H100 SXM)
MIN_SPLIT_KEYS = 256          # a split covers at least this many keys of the context bound,
MIN_SPLIT_KEYS_LONG = 512     # and this many from LONG_CONTEXT keys on: H100, CUDA-graph replay, b1 GQA 32/8: ctx8k
LONG_CONTEXT = 4096           # 16 splits 47 us vs 32 splits 57 us; ctx1k 4 splits of 256 keys 21 us vs 2 splits 26 us
MAX_SPLITS = 64
WAVES = 2
SPLITS_OVERRIDE: int | None = None      # tests: force this many splits (1: none)
F16_DOT = True                # bf16 q over an fp8 cache: fp16 dots (kernels.py, FP8; 1.07-1.30x on the H100)
_K: dict = {}


def _kernels():
    if not _K:
        from .kernels import append_kernel, merge_kernel, paged_attn_kernel
        from ..utils import FastLaunch
        _K.update(attn=FastLaunch(paged_attn_kernel), merge=FastLaunch(merge_kernel), append=FastLaunch(append_kernel))
    return _K


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_splits(programs: int, context: int, sms: int, tiles=None) -> int:
    """KV splits for a grid of `programs` (sequences x kv heads x query blocks) over contexts of at most `context`
    keys on a GPU of `sms` SMs: 1 where the grid fills WAVES waves or the context is short; else as many as
    bring it to WAVES waves, each split keeping >= MIN_SPLIT_KEYS keys (MIN_SPLIT_KEYS_LONG from LONG_CONTEXT on),
    at most MAX_SPLITS.  tiles: the profile's tiles["paged_attention"] may set "waves", "min_split_keys" and
    "max_splits" (no profile does yet; the defaults were probed on an H100 only)."""
    if SPLITS_OVERRIDE is not None:
        return max(1, SPLITS_OVERRIDE)
    t = tiles or {}
    target = t.get("waves", WAVES) * sms
    if programs >= target:
        return 1
    min_keys = MIN_SPLIT_KEYS_LONG if context >= LONG_CONTEXT else MIN_SPLIT_KEYS
    return max(1, min(-(-target // programs), context // t.get("min_split_keys", min_keys),
                      t.get("max_splits", MAX_SPLITS)))


def _profile_tiles(ctx) -> dict | None:
    tiles = getattr(getattr(ctx, "profile", None), "tiles", None) or {}
    t = tiles.get("paged_attention")
    return t if isinstance(t, dict) else None


def _sms(ctx, device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    env = getattr(ctx, "env", None)
    n = getattr(env, "sm_count", None)
    return n or torch.cuda.get_device_properties(device).multi_processor_count


def _new(shape, dtype, device, poison):
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _tiles(d_pad: int, rows: int, dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): rows per program (query x group heads), keys per step, and the
    loop's pipeline depth.  Compiled for sm_90 without spills
    (tests/test_paged_attention.py::test_kernels_compile_for_sm90_without_spills)."""
    wide = dtype == torch.float32 or d_pad > 128        # fp32 (FMA dots) and d256 tiles: smaller, or they spill
    block_m = max(16, min(_pow2(rows), 32 if wide else 64))
    block_n = 32 if wide else 64
    return block_m, block_n, 8 if dtype == torch.float32 or block_m * d_pad > 64 * 128 else 4, 3


def _decode_block_n(block_n: int, block_m: int, d_pad: int, dtype, fp8: bool, splits: int, context: int) -> int:
    """Keys per step of a decode tile (one 16-row block, head dim <= 128, half-precision q): 128 over an fp8 cache
    (half the bytes per key, so a wider step keeps as many in flight: 1.18-1.34x at the decode suite's fp8 shapes on
    the H100) and over a bf16 / fp16 cache whose programs each walk a long context alone (no split: 1.18x at b64 x
    8k); 64 otherwise (with splits, 128 measured 0.82x at b8 x 8k / 32k)."""
    if block_m != 16 or d_pad > 128 or dtype == torch.float32:
        return block_n
    return 128 if fp8 or (splits == 1 and context >= 4096) else block_n


def _scale_arg(t, like):
    """(pointer, stride) of a per-kv-head scale (stride 0 for one scalar); (like, 0) without an fp8 cache (the
    kernels never read it then)."""
    if t is None:
        return like, 0
    return t, (t.stride(0) if t.dim() and t.shape[0] > 1 else 0)


def paged_fwd(ctx, q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal, scale,
              k_scale=None, v_scale=None):
    k = _kernels()
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    ks, sks = _scale_arg(k_scale, seqlens_k)
    vs, svs = _scale_arg(v_scale, seqlens_k)
    dev = q.device
    poison = dev.type == "cpu" or env_bool("OPSADV_POISON_OUTPUTS")
    varlen = cu_seqlens_q is not None
    hq, d = q.shape[-2:]
    npages, page, hkv, _ = k_cache.shape
    batch, width = block_table.shape
    g = hq // hkv
    q3 = q.reshape(-1, hq, d) if not varlen else q          # (a view where q's strides allow)
    rows = q3.shape[0]
    s_q = rows if varlen else q.shape[1]                    # a bound on any sequence's query count
    cu = cu_seqlens_q if varlen else seqlens_k              # (unused without varlen)
    d_pad = max(16, _pow2(d))
    if k_new is not None:
        kn = k_new.reshape(-1, hkv, d) if not varlen else k_new
        vn = v_new.reshape(-1, hkv, d) if not varlen else v_new
        bt = 16
        k["append"][(batch, -(-s_q // bt))](
            kn, vn, k_cache, v_cache, block_table, seqlens_k, cu, s_q, hkv, ks, vs, sks, svs,
            kn.stride(0), kn.stride(1), kn.stride(2), vn.stride(0), vn.stride(1), vn.stride(2),
            *k_cache.stride(), *v_cache.stride(), block_table.stride(0), block_table.stride(1),
            PAGE=page, D=d, BLOCK_T=bt, BLOCK_D=d_pad, VARLEN=varlen, FP8=fp8, num_warps=4)
    block_m, block_n, warps, stages = _tiles(d_pad, s_q * g, q.dtype)
    mblocks = -(-(s_q * g) // block_m)
    # the programs that have rows (packed q: its mean count per sequence; the grid's bound leaves the rest idle)
    busy = mblocks if not varlen else -(-(-(-rows // max(batch, 1)) * g) // block_m)
    splits = num_splits(batch * hkv * busy, width * page, _sms(ctx, dev), _profile_tiles(ctx))
    block_n = _decode_block_n(block_n, block_m, d_pad, q.dtype, fp8, splits, width * page)
    out = _new((rows, hq, d), q.dtype, dev, poison)
    lse = _new((rows, hq), torch.float32, dev, poison)
    if splits > 1:
        o_dst = _new((splits, rows, hq, d), torch.float32, dev, poison)
        l_dst = _new((splits, rows, hq), torch.float32, dev, poison)
        sos, sls = o_dst.stride(0), l_dst.stride(0)
    else:
        o_dst, l_dst, sos, sls = out, lse, 0, 0
    ot, lt = o_dst.stride(-3), l_dst.stride(-2)
    k["attn"][(splits, batch * hkv, mblocks)](
        q3, k_cache, v_cache, block_table, seqlens_k, cu, o_dst, l_dst, s_q, hkv, g, splits, scale * LOG2E,
        ks, vs, sks, svs,
        q3.stride(0), q3.stride(1), q3.stride(2), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0), block_table.stride(1),
        ot, o_dst.stride(-2), o_dst.stride(-1), lt, l_dst.stride(-1), sos, sls,
        PAGE=page, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d_pad, VARLEN=varlen, CAUSAL=causal,
        SPLIT=splits > 1, IEEE=q.dtype == torch.float32, FP8=fp8, F16_DOT=fp8 and F16_DOT and q.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages)
    if splits > 1:
        block_h = min(_pow2(hq), max(1, 4096 // d_pad))
        k["merge"][(rows, -(-hq // block_h))](
            o_dst, l_dst, out, lse, hq, splits, sos, sls, out.stride(0), out.stride(1), lse.stride(0),
            D=d, BLOCK_H=block_h, BLOCK_D=d_pad, num_warps=4)
    return out.view(q.shape), lse.view(q.shape[:-1])


def varlen_fwd(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    """varlen_attention: q (total_q, Hq, D) against packed k / v (total_k, Hkv, D) per cu_seqlens segment."""
    kern = _kernels()
    dev = q.device
    poison = dev.type == "cpu" or env_bool("OPSADV_POISON_OUTPUTS")
    rows, hq, d = q.shape
    total_k, hkv = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    g = hq // hkv
    d_pad = max(16, _pow2(d))
    # the grid's row bound is total_q (correct for any segment lengths); max_seqlen_q only tunes the tiles / splits
    hint_q = min(max_seqlen_q, rows) if max_seqlen_q is not None else -(-rows // max(batch, 1))
    block_m, block_n, warps, stages = _tiles(d_pad, max(hint_q, 1) * g, q.dtype)
    mblocks = -(-(rows * g) // block_m)
    busy = -(-(max(hint_q, 1) * g) // block_m)
    context = min(max_seqlen_k, total_k) if max_seqlen_k is not None else total_k
    splits = num_splits(batch * hkv * busy, context, _sms(ctx, dev), _profile_tiles(ctx))
    out = _new((rows, hq, d), q.dtype, dev, poison)
    lse = _new((rows, hq), torch.float32, dev, poison)
    if splits > 1:
        o_dst = _new((splits, rows, hq, d), torch.float32, dev, poison)
        l_dst = _new((splits, rows, hq), torch.float32, dev, poison)
        sos, sls = o_dst.stride(0), l_dst.stride(0)
    else:
        o_dst, l_dst, sos, sls = out, lse, 0, 0
    kern["attn"][(splits, batch * hkv, mblocks)](
        q, k, v, cu_seqlens_k, cu_seqlens_k, cu_seqlens_q, o_dst, l_dst, rows, hkv, g, splits, scale * LOG2E,
        cu_seqlens_k, cu_seqlens_k, 0, 0,                           # (fp8 scales: unused)
        q.stride(0), q.stride(1), q.stride(2), 0, k.stride(0), k.stride(1), k.stride(2),
        0, v.stride(0), v.stride(1), v.stride(2), 0, 0,            # (page strides and block table: unused)
        o_dst.stride(-3), o_dst.stride(-2), o_dst.stride(-1), l_dst.stride(-2), l_dst.stride(-1), sos, sls,
        PAGE=1, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d_pad, VARLEN=True, CAUSAL=causal,
        SPLIT=splits > 1, IEEE=q.dtype == torch.float32, FP8=False, KV_CONTIG=True, num_warps=warps,
        num_stages=stages)
    if splits > 1:
        block_h = min(_pow2(hq), max(1, 4096 // d_pad))
        kern["merge"][(rows, -(-hq // block_h))](
            o_dst, l_dst, out, lse, hq, splits, sos, sls, out.stride(0), out.stride(1), lse.stride(0),
            D=d, BLOCK_H=block_h, BLOCK_D=d_pad, num_warps=4)
    return out, lse


FP8_MIN_CC = (8, 9)            # Triton's e4m3 (fp8e4nv) type needs sm_89+ (Ada, Hopper): not A100, not Jetson Orin


def _check(spec, env) -> list[str]:
    fp8 = "fp8_kv" in spec.features
    reasons = interpreter_bf16_reasons(spec, torch.float16 if fp8 and F16_DOT else None)   # (fp16 dots: F16_DOT)
    cc = getattr(env, "compute_capability", None)
    if fp8 and spec.device_type == "cuda" and cc is not None and tuple(cc) < FP8_MIN_CC:
        reasons.append(f"an fp8 (e4m3) KV cache needs compute capability >= {FP8_MIN_CC} (Triton's fp8e4nv); this "
                       f"GPU is {tuple(cc)}")
    return reasons


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    # fp8 caches on cuda only: AMD's CDNA3 fp8 is e4m3fnuz, and the e4m3fn path is untested on ROCm
    fp8 = {"fp8_kv"} if backend == "cuda" else set()
    return [KernelImpl(
        id=f"{backend}.triton.paged_attention", op="paged_attention", backend=backend, fn=paged_fwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), max_head_dim=256,
        features=frozenset({"causal", "gqa", "varlen", "append", *fp8}), deterministic=True,
        requires_interpret_or_cuda=True, check=_check, memory=MEMORY_FLASH,
        description="Triton: pages read through the block table, a GQA group per program (K / V read once per kv "
                    "head), split-KV with a merge kernel when batch x kv heads leaves SMs idle; append kernel for "
                    "k_new / v_new" + ("; fp8 (e4m3) caches with per-head scales, quantized on append" if fp8
                                       else "")),
        KernelImpl(
        id=f"{backend}.triton.varlen_attention", op="varlen_attention", backend=backend, fn=varlen_fwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.float16, torch.bfloat16, torch.float32), max_head_dim=256,
        features=frozenset({"causal", "gqa"}), deterministic=True, requires_interpret_or_cuda=True,
        check=lambda spec, env: interpreter_bf16_reasons(spec), memory=MEMORY_FLASH,
        description="Triton: the paged_attention kernel reading packed K / V at cu_seqlens_k offsets, a GQA group "
                    "per program, split-KV with a merge kernel when batch x kv heads leaves SMs idle")]
