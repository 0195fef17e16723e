"""Does reducing dQ through TMA (one bulk reduce-add per tile, FA3's way) make the single-kernel atomic backward
(cuda.triton.flash_attention.atomic_dq: 5 GEMMs per tile, no dQ kernel) beat the deterministic two-kernel one
(7 GEMMs) and approach cuDNN's?  Session 4 measured the element-atomics version at 7.83 ms vs 6.7 (deterministic)
and ~5.5 (cuDNN) at b4 h32 s4096 d128 bf16 (results/attention_probe_h200.json).

Times, interleaved (5 rounds, do_bench each), the backward alone on one forward's out / lse: the deterministic
Triton backward, the atomic one (TMA reduce on Hopper), cuDNN's; checks the atomic one's grads against float64
at a small shape first (NaN-poisoned outputs).

    PYTHONPATH=. python3 benchmarks/attn_bwd_tma_probe.py OUT.json
    PROBE_DEVICE=cpu TRITON_INTERPRET=1 ...: a dry run of the script's logic on tiny shapes (element atomics, no cuDNN)
"""
from __future__ import annotations

import json
import os
import sys

import torch
from _probe_log import warm_and_time  # (benchmarks/ is sys.path[0] when run as a script)

import opsadv
from opsadv.backends.cuda import attention as A
from opsadv.core import dispatch
from opsadv.core.ops import attention as OA
from opsadv.registry import get_registry

DEV = os.environ.get("PROBE_DEVICE", "cuda")
SHAPES = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (1, 32, 16384, 128, True), (4, 32, 4096, 64, True)]
if DEV == "cpu":
    SHAPES = [(1, 2, 64, 64, True)]


def _ctx(q, k, causal):
    with opsadv.use_backend("cuda", experimental=True):
        _, r = dispatch.explain_spec(OA._spec(q, k, None, causal, True))
    return r.ctx


def check() -> float:
    os.environ["OPSADV_POISON_OUTPUTS"] = "1"
    torch.manual_seed(0)
    n, dt = (1000, torch.bfloat16) if DEV == "cuda" else (70, torch.float16)
    q = torch.randn(2, 8, n, 128, device=DEV, dtype=dt)
    k, v = (torch.randn(2, 4, n, 128, device=DEV, dtype=dt) for _ in range(2))
    do = torch.randn_like(q)
    ctx = _ctx(q, k, True)
    o, lse = A.flash_fwd(ctx, q, k, v, None, True, 0.1)
    got = A.flash_bwd_atomic(ctx, do, q, k, v, o, lse, None, True, 0.1)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = opsadv.ops.flash_attention(q64, k64, v64, causal=True, scale=0.1)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    os.environ["OPSADV_POISON_OUTPUTS"] = "0"
    return max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want))


def main(path: str) -> None:
    cudnn = next(i for i in get_registry().impls_by_op["flash_attention"] if i.id == "cuda.sdpa.cudnn")
    res = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
           "check_rel_err": check(), "cases": []}
    print("atomic (TMA) backward vs float64: rel err", res["check_rel_err"], flush=True)
    for b, h, s, d, causal in SHAPES:
        torch.manual_seed(0)
        dt = torch.bfloat16 if DEV == "cuda" else torch.float16
        q, k, v, do = (torch.randn(b, h, s, d, device=DEV, dtype=dt) for _ in range(4))
        ctx = _ctx(q, k, causal)
        o, lse = A.flash_fwd(ctx, q, k, v, None, causal, d ** -0.5)
        fns = {"triton_det": lambda: A.flash_bwd(ctx, do, q, k, v, o, lse, None, causal, d ** -0.5),
               "triton_atomic_tma": lambda: A.flash_bwd_atomic(ctx, do, q, k, v, o, lse, None, causal, d ** -0.5)}
        if DEV == "cuda":
            co, clse = cudnn.fn(None, q, k, v, None, causal, d ** -0.5)
            fns["cudnn"] = lambda: cudnn.backward(None, do, q, k, v, co, clse, None, causal, d ** -0.5)
        times = warm_and_time(fns)
        row = {"b": b, "h": h, "s": s, "d": d, "causal": causal, "ms": {n: round(t, 4) for n, t in times.items()}}
        print(row, flush=True)
        res["cases"].append(row)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "attn_bwd_tma_probe.json")
