"""Does launching the deterministic backward's two kernels (dK/dV, dQ) on two streams make it faster?  (issue 3:
own fwd+bwd needs the backward ~3-5% faster for 1.5x SDPA-flash.)  The kernels share only inputs; on one stream
each ends in a tail of partly idle SMs and runs alone with its own occupancy limit (dK/dV 64x64/4 warps at ~250
registers: 2 CTAs per SM; dQ 128x64/8 warps at ~160: 1), so side by side they may fill each other's gaps.

Times attention.flash_bwd at the h100 default tiles (no tuning) with CONCURRENT_BWD off and on, next to cuDNN's
backward; first checks on the GPU that both ways give bit-identical gradients (the kernels are deterministic)
and that no gradient element is left unwritten (NaN-poisoned outputs).

    PYTHONPATH=. python3 benchmarks/attn_bwd_streams_probe.py OUT.json
    PROBE_DEVICE=cpu TRITON_INTERPRET=1 ...: a dry run of the logic (streams need CUDA: both ways run serially)
"""
from __future__ import annotations

import os
import sys

import torch
from _attn_probe import ragged_gqa_case, timing_case  # (benchmarks/ is sys.path[0] when run as a script)
from _probe_log import record_case, warm_and_time

from opsadv.backends.cuda import attention as A

DEV = os.environ.get("PROBE_DEVICE", "cuda")
SHAPES = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True), (1, 32, 32, 16384, 128, False),
          (1, 32, 32, 16384, 128, True), (4, 32, 8, 4096, 128, True), (16, 32, 32, 1024, 128, False),
          (4, 32, 32, 4096, 64, False), (4, 32, 32, 4096, 64, True)]      # b, h, h_kv, s, d, causal
if DEV == "cpu":
    SHAPES = [(1, 2, 1, 70, 64, True)]


def _bwd(concurrent: bool, *args):
    A.CONCURRENT_BWD = concurrent
    try:
        return A.flash_bwd(*args)
    finally:
        A.CONCURRENT_BWD = False


def check() -> dict:
    """Both ways on a ragged GQA causal shape: identical gradients, none NaN."""
    os.environ["OPSADV_POISON_OUTPUTS"] = "1"
    ctx, do, q, k, v, o, lse = ragged_gqa_case(DEV)
    args = (ctx, do, q, k, v, o, lse, None, True, 0.1)
    serial, conc = _bwd(False, *args), _bwd(True, *args)
    os.environ["OPSADV_POISON_OUTPUTS"] = "0"
    return {"identical": all(torch.equal(a, b) for a, b in zip(serial, conc)),
            "nan": any(bool(torch.isnan(g).any()) for g in serial + conc)}


def main(path: str) -> None:
    A._autotune = lambda ctx, device: False          # the profile's first configs, nothing tuned
    res = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "check": check(), "cases": []}
    print("check", res["check"], flush=True)
    for b, h, hkv, s, d, causal in SHAPES:
        args, cudnn_bwd = timing_case(DEV, b, h, hkv, s, d, causal)
        fns = {"serial": lambda: _bwd(False, *args), "two_streams": lambda: _bwd(True, *args)}
        if cudnn_bwd is not None:
            fns["cudnn"] = cudnn_bwd
        times = warm_and_time(fns)
        row = {"b": b, "h": h, "h_kv": hkv, "s": s, "d": d, "causal": causal,
               "ms": {n: round(t, 4) for n, t in times.items()},
               "two_streams_vs_serial": round(times["serial"] / times["two_streams"], 3)}
        record_case(res, path, row)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "attn_bwd_streams_probe.json")
