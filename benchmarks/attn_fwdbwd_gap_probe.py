"""Where does own fwd+bwd lose time beyond its kernels?  (issue 3: s16384 causal own fwd+bwd read 16.67 ms at
e639c1a while the Gluon forward alone read 3.43 and the backward alone 12.35 in other runs: ~0.9 ms unaccounted;
cuDNN's fwd 3.88 + bwd 10.68 against its fwd+bwd 15.03 leaves 0.47.)

Per shape, interleaved in one run (opsadv.bench.runner.time_interleaved): the own forward (Gluon, as the suite's
"[own]" row), the own backward on that forward's outputs, both in sequence as the suite times them, and cuDNN's
three; then one profiled call of each fwd+bwd: the kernels' busy time against the call's span on the GPU (idle
gaps between kernels, launch waits) and time per kernel name.

    PYTHONPATH=. python3 benchmarks/attn_fwdbwd_gap_probe.py OUT.json
    PROBE_SHAPES=0,1 ...: a subset of SHAPES by index
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from _probe_log import record_case, warm_and_time

from opsadv.bench.suite_attention import _own
from opsadv.registry import get_registry

SHAPES = [(1, 32, 32, 16384, 128, True), (1, 32, 8, 16384, 128, True), (4, 32, 32, 4096, 128, True),
          (4, 32, 32, 4096, 128, False)]         # b, h, h_kv, s, d, causal
if os.environ.get("PROBE_SHAPES"):
    SHAPES = [SHAPES[int(i)] for i in os.environ["PROBE_SHAPES"].split(",")]


def timeline(fn) -> dict:
    """One profiled call: span of the GPU's kernels (first start to last end), their busy time (union of
    intervals), the idle rest, and us per kernel name (summed)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    ks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    if not ks:
        return {"error": "no kernel events"}
    busy, cur_s, cur_e = 0.0, ks[0][0], ks[0][1]
    for s, e, _ in ks[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in ks) - ks[0][0]
    per: dict = {}
    for s, e, n in ks:
        per[n[:50]] = round(per.get(n[:50], 0.0) + e - s, 1)
    gaps = sorted(((ks[i + 1][0] - max(e for _, e, _ in ks[:i + 1])), ks[i][2][:40], ks[i + 1][2][:40])
                  for i in range(len(ks) - 1))[-5:]
    return {"span_us": round(span, 1), "busy_us": round(busy, 1), "idle_us": round(span - busy, 1),
            "kernels": len(ks), "per_kernel_us": per,
            "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps if g > 0]}


def main(path: str) -> None:
    res = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
           "cases": []}
    cudnn = next(i for i in get_registry().impls_by_op["flash_attention"] if i.id == "cuda.sdpa.cudnn")
    for b, h, hkv, s, d, causal in SHAPES:
        torch.manual_seed(0)
        q, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = d ** -0.5
        impl, ctx = _own(q, k, causal, True)
        o, lse = impl.fn(ctx, q, k, v, None, causal, scale)
        co, clse = cudnn.fn(None, q, k, v, None, causal, scale)
        fns = {
            "own_fwd": lambda: impl.fn(ctx, q, k, v, None, causal, scale),
            "own_bwd": lambda: impl.backward(ctx, do, q, k, v, o, lse, None, causal, scale),
            "own_fwdbwd": lambda: impl.backward(ctx, do, q, k, v, *impl.fn(ctx, q, k, v, None, causal, scale),
                                                None, causal, scale),
            "cudnn_fwd": lambda: cudnn.fn(None, q, k, v, None, causal, scale),
            "cudnn_bwd": lambda: cudnn.backward(None, do, q, k, v, co, clse, None, causal, scale),
            "cudnn_fwdbwd": lambda: cudnn.backward(None, do, q, k, v, *cudnn.fn(None, q, k, v, None, causal, scale),
                                                   None, causal, scale),
        }
        ms = warm_and_time(fns)
        row = {"b": b, "h": h, "h_kv": hkv, "s": s, "d": d, "causal": causal, "own_impl": impl.id,
               "ms": {n: round(t, 4) for n, t in ms.items()},
               "own_unaccounted_ms": round(ms["own_fwdbwd"] - ms["own_fwd"] - ms["own_bwd"], 4),
               "cudnn_unaccounted_ms": round(ms["cudnn_fwdbwd"] - ms["cudnn_fwd"] - ms["cudnn_bwd"], 4),
               "own_vs_cudnn_fwdbwd": round(ms["cudnn_fwdbwd"] / ms["own_fwdbwd"], 4),
               "timeline": {n: timeline(fns[n]) for n in ("own_fwdbwd", "cudnn_fwdbwd", "own_bwd")}}
        record_case(res, path, row)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "attn_fwdbwd_gap_probe.json")
