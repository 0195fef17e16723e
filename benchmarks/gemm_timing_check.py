"""Does the tuner's graph timing rank the GEMM impls right at BERT's shapes?  (GPU host)

The graph-timed e2e BERT tuning picked cuda.triton.gemm_persistent for every BERT GEMM in one run (96 calls)
and for 72 of 96 in another, while benchmarks/gemm_persistent_probe.py measured the bias-only BERT GEMMs at
0.80-0.82x cuBLAS.  For each BERT GEMM (bias; FFN1 bias+gelu) at the tuning row count (16384) and the real
packed one (12252): every accepted impl timed exactly as the tuner does (opsadv.core.tuning.time_fn, "graph"
and "wall"), twice, plus cuBLAS addmm through do_bench_cudagraph for reference.

  PYTHONPATH=. python3 benchmarks/gemm_timing_check.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys

import torch

import opsadv
from opsadv.core import dispatch, tuning

SHAPES = [(2304, 768, None), (768, 768, None), (3072, 768, "gelu"), (768, 3072, None)]   # (N, K, act)


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "gemm_timing_check.json"
    rows = []
    dt = torch.bfloat16
    with opsadv.use_backend("cuda"):
        for m in (16384, 12252):
            for n, k, act in SHAPES:
                a = torch.randn(m, k, device="cuda", dtype=dt)
                w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
                bias = torch.randn(n, device="cuda", dtype=dt)
                exp = opsadv.explain("gemm", a, w.t(), bias=bias, activation=act or "none")
                row = {"m": m, "n": n, "k": k, "act": act or "none", "chosen_by_priority": exp.chosen, "impls": {}}
                for c in exp.candidates:
                    if not c.accepted or c.impl.backend == "reference":
                        continue
                    with opsadv.use_backend("cuda", impls={"gemm": c.impl.id}):
                        dispatch.clear_cache()
                        fn = lambda: opsadv.ops.gemm(a, w.t(), bias=bias, activation=act or "none")   # noqa: E731
                        fn()
                        t = {}
                        for timing in ("graph", "wall", "graph", "wall"):
                            t.setdefault(timing, []).append(round(tuning.time_fn(fn, "cuda", timing=timing), 4))
                    row["impls"][c.impl.id] = t
                rows.append(row)
                print(json.dumps(row), flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("OPSADV_COMMIT", ""), "rows": rows}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
