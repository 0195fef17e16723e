"""Slot order A/B of the Gluon sparse forward on an H100/H200: item_order's balanced deal ("order") against the
round-robin it replaced ("rr"), each with the schedule auto_schedule() picks, at s16384 d128 bf16 b1 h32 causal
windows, kernels called directly; plus the Gluon dense causal forward (the issue's effective-rate denominator).

  PYTHONPATH=. python benchmarks/gluon_fa/sparse_order_probe.py OUT.json

Each window: outputs of both orders compared (bitwise: the order changes which CTA runs an item, not its
arithmetic), then ROUNDS interleaved rounds of triton.testing.do_bench (median, L2 flushed); "ratio" = the median
over rounds of rr ms / order ms (> 1: the balanced deal wins).  Work counts visited tiles of the suite's grid
(bench.suite_sparse.fwd_tiles), so "eff_vs_dense" is comparable with the suite's effective-rate ratio."""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _sparse_windows import D, GS, dense_baseline, inputs, interleaved, report_header, window_case  # noqa: E402

WINDOWS = [int(w) for w in os.environ.get("ORDER_WINDOWS", "1024,2048,4096,8192").split(",")]
ROUNDS = int(os.environ.get("ORDER_ROUNDS", "5"))


def main(path: str) -> None:
    rows = []
    report = {**report_header(), "rows": rows}
    q, k, v = inputs()
    dense, dense_tflops = dense_baseline(q, k, v)
    report["dense_ms"], report["dense_tflops"] = dense, round(dense_tflops, 1)
    for w in WINDOWS:
        lay, args, ti, n_m, work = window_case(w)
        sched = GS.auto_schedule(D, ti, n_m, None, 0)
        fns = {name: (lambda o=o: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5, variant={**sched, "order": o}))
               for name, o in (("order", True), ("rr", False))}
        a, b = fns["order"](), fns["rr"]()
        row = {"window": w, "schedule": sched, "same_output": bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))}
        times = interleaved(fns, ROUNDS)
        for name in fns:
            row[f"{name}_ms"] = statistics.median(times[name])
            row[f"{name}_tflops"] = round(work / row[f"{name}_ms"] / 1e9, 1)
            row[f"{name}_eff_vs_dense"] = round(row[f"{name}_tflops"] / dense_tflops, 4)
        row["ratio"] = round(statistics.median(x / y for x, y in zip(times["rr"], times["order"])), 4)
        row["ratio_range"] = [round(min(x / y for x, y in zip(times["rr"], times["order"])), 4),
                              round(max(x / y for x, y in zip(times["rr"], times["order"])), 4)]
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({"dense_ms": dense, "dense_tflops": round(dense_tflops, 1)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparse_order_probe.json")
