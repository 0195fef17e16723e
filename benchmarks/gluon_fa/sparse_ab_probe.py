"""A/B of Gluon sparse forward builds at s16384 d128 bf16 b1 h32 causal windows (H100/H200): each build's output
checked against the first one's (bf16 rounding: another tile order sums differently), then all timed in
interleaved rounds (do_bench medians; the ratio to the first build per round, then the median ratio).

  PYTHONPATH=. AB_WINDOWS=256,1024,2048 AB_BUILDS=pingpong_st3_kslot,pingpong_st3_kslot:nolse \\
      python benchmarks/gluon_fa/sparse_ab_probe.py OUT.json

A build is a gluon_sparse.VARIANTS name, with ":nolse" for the no-lse build (need_lse=False: what no-grad calls
through the op run)."""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _sparse_windows import GS, D, dense_baseline, inputs, interleaved, report_header, window_case  # noqa: E402

WINDOWS = [int(w) for w in os.environ.get("AB_WINDOWS", "1024,2048").split(",")]
BUILDS = os.environ.get("AB_BUILDS", "pingpong_st3_kslot,pingpong_st3_kslot:nolse").split(",")
ROUNDS = int(os.environ.get("AB_ROUNDS", "5"))


def build_fn(name: str, q, k, v, args):
    variant, _, tag = name.partition(":")
    return lambda: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5, variant=variant, need_lse=tag != "nolse")


def main(path: str) -> None:
    rows = []
    report = {**report_header(), "builds": BUILDS, "rounds": ROUNDS, "rows": rows}
    q, k, v = inputs()
    report["dense_ms"], report["dense_tflops"] = dense_baseline(q, k, v)
    for w in WINDOWS:
        lay, args, ti, n_m, work = window_case(w)
        fns = {n: build_fn(n, q, k, v, args) for n in BUILDS}
        ref = fns[BUILDS[0]]()[0].float()
        checks = {}
        for n, fn in fns.items():
            out = fn()[0].float()
            checks[n] = {"max_abs_diff": float((out - ref).abs().max()), "nan": bool(torch.isnan(out).any())}
        times = interleaved(fns, ROUNDS)
        base = times[BUILDS[0]]
        for n in BUILDS:
            t = times[n]
            row = {"window": w, "build": n, "ms_median": round(statistics.median(t), 4),
                   "ms_rounds": [round(x, 4) for x in t],
                   "ratio_to_first_median": round(statistics.median(b / x for b, x in zip(base, t)), 4),
                   "effective_vs_dense": round(work / (statistics.median(t) * 1e9) / report["dense_tflops"], 4),
                   **checks[n]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparse_ab_probe.json")
