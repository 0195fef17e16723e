"""Bounded workspace: ops whose transient memory would exceed the per-op cap run in chunks.

attention  over query chunks.  Causal attention is bottom-right aligned (query i sees keys
           j <= i + s_k - s_q), so chunk [a, e) of the queries needs only the keys [0, e + s_k - s_q)
           and, with those keys, keeps the same alignment (i - a <= j - (e + s_k - s_q) + (e - a)).
           lse is per row, so the backward reuses each chunk's rows of out and lse; dK and dV are
           summed over chunks in float32.
gemm       over row chunks of a (..., K); db and dbias are summed over chunks in float32.
paged_attention  not chunked: its split-KV (flash-decoding) partials, float32 (out, lse) per split, are bounded
           by capping the number of splits (the profile's tiles["paged_attention"]["max_splits"]) so that they fit.

The per-op cap is the profile's workspace_cap_bytes, lowered to a quarter of the memory budget
(use_backend("jetson", memory_budget=...)) when that is smaller.  How much transient memory an
impl needs per query row / output row is what the underlying impl declares in KernelImpl.memory
(MemoryTraits: "flash" attention and "fused" GEMMs none, so they never chunk; "materializes_scores"
its bytes per score; "temporaries" its float32 temporaries); an impl that declares nothing is
assumed to hold a float32 score and probability matrix / one float32 temporary."""
from __future__ import annotations

import dataclasses

import torch

from opsadv.backends.triton_common.paged_attention.paged_attention import MAX_SPLITS
from opsadv.core.policy import current_policy

from .profiles import JETSON

DEFAULT_CAP = 64 << 20
MIN_ROWS = 64            # a chunk is at least one 64-row tile (unless the op is smaller)

# An attention impl that declares no memory traits is assumed to hold a float32 score and probability
# matrix (bytes per query row x key); a GEMM one float32 temporary of the output's size.
ATTN_DEFAULT_BYTES_PER_SCORE = 8
GEMM_DEFAULT_FACTOR = 1
BWD_EXTRA_FACTOR = 2     # backward: dz plus float32 copies


def workspace_cap(ctx) -> int:
    caps = []
    prof = ctx.profile
    if prof is not None and prof.workspace_cap_bytes:
        caps.append(prof.workspace_cap_bytes)
    budget = ctx.options.get("memory_budget")
    if isinstance(budget, int) and budget > 0:
        caps.append(budget // 4)
    return min(caps) if caps else DEFAULT_CAP


def chunk_rows(total_rows: int, bytes_per_row: float, cap: int) -> int:
    """Rows per chunk: all of them when they fit, else the most that fit (at least MIN_ROWS, a
    multiple of MIN_ROWS so chunk edges fall on tile edges)."""
    if bytes_per_row <= 0 or total_rows * bytes_per_row <= cap:
        return total_rows
    rows = int(cap // bytes_per_row)
    rows = max(MIN_ROWS, rows - rows % MIN_ROWS)
    return min(rows, total_rows)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- attention ------------------------------------------------------------------------------------
def _chunk_inputs(k, v, attn_mask, causal, sq, a, e):
    """Keys, values and mask for query rows [a, e); sk_c <= 0 means every row is masked."""
    sk = k.shape[2]
    sk_c = min(sk, e + sk - sq) if causal else sk
    if sk_c <= 0:
        return None, None, None, sk_c
    kc, vc = (k, v) if sk_c == sk else (k[:, :, :sk_c], v[:, :, :sk_c])
    m = attn_mask
    if m is not None:
        if m.dim() >= 2 and m.shape[-2] == sq and sq > 1:
            m = m[..., a:e, :]
        if m.shape[-1] == sk and sk_c != sk:
            m = m[..., :sk_c]
    return kc, vc, m, sk_c


def attention_rows(ctx, q, k, bytes_per_score: float) -> int:
    b, hq, sq, _ = q.shape
    return chunk_rows(sq, b * hq * k.shape[2] * bytes_per_score, workspace_cap(ctx))


def chunk_accepted(impl, ctx, q, k, rows: int, causal: bool) -> bool:
    """Does `impl` (if given) also accept the chunk shapes (s_q != s_k), by its own check()?"""
    if impl is None or impl.check is None or ctx.spec is None:
        return True
    sq, sk = q.shape[2], k.shape[2]
    shape_q = (q.shape[0], q.shape[1], rows, q.shape[3])
    sk_c = min(sk, rows + sk - sq) if causal else sk
    spec = dataclasses.replace(ctx.spec, features=ctx.spec.features | {"cross_length"},
                               shapes=(shape_q, (k.shape[0], k.shape[1], max(1, sk_c), k.shape[3])))
    return not impl.check(spec, ctx.env)


def chunked_attention_fwd(fn, bytes_per_score, ctx, q, k, v, attn_mask, causal, scale, *, impl=None):
    """fn(ctx, q, k, v, attn_mask, causal, scale) -> (out, lse), run over query chunks (if `impl`'s
    check() accepts chunk shapes; else unchunked)."""
    sq = q.shape[2]
    rows = attention_rows(ctx, q, k, bytes_per_score)
    if rows >= sq or not chunk_accepted(impl, ctx, q, k, rows, causal):
        return fn(ctx, q, k, v, attn_mask, causal, scale)
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:-1], dtype=_acc(q.dtype))
    for a in range(0, sq, rows):
        e = min(sq, a + rows)
        kc, vc, mc, sk_c = _chunk_inputs(k, v, attn_mask, causal, sq, a, e)
        if sk_c <= 0:                    # no key visible to any row of this chunk
            out[:, :, a:e] = 0
            lse[:, :, a:e] = float("-inf")
            continue
        o, l_ = fn(ctx, q[:, :, a:e], kc, vc, mc, causal, scale)
        out[:, :, a:e] = o
        lse[:, :, a:e] = l_
    return out, lse


def chunked_attention_bwd(bwd, bytes_per_score, ctx, dout, q, k, v, out, lse, attn_mask, causal, scale, *,
                          impl=None):
    """bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale) -> (dq, dk, dv), over query chunks."""
    sq = q.shape[2]
    rows = attention_rows(ctx, q, k, bytes_per_score)
    if rows >= sq or not chunk_accepted(impl, ctx, q, k, rows, causal):
        return bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale)
    acc = _acc(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for a in range(0, sq, rows):
        e = min(sq, a + rows)
        kc, vc, mc, sk_c = _chunk_inputs(k, v, attn_mask, causal, sq, a, e)
        if sk_c <= 0:
            dq[:, :, a:e] = 0
            continue
        dq_c, dk_c, dv_c = bwd(ctx, dout[:, :, a:e], q[:, :, a:e], kc, vc, out[:, :, a:e], lse[:, :, a:e], mc,
                               causal, scale)
        dq[:, :, a:e] = dq_c
        dk[:, :, :sk_c] += dk_c
        dv[:, :, :sk_c] += dv_c
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ---- gemm / swiglu_gemm ---------------------------------------------------------------------------
def _rows(x) -> int:
    return x.numel() // x.shape[-1]


def chunked_gemm_fwd(fn, factor, ctx, a, b, bias, activation, residual, alpha):
    n, kdim = b.shape[1], a.shape[-1]
    m = _rows(a)
    rows = chunk_rows(m, factor * n * 4, workspace_cap(ctx))
    if rows >= m:
        return fn(ctx, a, b, bias, activation, residual, alpha)
    a2 = a.reshape(m, kdim)
    r2 = residual.reshape(m, n) if residual is not None else None
    out = a.new_empty((m, n))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        out[r0:r1] = fn(ctx, a2[r0:r1], b, bias, activation, r2[r0:r1] if r2 is not None else None, alpha)
    return out.reshape(*a.shape[:-1], n)


def chunked_gemm_bwd(bwd, factor, ctx, grad, a, b, bias, activation, alpha):
    n, kdim = b.shape[1], a.shape[-1]
    m = _rows(a)
    rows = chunk_rows(m, (factor + BWD_EXTRA_FACTOR) * n * 4, workspace_cap(ctx))
    if rows >= m:
        return bwd(ctx, grad, a, b, bias, activation, alpha)
    return _rowwise_bwd(lambda g, x: bwd(ctx, g, x, b, bias, activation, alpha), grad.reshape(m, n),
                        a.reshape(m, kdim), a.shape, b, bias, rows)


def chunked_swiglu_fwd(fn, factor, ctx, x, w, bias):
    n, kdim = w.shape[1] // 2, x.shape[-1]
    m = _rows(x)
    rows = chunk_rows(m, factor * n * 4, workspace_cap(ctx))
    if rows >= m:
        return fn(ctx, x, w, bias)
    x2 = x.reshape(m, kdim)
    out = x.new_empty((m, n))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        out[r0:r1] = fn(ctx, x2[r0:r1], w, bias)
    return out.reshape(*x.shape[:-1], n)


def chunked_swiglu_bwd(bwd, factor, ctx, grad, x, w, bias):
    n, kdim = w.shape[1] // 2, x.shape[-1]
    m = _rows(x)
    rows = chunk_rows(m, (factor + BWD_EXTRA_FACTOR) * 2 * n * 4, workspace_cap(ctx))
    if rows >= m:
        return bwd(ctx, grad, x, w, bias)
    return _rowwise_bwd(lambda g, x_: bwd(ctx, g, x_, w, bias), grad.reshape(m, n), x.reshape(m, kdim), x.shape,
                        w, bias, rows)


def _rowwise_bwd(call, g2, x2, x_shape, w, bias, rows):
    """d_input per row chunk; d_weight and d_bias summed over chunks in float32."""
    m = x2.shape[0]
    acc = _acc(w.dtype)
    dx = x2.new_empty(x2.shape)
    dw = torch.zeros(w.shape, dtype=acc, device=w.device)
    db = torch.zeros(bias.shape, dtype=acc, device=w.device) if bias is not None else None
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        dx_c, dw_c, db_c = call(g2[r0:r1], x2[r0:r1])
        dx[r0:r1] = dx_c
        dw += dw_c
        if db is not None and db_c.numel():
            db += db_c
    dbias = db.to(bias.dtype) if db is not None else x2.new_empty((0,))
    return dx.reshape(x_shape), dw.to(w.dtype), dbias


def gemm_factor(impl) -> float:
    """Multiples of (rows x N x 4 bytes) of forward temporaries, from the impl's declared memory traits."""
    m = impl.memory
    return GEMM_DEFAULT_FACTOR if m is None else m.temp_factor


def attn_bytes_per_score(impl) -> float:
    """Transient bytes per (query row x key), from the impl's declared memory traits ("flash": 0)."""
    m = impl.memory
    return ATTN_DEFAULT_BYTES_PER_SCORE if m is None else m.bytes_per_score


def expands_kv(impl) -> bool:
    """Does the impl copy K/V to every query head for GQA (declared memory traits)?"""
    return impl.memory is not None and impl.memory.expands_kv


# ---- paged_attention: split-KV partials ----------------------------------------------------------------
def paged_split_bytes(q) -> int:
    """Bytes one KV split of paged_attention keeps: float32 partial out (rows, Hq, D) and lse (rows, Hq)."""
    d = q.shape[-1]
    return q.numel() // max(d, 1) * (d + 1) * 4


class _BoundedCtx:
    """The impl's context with the split-capped profile (ResolveContext's attributes)."""
    __slots__ = ("env", "profile", "options", "spec")

    def __init__(self, env, profile, options, spec):
        self.env, self.profile, self.options, self.spec = env, profile, options, spec


_SPLIT_CAPPED: dict[tuple[int, int], tuple] = {}    # (id(profile), max splits) -> (profile, its capped copy)


def max_paged_splits(ctx, q) -> int:
    """The most KV splits whose partials fit the workspace cap (1: no split, no partials)."""
    return max(1, workspace_cap(ctx) // max(1, paged_split_bytes(q)))


def bounded_paged_fwd(fn, ctx, q, *args):
    """paged_attention's fn with at most max_paged_splits splits (the kernel's num_splits reads
    tiles["paged_attention"]["max_splits"])."""
    limit = max_paged_splits(ctx, q)
    prof = ctx.profile if ctx.profile is not None else JETSON
    hit = _SPLIT_CAPPED.get((id(prof), limit))
    if hit is None or hit[0] is not prof:
        t = dict((prof.tiles or {}).get("paged_attention") or {})
        t["max_splits"] = min(t.get("max_splits", MAX_SPLITS), limit)
        hit = (prof, dataclasses.replace(prof, tiles={**prof.tiles, "paged_attention": t}))
        if len(_SPLIT_CAPPED) > 64:
            _SPLIT_CAPPED.clear()
        _SPLIT_CAPPED[(id(prof), limit)] = hit
    return fn(_BoundedCtx(ctx.env, hit[1], ctx.options, ctx.spec), q, *args)


def policy_cap() -> int:
    """The workspace cap under the policy in force (for check(), which sees no ResolveContext)."""
    budget = current_policy().option_dict.get("memory_budget")
    cap = JETSON.workspace_cap_bytes or DEFAULT_CAP
    return min(cap, budget // 4) if isinstance(budget, int) and budget > 0 else cap


def kv_expand_check(spec, env) -> list[str]:
    """Impls that copy K/V to every query head (GQA) are refused when the copies exceed the cap."""
    if "gqa" not in spec.features or len(spec.shapes) < 2:
        return []
    (b, hq, _sq, d), (_b, _hkv, sk, _d) = spec.shapes[0], spec.shapes[1]
    need = 2 * b * hq * sk * d * spec.dtype.itemsize * (2 if spec.backward else 1)
    cap = policy_cap()
    if need > cap:
        return [f"expands K/V to {hq} heads for GQA: {need / 2 ** 20:.0f} MiB > the {cap / 2 ** 20:.0f} MiB "
                "workspace cap (jetson profile)"]
    return []


__all__ = ["chunked_attention_fwd", "chunked_attention_bwd", "chunked_gemm_fwd", "chunked_gemm_bwd",
           "chunked_swiglu_fwd", "chunked_swiglu_bwd", "workspace_cap", "chunk_rows", "gemm_factor",
           "attn_bytes_per_score", "expands_kv", "paged_split_bytes", "max_paged_splits", "bounded_paged_fwd"]
