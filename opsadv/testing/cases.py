"""The conformance case catalogue: per op, shape classes (odd sizes 1, 3, 127, non-powers of
two; causal, GQA, cross-length, masks ...) and a tolerance row per dtype.

A case builds fresh random inputs from a seed, calls the public op, and names the inputs that
receive gradients.  The runner compares every impl with the reference backend in float64."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import opsadv
from opsadv.core.layout import SparseLayout

# The conformance rule (after FlashAttention-3's test suite): against the float64 oracle, an impl's error may be at
# most BASELINE_FACTOR x the error of the reference backend run on the same low-precision inputs (plain torch,
# float32 accumulation, outputs stored in the input dtype), plus a floor relative to the oracle's norm:
#     ||impl - oracle|| <= k * ||baseline - oracle|| + floor * ||oracle||      (forward outputs, then gradients)
# The floors stay below 1% so a 1% error fails in every dtype; the "tf32" row holds float32 cells computed in tf32
# under a precision policy (precision="tf32"), float32's own row true float32 kernels.
BASELINE_FACTOR = (3.0, 3.0)            # (forward, backward)
TOLERANCE = {                           # floor (forward, backward), relative to the oracle's norm
    torch.float64: (1e-9, 1e-8),
    torch.float32: (1e-5, 2e-5),
    "tf32": (2e-3, 3e-3),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (2e-3, 3e-3),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Case:
    op: str
    shape_class: str
    build: Callable[[torch.dtype, str, torch.Generator], tuple[tuple, dict]]   # -> (args, kwargs)
    grad_args: tuple[int, ...]                    # positional args that get gradients
    quick: bool = True                            # part of --quick
    multi_output: bool = False                    # op returns (y, sum) (norms with residual)
    tags: frozenset[str] = field(default_factory=frozenset)

    @property
    def name(self) -> str:
        return f"{self.op}/{self.shape_class}"


def _r(shape, dtype, device, g, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


# ---- attention ---------------------------------------------------------------------------------
def _attn(b, hq, hkv, sq, sk, d, causal=False, mask=None):
    def build(dtype, device, g):
        q, k, v = _r((b, hq, sq, d), dtype, device, g), _r((b, hkv, sk, d), dtype, device, g), _r((b, hkv, sk, d), dtype, device, g)
        kw: dict[str, Any] = {"causal": causal}
        if mask == "bool":
            m = torch.rand((b, 1, sq, sk), generator=g) > 0.3
            m[:, :, 0, :] = False                 # one fully masked row: must give zeros, not NaN
            kw["attn_mask"] = m.to(device)
        elif mask == "float":
            kw["attn_mask"] = _r((1, hq, sq, sk), dtype, device, g)
        return (q, k, v), kw
    return build


ATTENTION = [
    Case("flash_attention", "tiny", _attn(1, 1, 1, 1, 1, 32), (0, 1, 2)),
    Case("flash_attention", "odd", _attn(1, 3, 3, 127, 127, 64), (0, 1, 2)),
    Case("flash_attention", "causal", _attn(1, 2, 2, 67, 67, 64, causal=True), (0, 1, 2)),
    Case("flash_attention", "gqa", _attn(2, 4, 2, 37, 37, 64), (0, 1, 2)),
    Case("flash_attention", "mqa_causal", _attn(1, 4, 1, 45, 45, 32, causal=True), (0, 1, 2)),
    Case("flash_attention", "cross", _attn(1, 2, 2, 3, 130, 64), (0, 1, 2)),
    Case("flash_attention", "cross_causal", _attn(1, 2, 2, 17, 83, 64, causal=True), (0, 1, 2)),
    Case("flash_attention", "decode", _attn(2, 4, 2, 1, 77, 64, causal=True), (0, 1, 2)),
    Case("flash_attention", "q_longer_causal", _attn(1, 2, 2, 40, 19, 32, causal=True), (0, 1, 2)),
    Case("flash_attention", "mask_bool", _attn(1, 2, 2, 33, 47, 64, mask="bool"), (0, 1, 2)),
    Case("flash_attention", "mask_float", _attn(1, 2, 2, 29, 29, 64, mask="float"), (0, 1, 2), quick=False),
    Case("flash_attention", "d128", _attn(1, 2, 2, 65, 65, 128, causal=True), (0, 1, 2), quick=False),
    Case("flash_attention", "d96", _attn(1, 2, 1, 33, 33, 96), (0, 1, 2), quick=False),
    Case("flash_attention", "d256", _attn(1, 1, 1, 31, 31, 256, causal=True), (0, 1, 2), quick=False),
]


# ---- sparse attention ----------------------------------------------------------------------------
def _sparse(b, hq, hkv, s, d, bs, make_layout):
    def build(dtype, device, g):
        q, k, v = _r((b, hq, s, d), dtype, device, g), _r((b, hkv, s, d), dtype, device, g), _r((b, hkv, s, d), dtype, device, g)
        return (q, k, v, make_layout(device, g)), {}
    return build


def _blocks(s, bs, device, value=False):
    n = -(-s // bs)
    return torch.full((1, 1, n, n), value, dtype=torch.bool, device=device)


def _window(s, bs, causal, w):
    return lambda device, g: SparseLayout(s, s, bs, _blocks(s, bs, device), causal=causal,
                                          window=(w, 0 if causal else w))


def _global_window(s, bs):
    return lambda device, g: SparseLayout(s, s, bs, _blocks(s, bs, device), window=(9, 9), num_global=3)


def _random_blocks(b, h, s, bs):
    def make(device, g):
        n = -(-s // bs)
        bm = torch.rand((b, h, n, n), generator=g) > 0.6
        bm[..., 0, :] = False                      # a q block with no blocks: rows give zeros
        return SparseLayout(s, s, bs, bm.to(device))
    return make


def _padding(b, s, bs):
    def make(device, g):
        lens = torch.randint(1, s + 1, (b,), generator=g)
        kpm = torch.arange(s)[None, :] < lens[:, None]
        return SparseLayout(s, s, bs, _blocks(s, bs, device, True), causal=True, key_padding_mask=kpm.to(device))
    return make


def _varlen(lens, bs):
    def make(device, g):
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        s = int(cu[-1])
        return SparseLayout(s, s, bs, _blocks(s, bs, device, True), causal=True, cu_seqlens=cu)
    return make


def _plain_varlen(lens, bs, causal):
    """A packed batch as SparseLayout.varlen builds it (dense_blocks / max_seqlen set: what vendor
    varlen kernels such as FA2's serve); empty and one-token segments included."""
    return lambda device, g: SparseLayout.varlen(lens, causal=causal, block_size=bs, device=device)


SPARSE = [
    Case("sparse_attention", "window_causal", _sparse(1, 2, 2, 130, 64, 32, _window(130, 32, True, 40)), (0, 1, 2)),
    Case("sparse_attention", "window_bidir", _sparse(1, 2, 1, 97, 32, 32, _window(97, 32, False, 20)), (0, 1, 2)),
    Case("sparse_attention", "global_window", _sparse(1, 2, 2, 77, 64, 16, _global_window(77, 16)), (0, 1, 2)),
    Case("sparse_attention", "block_mask", _sparse(2, 2, 2, 96, 64, 32, _random_blocks(2, 2, 96, 32)), (0, 1, 2)),
    Case("sparse_attention", "padding", _sparse(3, 2, 2, 50, 64, 16, _padding(3, 50, 16)), (0, 1, 2)),
    Case("sparse_attention", "varlen", _sparse(1, 2, 2, 1 + 37 + 64, 64, 16, _varlen([1, 37, 64], 16)), (0, 1, 2)),
    Case("sparse_attention", "varlen_plain", _sparse(1, 3, 3, 45 + 1 + 127, 64, 16, _plain_varlen([45, 0, 1, 127], 16,
                                                                                                   False)), (0, 1, 2)),
    Case("sparse_attention", "varlen_plain_gqa_causal", _sparse(1, 4, 2, 3 + 70 + 33, 32, 32,
                                                                _plain_varlen([3, 70, 0, 33], 32, True)), (0, 1, 2)),
]


# ---- gemm ----------------------------------------------------------------------------------------
def _gemm(m, k, n, activation="none", bias=False, residual=False, alpha=1.0, batch=None, transposed_b=False):
    def build(dtype, device, g):
        lead = (batch, m) if batch else (m,)
        a = _r(lead + (k,), dtype, device, g)
        b = _r((n, k), dtype, device, g, k ** -0.5).t() if transposed_b else _r((k, n), dtype, device, g, k ** -0.5)
        kw: dict[str, Any] = {"activation": activation, "alpha": alpha}
        if bias:
            kw["bias"] = _r((n,), dtype, device, g)
        if residual:
            kw["residual"] = _r(lead + (n,), dtype, device, g)
        return (a, b), kw
    return build


GEMM = [
    Case("gemm", "decode_m1", _gemm(1, 64, 32), (0, 1)),
    Case("gemm", "odd_bias_gelu_tanh", _gemm(3, 100, 48, "gelu_tanh", bias=True), (0, 1)),
    Case("gemm", "odd_silu_residual", _gemm(127, 96, 130, "silu", bias=True, residual=True), (0, 1)),
    Case("gemm", "relu_alpha", _gemm(17, 64, 64, "relu", alpha=0.5), (0, 1), quick=False),
    Case("gemm", "gelu_batched", _gemm(5, 64, 80, "gelu", bias=True, batch=2), (0, 1)),
    Case("gemm", "linear_weight_t", _gemm(33, 64, 40, "none", bias=True, transposed_b=True), (0, 1), quick=False),
]


def _swiglu(m, k, n, bias=False, batch=None):
    def build(dtype, device, g):
        lead = (batch, m) if batch else (m,)
        kw = {"bias": _r((2 * n,), dtype, device, g)} if bias else {}
        return (_r(lead + (k,), dtype, device, g), _r((k, 2 * n), dtype, device, g, k ** -0.5)), kw
    return build


SWIGLU = [
    Case("swiglu_gemm", "decode_m1", _swiglu(1, 64, 48), (0, 1)),
    Case("swiglu_gemm", "odd", _swiglu(127, 96, 65), (0, 1)),
    Case("swiglu_gemm", "batched_bias", _swiglu(3, 64, 40, bias=True, batch=2), (0, 1), quick=False),
]


def _swiglu_act(shape, noncontig=False):
    def build(dtype, device, g):
        if noncontig:          # gate_up rows strided (every other row of a larger buffer)
            return (_r((2 * shape[0],) + shape[1:], dtype, device, g)[::2],), {}
        return (_r(shape, dtype, device, g),), {}
    return build


SWIGLU_ACT = [
    Case("swiglu", "one_pair", _swiglu_act((1, 2)), (0,)),
    Case("swiglu", "odd", _swiglu_act((127, 2 * 65)), (0,)),
    Case("swiglu", "batched_wide", _swiglu_act((2, 3, 2 * 1100)), (0,), quick=False),
    Case("swiglu", "strided_rows", _swiglu_act((5, 2 * 40), noncontig=True), (0,), quick=False),
]


# ---- norms ---------------------------------------------------------------------------------------
def _norm(op, shape, weight=True, bias=True, residual=False, offset=0.0, noncontig=False):
    def build(dtype, device, g):
        n = shape[-1]
        x = _r(shape, dtype, device, g)
        if noncontig:
            x = _r(shape[:-1] + (2 * n,), dtype, device, g)[..., ::2]
        w = _r((n,), dtype, device, g) if weight else None
        kw: dict[str, Any] = {"residual": _r(shape, dtype, device, g)} if residual else {}
        if op == "layer_norm":
            return (x, w, _r((n,), dtype, device, g) if bias else None, 1e-5), kw
        if offset:
            kw["offset"] = offset
        return (x, w, 1e-6), kw
    return build


NORMS = []
for _op in ("layer_norm", "rms_norm"):
    NORMS += [
        Case(_op, "row1", _norm(_op, (1, 64)), (0, 1)),
        Case(_op, "odd", _norm(_op, (3, 100)), (0, 1)),
        Case(_op, "wide127", _norm(_op, (127, 257)), (0, 1)),
        Case(_op, "residual", _norm(_op, (2, 3, 96), residual=True), (0, 1), multi_output=True),
        Case(_op, "no_weight", _norm(_op, (5, 64), weight=False, bias=False), (0,), quick=False),
        Case(_op, "noncontig", _norm(_op, (4, 80), noncontig=True), (0, 1), quick=False),
    ]
NORMS.append(Case("rms_norm", "offset", _norm("rms_norm", (7, 128), offset=1.0), (0, 1)))



# ---- rotary embedding ------------------------------------------------------------------------------------
def _rotary(b, hq, hk, s, d, r=None, cos_batch=False, interleaved=False, positions=0, bshd=False):
    def build(dtype, device, g):
        rr = r or d
        q = _r((b, s, hq, d), dtype, device, g).transpose(1, 2) if bshd else _r((b, hq, s, d), dtype, device, g)
        k = _r((b, hk, s, d), dtype, device, g)
        kw: dict[str, Any] = {"interleaved": interleaved}
        if positions:               # a (P, R) table and gapped position ids
            cos, sin = _r((positions, rr), dtype, device, g), _r((positions, rr), dtype, device, g)
            kw["position_ids"] = torch.randint(0, positions, (b, s), generator=g).to(device)
        else:
            shape = (b, s, rr) if cos_batch else (s, rr)
            cos, sin = _r(shape, dtype, device, g), _r(shape, dtype, device, g)
        return (q, k, cos, sin), kw
    return build


ROTARY = [
    Case("rotary_embedding", "one_token", _rotary(1, 1, 1, 1, 2), (0, 1)),
    Case("rotary_embedding", "odd_gqa_bshd", _rotary(2, 3, 1, 127, 24, bshd=True, cos_batch=True), (0, 1)),
    Case("rotary_embedding", "partial", _rotary(1, 4, 2, 5, 40, r=16), (0, 1)),
    Case("rotary_embedding", "interleaved", _rotary(2, 2, 2, 3, 12, interleaved=True), (0, 1), quick=False),
    Case("rotary_embedding", "position_ids", _rotary(2, 4, 4, 9, 16, positions=50), (0, 1), quick=False),
]

CATALOGUE: list[Case] = ATTENTION + SPARSE + GEMM + SWIGLU + SWIGLU_ACT + NORMS + ROTARY


def call(case: Case, args: tuple, kwargs: dict):
    return getattr(opsadv.ops, case.op)(*args, **kwargs)
