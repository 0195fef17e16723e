"""Do TMA loads of the streamed tiles make our deterministic attention backward faster?  (issue 3: own fwd+bwd
0.81-0.87x cuDNN; the backward, 6.85 ms vs cuDNN's 5.34 at b4 h32 s4096 d128, is the limit.)

Compiled for sm_90 on CPU (session 10, tests/test_cuda_attention.py::test_backward_tma_loads_cut_spills_on_sm90):
the dK/dV kernel at its default 64x64/4/2 tile spills 44 B (non-causal) / 68 B (causal) at b4 s4096 d128 with
pointer loads, 0 / 32 B with q and dO through (b, h, s, d) descriptors; the dQ kernel's 128x64/8/3 drops from
206-215 to 158-162 registers.  This times the whole backward (both kernels, one forward's out / lse) with the
tile configs pinned: the current defaults, each dK/dV config with the default dQ one, each dQ config with the
default dK/dV one, and the all-TMA pair; next to cuDNN's backward.  A GPU check against float64 runs first
(bf16, ragged length, GQA, causal; NaN-poisoned outputs).

    PYTHONPATH=. python3 benchmarks/attn_bwd_tma_loads_probe.py OUT.json
    PROBE_DEVICE=cpu TRITON_INTERPRET=1 ...: a dry run of the logic on tiny shapes (no cuDNN)
"""
from __future__ import annotations

import os
import sys

import torch
from _attn_probe import ragged_gqa_case, timing_case  # (benchmarks/ is sys.path[0] when run as a script)
from _probe_log import record_case, warm_and_time

import opsadv
from opsadv.backends.cuda import attention as A

DEV = os.environ.get("PROBE_DEVICE", "cuda")
SHAPES = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True), (1, 32, 32, 16384, 128, True),
          (4, 32, 8, 4096, 128, True), (4, 32, 32, 4096, 64, True)]      # b, h, h_kv, s, d, causal
if DEV == "cpu":
    SHAPES = [(1, 2, 1, 70, 64, True)]


def _t(bm, bn, w, s, tma):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "TMA": tma}


# (dK/dV configs, dQ configs) per head-dim class; the first of each is the h100 profile's current default
KV = {128: [_t(64, 64, 4, 2, False), _t(64, 64, 4, 2, True), _t(64, 64, 4, 3, True), _t(32, 64, 4, 3, True),
            _t(64, 128, 8, 2, True)],
      64: [_t(64, 64, 4, 3, False), _t(64, 64, 4, 3, True), _t(64, 64, 4, 2, True), _t(32, 64, 4, 3, True)]}
Q = {128: [_t(128, 64, 8, 3, False), _t(128, 64, 8, 3, True), _t(64, 64, 4, 2, True), _t(128, 64, 8, 2, True)],
     64: [_t(128, 64, 8, 3, False), _t(128, 64, 8, 3, True), _t(64, 64, 4, 2, True)]}
if DEV == "cpu":
    KV = {64: [_t(16, 16, 4, 1, False), _t(16, 16, 4, 1, True)]}
    Q = {64: [_t(16, 16, 4, 1, False), _t(16, 16, 4, 1, True)]}


def _name(c) -> str:
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}/{c['num_warps']}/{c['num_stages']}{' tma' if c['TMA'] else ''}"


def _pinned(kv: dict, q: dict):
    """A backward running exactly these two configs (no tuning)."""
    def configs(ctx, which, d, tma_ok):
        c = {"bwd_kv": kv, "bwd_q": q}.get(which)
        if c is None:
            return ORIG_CONFIGS(ctx, which, d, tma_ok)
        return [{**A._FWD_FLAGS, **c, "TMA": c["TMA"] and tma_ok}]
    return configs


ORIG_CONFIGS = A._configs


def _bwd_with(kv, qc, ctx, *args):
    A._configs = _pinned(kv, qc)
    try:
        return A.flash_bwd(ctx, *args)
    finally:
        A._configs = ORIG_CONFIGS


def check() -> float:
    """Max relative error vs float64 of the all-TMA backward (and the used-TMA flag) at a ragged GQA shape."""
    os.environ["OPSADV_POISON_OUTPUTS"] = "1"
    ctx, do, q, k, v, o, lse = ragged_gqa_case(DEV)
    d = q.shape[-1]
    got = _bwd_with(KV[d][1], Q[d][1], ctx, do, q, k, v, o, lse, None, True, 0.1)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.flash_attention(q64, k64, v64, causal=True, scale=0.1)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    os.environ["OPSADV_POISON_OUTPUTS"] = "0"
    assert not any(torch.isnan(g).any() for g in got), "NaN in a gradient: an element was not written"
    return max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want))


def main(path: str) -> None:
    A._autotune = lambda ctx, device: False          # the pinned config runs, nothing is tuned
    res = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "check_rel_err": check(), "cases": []}
    print("all-TMA backward vs float64: rel err", res["check_rel_err"], flush=True)
    for b, h, hkv, s, d, causal in SHAPES:
        args, cudnn_bwd = timing_case(DEV, b, h, hkv, s, d, causal)
        kv0, q0 = KV[d][0], Q[d][0]
        pairs = [(kv0, q0)] + [(c, q0) for c in KV[d][1:]] + [(kv0, c) for c in Q[d][1:]] + [(KV[d][1], Q[d][1])]
        fns = {f"kv {_name(a)} | q {_name(c)}": (lambda a=a, c=c: _bwd_with(a, c, *args)) for a, c in pairs}
        if cudnn_bwd is not None:
            fns["cudnn"] = cudnn_bwd
        times = warm_and_time(fns)                    # every pinned pair compiled before any is timed
        base = times[f"kv {_name(kv0)} | q {_name(q0)}"]
        row = {"b": b, "h": h, "h_kv": hkv, "s": s, "d": d, "causal": causal,
               "ms": {n: round(t, 4) for n, t in times.items()},
               "vs_default": {n: round(base / t, 3) for n, t in times.items()}}
        record_case(res, path, row)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "attn_bwd_tma_loads_probe.json")
