"""Conformance cases of fp8_attention: e4m3 q, k, v with their descales, kept as built (Case.kept: the storage
format, not a precision to cast); the case dtype is the out_dtype."""
from __future__ import annotations

import torch

from opsadv.core.opdef import Case

from .reference import quantize_heads

_KEPT = frozenset({0, 1, 2, 3, 4, 5})


def fp8_inputs(b, hq, hkv, sq, sk, d, g, *, granularity="head", q_kv_head=False, device="cpu"):
    """(q8, k8, v8, q_descale, k_descale, v_descale) from random float64 tensors whose heads differ in magnitude
    (a descale applied to the wrong head shows); q_kv_head: q's descale per kv head (FA3's (b, h_kv)).  Used by
    the tests and the bench suite too."""
    def heads(h, s):
        mag = 2.0 ** (torch.arange(b * h, dtype=torch.float64) % 4 - 1.5).reshape(b, h, 1, 1)
        return torch.randn((b, h, s, d), generator=g, dtype=torch.float64) * mag
    q, k, v = heads(hq, sq), heads(hkv, sk), heads(hkv, sk)
    if q_kv_head:       # one amax per GQA group of q heads
        grp = hq // hkv
        amax = q.abs().reshape(b, hkv, grp, sq, d).amax(dim=(2, 3, 4))
        qd = (amax / 448.0).to(torch.float32)
        q8 = (q.to(torch.float32) / qd.repeat_interleave(grp, 1)[:, :, None, None]).clamp(-448, 448).to(
            torch.float8_e4m3fn)
    else:
        q8, qd = quantize_heads(q, granularity)
    k8, kd = quantize_heads(k, granularity)
    v8, vd = quantize_heads(v, granularity)
    return tuple(t.to(device) for t in (q8, k8, v8, qd, kd, vd))


def _fp8(b, hq, hkv, sq, sk, d, causal=False, **kw):
    def build(dtype, device, g):
        return fp8_inputs(b, hq, hkv, sq, sk, d, g, device=device, **kw), {"causal": causal, "out_dtype": dtype}
    return build


CASES = [
    Case("fp8_attention", "tiny", _fp8(1, 1, 1, 1, 1, 32), (), kept=_KEPT),
    Case("fp8_attention", "odd", _fp8(1, 3, 3, 127, 127, 64), (), kept=_KEPT),
    Case("fp8_attention", "causal", _fp8(1, 2, 2, 67, 67, 64, causal=True), (), kept=_KEPT),
    Case("fp8_attention", "gqa_kv_head_descale", _fp8(2, 4, 2, 37, 37, 64, q_kv_head=True), (), kept=_KEPT),
    Case("fp8_attention", "cross_causal", _fp8(1, 2, 2, 17, 83, 64, causal=True), (), kept=_KEPT),
    Case("fp8_attention", "q_longer_causal_tensor_descale",
         _fp8(1, 2, 1, 40, 19, 32, causal=True, granularity="tensor"), (), kept=_KEPT),
    Case("fp8_attention", "d128", _fp8(1, 2, 2, 65, 65, 128, causal=True), (), kept=_KEPT, quick=False),
]
