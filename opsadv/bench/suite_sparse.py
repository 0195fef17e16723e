"""Bench suite "sparse": opsadv.ops.sparse_attention against compiled FlexAttention with the same
mask (`flex`), SDPA with the dense boolean mask (`sdpa_masked`, where memory allows) and, for
packed variable-length batches, dense flash attention over the padded batch (`padded_dense`).

Cases (docs/performance.md): s=16384 sliding window 1024 causal; global tokens + window (Longformer);
a packed varlen batch with ~30% padding; key padding with ~30% padding as convert_model runs it for cross-attention
(s_q 128, s_k 512) and ModernBERT's local layers (window 64 each way, s 512 and 8192), against the dense mask; plus a window-size series (extra field `density`: the
fraction of (query, key) tiles computed) for the time-vs-density plot.  Work counts computed
tiles only: 4*b*h*s_q*s_k*d * (visited tiles / all tiles) of the forward kernel's tile grid,
forward+backward 3.5x, the backward alone ("bwd" rows: the forward's graph kept, only autograd.grad timed) 2.5x."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

import opsadv
from opsadv import SparseLayout
from opsadv.backends.cuda.flash_attention import gluon as gluon_attention
from opsadv.core.policy import current_policy, select_profile
from opsadv.registry import get_registry

from .case import BenchCase, flex_peer
from .runner import rel_err

DENSE_MASK_MAX_BYTES = 4 << 30      # sdpa_masked only where the (s_q, s_k) bool mask stays below this


def fwd_tiles(layout: SparseLayout, d: int) -> tuple[int, int]:
    """(visited, total) tiles of the forward kernel's grid for this layout (for work counting)."""
    from opsadv.backends.triton_common.sparse_attention import sparse as SP     # imports triton (optional)
    prof = None
    rec = get_registry().backends.get("cuda")
    if rec is not None and rec.available:
        prof = select_profile(rec, current_policy())
    (m, n, _, _), _, _ = SP.tiles_for(prof, d)
    ti = layout.tile_index(m, n)
    return ti.tiles, ti.total_tiles


def _run(fn, q, k, v, do, bwd):
    if not bwd:
        with torch.no_grad():
            return fn(q, k, v)
    return torch.autograd.grad(fn(q, k, v), (q, k, v), do)


def _backward_only(fn, q, k, v, do):
    """A callable timing the backward alone: the forward runs once (at the runner's first, untimed call),
    its graph is kept, and every call returns torch.autograd.grad(out, (q, k, v), do, retain_graph=True)."""
    kept = {}

    def call():
        if "out" not in kept:
            kept["out"] = fn(q, k, v)
        return torch.autograd.grad(kept["out"], (q, k, v), do, retain_graph=True)
    return call


def _inputs(b, h, hkv, sq, sk, d, dtype, dev, bwd, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(b, h, sq, d, device=dev, dtype=dtype, generator=g).requires_grad_(bwd)
    k = torch.randn(b, hkv, sk, d, device=dev, dtype=dtype, generator=g).requires_grad_(bwd)
    v = torch.randn(b, hkv, sk, d, device=dev, dtype=dtype, generator=g).requires_grad_(bwd)
    do = torch.randn(b, h, sq, d, device=dev, dtype=dtype, generator=g) if bwd else None
    return q, k, v, do


def pattern_case(name: str, layout: SparseLayout, mask_mod, *, b=1, h=32, d=128, dtype=torch.bfloat16, bwd=False,
                 extra_words=(), dev="cuda") -> BenchCase:
    """A block-sparse pattern over (b, h, s, d): opsadv vs flex (same mask) vs sdpa_masked.
    bwd: False (forward), True (forward + backward) or "only" (the backward alone, "bwd" rows)."""
    s = layout.seq_q
    q, k, v, do = _inputs(b, h, h, s, layout.seq_k, d, dtype, dev, bool(bwd))

    def timed(fn):
        return _backward_only(fn, q, k, v, do) if bwd == "only" else (lambda: _run(fn, q, k, v, do, bwd))
    peers = {}
    flex, make_mask = flex_peer()
    if flex is not None and dev == "cuda":
        bm = make_mask(mask_mod, None, None, s, layout.seq_k, device=dev)
        peers["flex"] = timed(lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm))
    if s * layout.seq_k <= DENSE_MASK_MAX_BYTES:
        dense = layout.dense_mask(device=dev)
        peers["sdpa_masked"] = timed(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=dense))
    visited, total = fwd_tiles(layout, d)
    frac = visited / total
    work = 4.0 * b * h * s * layout.seq_k * d * frac * {False: 1.0, True: 3.5, "only": 2.5}[bwd]
    words = [{False: "fwd", True: "fwd+bwd", "only": "bwd"}[bwd], {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
             f"b{b}", f"h{h}", f"s{s}", f"d{d}", name, *extra_words]
    return BenchCase(suite="sparse", case=" ".join(words),
                     opsadv=timed(lambda q_, k_, v_: opsadv.ops.sparse_attention(q_, k_, v_, layout)),
                     peers=peers, work=work, extra={"density": round(frac, 4)})


def window_case(s=16384, w=1024, causal=True, **kw) -> BenchCase:
    lay = SparseLayout.sliding_window(s, w, causal=causal, block_size=128, device="cuda")
    if causal:
        def mm(b, h, i, j):
            return (i >= j) & (i - j <= w)
    else:
        def mm(b, h, i, j):
            return (i - j <= w) & (j - i <= w)
    return pattern_case(f"sliding{w}" + (" causal" if causal else ""), lay, mm, **kw)


def global_window_case(s=16384, w=256, g=128, **kw) -> BenchCase:
    lay = SparseLayout.global_tokens(s, g, window=w, causal=False, block_size=128, device="cuda")

    def mm(b, h, i, j):
        return ((i - j <= w) & (j - i <= w)) | (i < g) | (j < g)
    return pattern_case(f"sliding{w} global{g}", lay, mm, **kw)


def padding_case(b=8, s_q=128, s_k=512, window=None, h=16, d=64, dtype=torch.bfloat16, bwd=False,
                 dev="cuda") -> BenchCase:
    """Key padding over a padded batch (~30% padding, lengths as varlen_lengths'), the layouts convert_model hands
    sparse_attention for an encoder-decoder's cross-attention (s_q != s_k) and for an encoder's bidirectional local
    layers (ModernBERT: `window` tokens each way, s_q == s_k): opsadv vs SDPA with the dense (b, 1, s_q, s_k) mask
    (what the unconverted model runs) and flex with the same mask."""
    lens = torch.tensor(varlen_lengths(b, s_k), device=dev)
    kpm = torch.arange(s_k, device=dev)[None, :] < lens[:, None]
    lay = SparseLayout.key_padding(kpm, seq_q=s_q, block_size=128)
    if window is not None:
        lay = SparseLayout.sliding_window(s_q, window, seq_k=s_k, causal=False, block_size=128,
                                          device=dev).with_(key_padding_mask=kpm)
    q, k, v, do = _inputs(b, h, h, s_q, s_k, d, dtype, dev, bwd)
    dense = lay.dense_mask(batch=b, device=dev)
    peers = {"sdpa_masked": lambda: _run(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=dense),
                                         q, k, v, do, bwd)}
    flex, make_mask = flex_peer()
    if flex is not None and dev == "cuda":
        w = window if window is not None else max(s_q, s_k)

        def mm(bb, hh, i, j):
            return kpm[bb, j] & (i - j <= w) & (j - i <= w)
        bm = make_mask(mm, b, None, s_q, s_k, device=dev)
        peers["flex"] = lambda: _run(lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm), q, k, v, do, bwd)
    visited, total = fwd_tiles(lay, d)
    frac = visited / total
    real = float(kpm.float().mean())
    work = 4.0 * b * h * s_q * s_k * d * frac * (3.5 if bwd else 1.0)
    words = ["fwd+bwd" if bwd else "fwd", {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], f"b{b}", f"h{h}",
             f"sq{s_q}", f"sk{s_k}", f"d{d}", "key_padding", f"pad{round(100 * (1 - real))}"]
    words += [f"bidir{window}"] if window is not None else ["cross"] if s_q != s_k else []
    return BenchCase(suite="sparse", case=" ".join(words),
                     opsadv=lambda: _run(lambda q_, k_, v_: opsadv.ops.sparse_attention(q_, k_, v_, lay),
                                         q, k, v, do, bwd),
                     peers=peers, work=work, extra={"density": round(frac, 4), "padding": round(1 - real, 3)})


def varlen_lengths(n: int, max_len: int, seed: int = 0) -> list[int]:
    """n lengths uniform in [0.4, 1.0] * max_len (about 30% padding), the longest = max_len."""
    g = torch.Generator().manual_seed(seed)
    lens = (max_len * (0.4 + 0.6 * torch.rand(n, generator=g))).long().clamp(1, max_len)
    lens[0] = max_len
    return lens.tolist()


def varlen_case(n=8, max_len=4096, h=16, d=128, causal=False, dtype=torch.bfloat16, bwd=False, dev="cuda") -> BenchCase:
    """Packed (1, h, total, d) varlen vs dense flash over the padded (n, h, max_len, d) batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lens = varlen_lengths(n, max_len)
    total = sum(lens)
    lay = SparseLayout.varlen(lens, causal=causal, block_size=128, device=dev)
    q, k, v, do = _inputs(1, h, h, total, total, d, dtype, dev, bwd)
    am = torch.zeros(n, max_len, dtype=torch.long, device=dev)
    for i, L in enumerate(lens):
        am[i, :L] = 1
    _, info = SparseLayout.unpad(torch.zeros(n, 1, max_len, 1, device=dev), am)
    qp, kp, vp = (SparseLayout.pad(t.detach(), info).requires_grad_(bwd) for t in (q, k, v))
    dop = SparseLayout.pad(do, info) if bwd else None

    def padded(q_, k_, v_):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
    peers = {"padded_dense": lambda: _run(padded, qp, kp, vp, dop, bwd)}
    flex, make_mask = flex_peer()
    if flex is not None and dev == "cuda":
        seg = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(lens, device=dev))

        def doc(b, hh, i, j):
            ok = seg[i] == seg[j]
            return (ok & (i >= j)) if causal else ok
        bm = make_mask(doc, None, None, total, total, device=dev)
        peers["flex"] = lambda: _run(lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm), q, k, v, do, bwd)

    def compare(mine, _peer):
        """The padded peer attends to padding (no mask in flash), so verify against flex, or
        against per-sequence SDPA when flex is absent."""
        if "flex" in peers:
            return rel_err(mine, peers["flex"]())
        ref = _run(lambda q_, k_, v_: torch.cat([F.scaled_dot_product_attention(
            q_[:, :, a:b], k_[:, :, a:b], v_[:, :, a:b], is_causal=causal) for a, b in zip(starts, starts[1:])], 2),
            q, k, v, do, bwd)
        return rel_err(mine, ref)
    starts = [0]
    for L in lens:
        starts.append(starts[-1] + L)
    visited, all_tiles = fwd_tiles(lay, d)
    frac = visited / all_tiles
    work = 4.0 * h * total * total * d * frac * (3.5 if bwd else 1.0)
    padding = 1 - total / (n * max_len)
    words = ["fwd+bwd" if bwd else "fwd", {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], f"n{n}", f"h{h}",
             f"s{max_len}", f"d{d}", "varlen", f"pad{round(100 * padding)}"] + (["causal"] if causal else [])
    return BenchCase(suite="sparse", case=" ".join(words),
                     opsadv=lambda: _run(lambda q_, k_, v_: opsadv.ops.sparse_attention(q_, k_, v_, lay),
                                         q, k, v, do, bwd),
                     peers=peers, work=work, compare=compare,
                     extra={"density": round(frac, 4), "padding": round(padding, 3), "tokens": total})


def cases(quick: bool) -> Iterator[BenchCase]:
    for bwd in (False, True):
        yield window_case(bwd=bwd)
        if bwd and not quick:
            yield window_case(bwd="only")       # the backward target, timed alone
        yield varlen_case(bwd=bwd)
        if not quick:
            yield global_window_case(bwd=bwd)
            yield varlen_case(bwd=bwd, causal=True)
    if not quick:
        for bwd in (False, True):                          # the padded layouts of cross-attention / ModernBERT
            yield padding_case(bwd=bwd)
            yield padding_case(b=32, s_q=512, s_k=512, window=64, bwd=bwd)
            yield padding_case(b=4, s_q=8192, s_k=8192, window=64, bwd=bwd)
        for w in (128, 256, 512, 2048, 4096, 8192):       # time vs density series (window 1024 above)
            yield window_case(w=w)
        yield from dense_own_cases()


def dense_own_case(s=16384, h=32, d=128, dtype=torch.bfloat16, dev="cuda",
                   impl_id="cuda.triton.flash_attention") -> BenchCase:
    """One of our dense flash kernels (pinned) at the window series' shape, causal: the TFLOP/s that the
    issue's "effective TFLOP/s >= 0.85x our dense kernel at density >= 1/16" compares against (the Triton
    kernel, and on Hopper also the faster Gluon one: see dense_own_cases).
    Work counts the causal half (4*h*s*s*d/2), as the attention suite does; peer: SDPA-cuDNN."""
    q, k, v, _ = _inputs(1, h, h, s, s, d, dtype, dev, False)
    pinned = {"impls": {"flash_attention": impl_id}}

    def ours():
        with opsadv.use_backend("cuda", **pinned), torch.no_grad():
            return opsadv.ops.flash_attention(q, k, v, causal=True)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    tag = "" if impl_id == "cuda.triton.flash_attention" else f" {impl_id.split('.')[1]}"
    return BenchCase(suite="sparse", case=f"fwd bf16 b1 h{h} s{s} d{d} dense causal{tag} [own]", opsadv=ours,
                     peers={"sdpa_cudnn": cudnn}, work=4.0 * h * s * s * d / 2,
                     impl=lambda: impl_id, extra={"dense_reference": True})


def dense_own_cases() -> Iterator[BenchCase]:
    """The dense reference rows: the Triton kernel, and the Gluon one where it can run (an sm_90 GPU with
    triton.experimental.gluon): the fastest own dense kernel is the fair denominator."""
    yield dense_own_case()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and not gluon_attention.UNAVAILABLE:
        yield dense_own_case(impl_id=gluon_attention.IMPL_ID)
