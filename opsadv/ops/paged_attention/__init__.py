"""paged_attention: attention of new queries over a paged KV cache (decode, chunked prefill, speculative decoding),
forward only (inference).

    out = paged_attention(q, k_cache, v_cache, block_table, seqlens_k, *, cu_seqlens_q=None, causal=True,
                          scale=None, k_new=None, v_new=None, return_lse=False, k_scale=None, v_scale=None)

- q: (batch, s_q, Hq, D), the same number of queries per sequence (decode: s_q = 1); or packed (total_q, Hq, D)
  with cu_seqlens_q (int32, (batch + 1,), cu[0] = 0, non-decreasing, cu[-1] = total_q): sequence b's queries are
  rows cu[b]:cu[b+1] (different counts per sequence; empty segments allowed).
- k_cache, v_cache: (num_pages, page_size, Hkv, D), page_size a power of two >= 8; the same shape, and q's dtype
  or both float8_e4m3fn (an fp8 cache, below).
- block_table: int32 (batch, max_pages_per_seq): sequence b's token t lives in page block_table[b, t // page_size]
  at slot t % page_size.  Entries past a sequence's last page are never read (they may hold anything).
- seqlens_k: int32 (batch,): the number of valid cached tokens of each sequence AFTER the call's k_new / v_new
  are appended (vLLM's seq_lens, FlashInfer's paged lengths; FlashAttention's flash_attn_with_kvcache takes
  cache_seqlens = the length BEFORE appending: cache_seqlens = seqlens_k - n_new).
- k_new, v_new: (batch, s_q, Hkv, D) or packed (total_q, Hkv, D), laid out like q: sequence b's new tokens are
  written in place into the cache at positions seqlens_k[b] - n_b .. seqlens_k[b] - 1 (n_b its query count)
  before the attention reads them, so a decode step is one call.  (Writing the same tokens twice is harmless.)
- causal (default True) is bottom-right aligned: query i of a sequence with n queries and L keys sees keys
  j <= L - n + i.  A query that sees no key (seqlens_k = 0, or more queries than keys) gives out 0 and lse -inf.
- GQA / MQA by index (Hq a multiple of Hkv; query head h reads kv head h // (Hq / Hkv)); scale defaults to
  1 / sqrt(D); fp16 / bf16 / fp32 (float64 on the reference) with float32 arithmetic.
- fp8 cache: k_cache / v_cache float8_e4m3fn hold K = fp8 * k_scale[h], V = fp8 * v_scale[h] per kv head h;
  k_scale and v_scale (required then, refused with any other cache) are float32 (Hkv,) tensors (or one scalar,
  shape () / (1,)) of finite values > 0 on q's device.  q, out and k_new / v_new keep q's dtype; the kernels
  read the fp8 tiles, widen them exactly and fold k_scale into the qk scale and v_scale into the output, float32
  arithmetic as above.  k_new / v_new are quantized on append: clamp(float32(x) / scale, -448, 448) rounded to
  nearest even into e4m3 (quantize_kv; kv_scales(x) gives amax / 448 per head to build a cache from bf16 K / V).
  Round trip: e4m3 keeps 3 mantissa bits, so |fp8 * scale - x| <= 2^-4 |x| per element where |x| / scale lies
  in [2^-6, 448] (below 2^-6 the error is at most 2^-10 * scale; above 448 the value clamps), up to float32's
  rounding of x / scale.  The attention itself over an fp8 cache matches the bf16 / fp16 path's accuracy on the
  dequantized K / V.
- Returns out (q's shape and dtype) or (out, lse) with return_lse: lse (q's shape without D), float32 (float64
  for float64), natural log.  No gradients: a call whose inputs require grad (with grad enabled) is refused.

Checks: shapes, dtypes and devices always; the values of block_table / seqlens_k / cu_seqlens_q (pages in range,
seqlens_k <= the table's capacity and >= the appended count, cu_seqlens_q monotone, k_scale / v_scale finite and
> 0) only for CPU tensors in eager calls (on a GPU they would cost a device sync per call).

Impl contract:
  fn(ctx, q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal, scale: float,
     k_scale, v_scale) -> (out, lse)    (k_new / v_new None: no append; else appended in place first; k_scale /
                                         v_scale None unless the cache is fp8; impls serving feature "fp8_kv")
out and lse contiguous, as the fakes say."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core.devices import device_index, device_key
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.opdef import OpDef, Reference, arg
from opsadv.core import policy as _policy
from opsadv.core.op_common import (TORCH_OPS, check_scale, check_tensor, dispatch_modes, dt, eager_mode,
                                   function_modes, functorch_level, grad_enabled, is_compiling, len_bucket)
from opsadv.core.policy import in_scope, op_scope

from . import cases as _cases, reference as _reference
from .reference import FP8, FP8_MAX, kv_scales, quantize_kv  # noqa: F401  (public: building an fp8 cache)

OP = "paged_attention"
_INDEX = (torch.int32,)
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, FP8)
MAX_HEAD_DIM = 256


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def validate(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q=None, causal=True, scale=None, k_new=None,
             v_new=None, k_scale=None, v_scale=None) -> None:
    """Shapes, dtypes, devices and options (cheap: no tensor value is read)."""
    packed = cu_seqlens_q is not None
    check_tensor(OP, "q", q, ndim=3 if packed else 4, allow_empty=True)
    check_tensor(OP, "k_cache", k_cache, ndim=4, dtypes=_CACHE_DTYPES, allow_empty=True)
    check_tensor(OP, "v_cache", v_cache, ndim=4, dtypes=_CACHE_DTYPES, allow_empty=True)
    fp8 = k_cache.dtype == FP8
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if fp8 and t.dtype != FP8:
            raise InvalidArgumentError(OP, name, "dtype float8_e4m3fn (same as k_cache)", dt(t.dtype))
        if not fp8 and t.dtype != q.dtype:
            raise InvalidArgumentError(OP, name, f"dtype {dt(q.dtype)} (same as q), or float8_e4m3fn for both "
                                       "caches (with k_scale / v_scale)", dt(t.dtype))
    if k_cache.shape[-1] != q.shape[-1]:
        raise InvalidArgumentError(OP, "k_cache", f"head_dim (last dim) {q.shape[-1]} (as q)",
                                   f"head_dim {k_cache.shape[-1]}")
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(OP, "v_cache", f"shape {tuple(k_cache.shape)} (same as k_cache: num_pages, "
                                   "page_size, Hkv, D)", tuple(v_cache.shape))
    npages, ps, hkv, d = k_cache.shape
    hq = q.shape[-2]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise InvalidArgumentError(OP, "k_cache", f"head_dim in [1, {MAX_HEAD_DIM}]", f"head_dim {d}")
    if not _pow2(ps) or ps < 8:
        raise InvalidArgumentError(OP, "k_cache", "page_size (dim 1) a power of two >= 8", f"page_size {ps}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise InvalidArgumentError(OP, "k_cache", f"a number of kv heads dividing q's {hq} heads (GQA / MQA)",
                                   f"{hkv} kv heads")
    check_tensor(OP, "block_table", block_table, ndim=2, dtypes=_INDEX, allow_empty=True)
    batch = block_table.shape[0]
    check_tensor(OP, "seqlens_k", seqlens_k, ndim=1, dtypes=_INDEX, allow_empty=True)
    if seqlens_k.shape[0] != batch:
        raise InvalidArgumentError(OP, "seqlens_k", f"shape ({batch},) (block_table's batch)", tuple(seqlens_k.shape))
    if packed:
        check_tensor(OP, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_INDEX)
        if cu_seqlens_q.shape[0] != batch + 1:
            raise InvalidArgumentError(OP, "cu_seqlens_q", f"shape ({batch + 1},) (batch + 1)",
                                       tuple(cu_seqlens_q.shape))
    elif q.shape[0] != batch:
        raise InvalidArgumentError(OP, "q", f"batch {batch} (block_table's rows; packed q (total_q, Hq, D) needs "
                                   "cu_seqlens_q)", f"shape {tuple(q.shape)}")
    if (k_new is None) != (v_new is None):
        raise InvalidArgumentError(OP, "v_new" if v_new is None else "k_new", "given together with "
                                   + ("k_new" if v_new is None else "v_new"), "None")
    if k_new is not None:
        want = (*q.shape[:-2], hkv, d)
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check_tensor(OP, name, t, ndim=q.dim(), allow_empty=True)
            if t.dtype != q.dtype:
                raise InvalidArgumentError(OP, name, f"dtype {dt(q.dtype)} (same as q)", dt(t.dtype))
            if tuple(t.shape) != want:
                raise InvalidArgumentError(OP, name, f"shape {want} (q's with Hkv = {hkv} heads)", tuple(t.shape))
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8:
            if t is not None:
                raise InvalidArgumentError(OP, name, f"None (scales go with a float8_e4m3fn cache; this cache is "
                                           f"{dt(k_cache.dtype)})", f"a {type(t).__name__}")
            continue
        want_s = f"a float32 tensor of shape ({hkv},) (one scale per kv head) or a scalar, with the fp8 cache"
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(OP, name, want_s, "None" if t is None else type(t).__name__)
        if t.dtype != torch.float32:
            raise InvalidArgumentError(OP, name, want_s, f"dtype {dt(t.dtype)}")
        if tuple(t.shape) not in ((hkv,), (1,), ()):
            raise InvalidArgumentError(OP, name, want_s, f"shape {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("seqlens_k", seqlens_k), ("cu_seqlens_q", cu_seqlens_q), ("k_new", k_new), ("v_new", v_new),
                    ("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None and t.device != q.device:
            raise InvalidArgumentError(OP, name, f"on device {q.device} (same as q)", str(t.device))
    if not isinstance(causal, bool):
        raise InvalidArgumentError(OP, "causal", "a bool", repr(causal))
    check_scale(OP, scale)


def check_values(q, k_cache, block_table, seqlens_k, cu_seqlens_q, k_new, k_scale=None, v_scale=None) -> None:
    """The index tensors' and the fp8 scales' values (CPU tensors only: a GPU check would sync the device every
    call)."""
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None and not bool(((t > 0) & t.isfinite()).all()):
            raise InvalidArgumentError(OP, name, "finite scales > 0", str(t.tolist()))
    npages, ps = k_cache.shape[:2]
    batch, cap = block_table.shape[0], block_table.shape[1] * ps
    lens = seqlens_k.tolist()
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.tolist()
        if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
            raise InvalidArgumentError(OP, "cu_seqlens_q", f"non-decreasing offsets from 0 to total_q = {q.shape[0]}",
                                       str(cu if len(cu) <= 9 else cu[:4] + ["..."] + cu[-4:]))
        counts = [b - a for a, b in zip(cu, cu[1:])]
    else:
        counts = [q.shape[1]] * batch
    for b, n in enumerate(lens):
        if not 0 <= n <= cap:
            raise InvalidArgumentError(OP, "seqlens_k", f"values in [0, {cap}] (block_table's {block_table.shape[1]} "
                                       f"pages x page_size {ps})", f"seqlens_k[{b}] = {n}")
        if k_new is not None and n < counts[b]:
            raise InvalidArgumentError(OP, "seqlens_k", f"seqlens_k[{b}] >= the {counts[b]} tokens appended to "
                                       f"sequence {b} (seqlens_k counts the tokens after appending)",
                                       f"seqlens_k[{b}] = {n}")
    used = [-(-n // ps) for n in lens]
    if batch and max(used, default=0):
        idx = torch.arange(block_table.shape[1])[None, :] < torch.tensor(used)[:, None]
        pages = block_table.cpu()[idx]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= npages):
            bad = pages[(pages < 0) | (pages >= npages)][0].item()
            raise InvalidArgumentError(OP, "block_table", f"page indices in [0, {npages}) for the pages seqlens_k "
                                       "uses", f"page {bad}")


def features(q, k_cache, cu_seqlens_q, k_new, causal) -> frozenset[str]:
    f = {"fp8_kv"} if k_cache.dtype == FP8 else set()
    if causal:
        f.add("causal")
    if q.shape[-2] != k_cache.shape[2]:
        f.add("gqa")
    if cu_seqlens_q is not None:
        f.add("varlen")
    if k_new is not None:
        f.add("append")
    return frozenset(f)


def _rows(q) -> int:
    return q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]


def _key(q, k_cache, block_table, cu_seqlens_q, k_new, causal) -> tuple:
    npages, ps, hkv, d = k_cache.shape
    return (OP, device_key(q), q.dtype, k_cache.dtype, d, causal, q.shape[-2] // hkv, q.shape[-2] != hkv, ps,
            cu_seqlens_q is not None, k_new is not None, len_bucket(_rows(q)),
            len_bucket(block_table.shape[1] * ps), len_bucket(block_table.shape[0] * hkv))


def _spec(q, k_cache, block_table, cu_seqlens_q, k_new, causal, backward: bool = False) -> CallSpec:
    ps = k_cache.shape[1]
    return CallSpec(OP, q.device.type, q.dtype, features(q, k_cache, cu_seqlens_q, k_new, causal),
                    (len_bucket(_rows(q)), len_bucket(block_table.shape[1] * ps),
                     len_bucket(block_table.shape[0] * k_cache.shape[2]), ps),
                    head_dim=k_cache.shape[-1], backward=backward,
                    shapes=(tuple(q.shape), tuple(k_cache.shape), tuple(block_table.shape)),
                    bucket_names=("q_rows<=", "context<=", "batch*kv_heads<=", "page_size="),
                    device_index=device_index(q))


def _route(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal, scale, k_scale,
           v_scale):
    return dispatch.call(_key(q, k_cache, block_table, cu_seqlens_q, k_new, causal),
                         lambda: _spec(q, k_cache, block_table, cu_seqlens_q, k_new, causal),
                         (q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal, scale,
                          k_scale, v_scale))


def _contiguous(out, lse):
    return out if out.is_contiguous() else out.contiguous(), lse if lse.is_contiguous() else lse.contiguous()


@torch.library.custom_op("opsadv::paged_attention", mutates_args=())
def _paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqlens_k: Tensor,
           cu_seqlens_q: Optional[Tensor], causal: bool, scale: float, k_scale: Optional[Tensor] = None,
           v_scale: Optional[Tensor] = None, scope: int = 0) -> tuple[Tensor, Tensor]:
    """Attention over the cache as it is.  scope: the converted model's scope id (core.policy.op_scope)."""
    with in_scope(scope):
        return _contiguous(*_route(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, None, None, causal,
                                   scale, k_scale, v_scale))


@_paged.register_fake
def _(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, causal, scale, k_scale=None, v_scale=None, scope=0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("opsadv::paged_attention_append", mutates_args=("k_cache", "v_cache"))
def _paged_append(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqlens_k: Tensor,
                  cu_seqlens_q: Optional[Tensor], k_new: Tensor, v_new: Tensor, causal: bool, scale: float,
                  k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                  scope: int = 0) -> tuple[Tensor, Tensor]:
    """k_new / v_new written into the cache pages (in place; quantized into an fp8 cache), then attention over the
    cache."""
    with in_scope(scope):
        return _contiguous(*_route(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal,
                                   scale, k_scale, v_scale))


@_paged_append.register_fake
def _(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, causal, scale, k_scale=None,
      v_scale=None, scope=0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


def _no_backward(ctx, dout, dlse):
    raise InvalidArgumentError(OP, "q", "no gradient: paged_attention is forward only (inference over a KV cache; "
                               "train with flash_attention)", "a backward through paged_attention")


_paged.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def _refuse_grad(**tensors) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise InvalidArgumentError(OP, name, "a tensor that does not require grad (paged_attention is forward "
                                       "only: run it under torch.no_grad() / inference_mode, or detach)",
                                       "requires_grad=True")


def _empty_result(q):
    return q.new_zeros(q.shape), q.new_full(q.shape[:-1], float("-inf"), dtype=lse_dtype(q.dtype))


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped


def _meta(t):
    return None if t is None else (type(t), t.dtype, t.device, t.shape)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqlens_k: Tensor, *,
                    cu_seqlens_q: Tensor | None = None, causal: bool = True, scale: float | None = None,
                    k_new: Tensor | None = None, v_new: Tensor | None = None, return_lse: bool = False,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None):
    """Attention of q over a paged KV cache (module docstring): out (q's shape), or (out, lse) with return_lse.
    seqlens_k counts each sequence's cached tokens after k_new / v_new (if given) are appended in place.  An fp8
    (float8_e4m3fn) cache takes per-kv-head float32 k_scale / v_scale (K = fp8 * k_scale); k_new / v_new are
    quantized into it."""
    fk = hit = None
    # the fast path (as rotary's): the exact metadata of an identical no-grad call that took the full path, which
    # validated everything the key holds (a decode loop repeats its shapes every layer; seqlens_k's values change,
    # and they are read by the kernel, or by check_values on CPU, which runs on every call)
    if type(causal) is bool and (scale is None or type(scale) is float) \
            and not (is_compiling() or dispatch_modes() or function_modes()) and functorch_level() is None:
        try:
            if not (grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
                                        or k_new is not None and k_new.requires_grad
                                        or v_new is not None and v_new.requires_grad)):
                fk = (OP, (_scoped.get() or _policy._global).serial, causal, scale, _meta(q), _meta(k_cache),
                      _meta(v_cache), _meta(block_table), _meta(seqlens_k), _meta(cu_seqlens_q), _meta(k_new),
                      _meta(v_new), _meta(k_scale), _meta(v_scale))
                hit = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
    if hit is not None:
        if q.device.type == "cpu":
            check_values(q, k_cache, block_table, seqlens_k, cu_seqlens_q, k_new, k_scale, v_scale)
        if _tracers:
            dispatch.record(hit.impl.id)
        s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out, lse = _contiguous(*hit.run(hit.ctx, q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new,
                                        v_new, causal, s, k_scale, v_scale))
        return (out, lse) if return_lse else out
    validate(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, causal, scale, k_new, v_new, k_scale, v_scale)
    _refuse_grad(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    mode = eager_mode(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new, k_scale, v_scale)
    if mode != TORCH_OPS and q.device.type == "cpu":
        check_values(q, k_cache, block_table, seqlens_k, cu_seqlens_q, k_new, k_scale, v_scale)
    s = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.numel() == 0 or k_cache.numel() == 0:
        # no query row (batch 0 or no queries; then nothing to append either), or an empty cache
        out, lse = _empty_result(q)
    elif mode != TORCH_OPS:
        out, lse = _contiguous(*_route(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, k_new, v_new,
                                       causal, s, k_scale, v_scale))
        dispatch.learn(fk, _key(q, k_cache, block_table, cu_seqlens_q, k_new, causal))
    elif k_new is None:
        out, lse = torch.ops.opsadv.paged_attention(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, causal,
                                                    s, k_scale, v_scale, op_scope())
    else:
        out, lse = torch.ops.opsadv.paged_attention_append(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q,
                                                           k_new, v_new, causal, s, k_scale, v_scale, op_scope())
    return (out, lse) if return_lse else out


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    q, kc, vc, bt, sk = (arg(args, kwargs, i, n) for i, n in
                         enumerate(("q", "k_cache", "v_cache", "block_table", "seqlens_k")))
    cu, causal, scale = kwargs.get("cu_seqlens_q"), kwargs.get("causal", True), kwargs.get("scale")
    kn, vn = kwargs.get("k_new"), kwargs.get("v_new")
    validate(q, kc, vc, bt, sk, cu, causal, scale, kn, vn, kwargs.get("k_scale"), kwargs.get("v_scale"))
    return _spec(q, kc, bt, cu, kn, causal, backward)


OPDEF = OpDef(OP, paged_attention, Reference(_reference.paged_fwd, None, _reference.FEATURES), explain_spec,
              custom_ops=(_paged, _paged_append), cases=tuple(_cases.CASES), demo=_cases.demo,
              description="attention over a paged KV cache (decode / chunked prefill), forward only")
OPDEFS = (OPDEF,)
