"""Short windows (s16384 h32 d128 bf16 causal, w128 / w256): the Gluon sparse forward's default and
pingpong_st3_kslot schedules called directly, next to the Triton sparse forward through the op (pinned), in
interleaved rounds; outputs checked against each other.  Says whether auto_schedule's ping-pong threshold
(gluon_sparse.SCHEDULE_PINGPONG_MIN_TILES, ~3 tiles per row since session 20) should also cover ~2-tile rows.

  PYTHONPATH=. python benchmarks/gluon_fa/sparse_short_rows_probe.py OUT.json"""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import opsadv  # noqa: E402
from _sparse_windows import D, GS, inputs, interleaved, report_header, window_case  # noqa: E402


def main(path: str) -> None:
    q, k, v = inputs()
    report = {**report_header(), "rows": []}
    for w in (128, 256):
        lay, args, ti, n_m, work = window_case(w)
        fns = {
            "gluon_default": lambda: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5,
                                                   variant={"persistent": True, "mask": "interval"}),
            "gluon_kslot": lambda: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5,
                                                 variant={**GS.VARIANTS["pingpong_st3_kslot"], "persistent": True}),
        }
        fns["triton_op"] = lambda: opsadv.ops.sparse_attention(q, k, v, lay, scale=D ** -0.5)
        # one backend context around everything (entered per call, its setup made the op host-bound: 0.47 ms at
        # w128 in d3a9f72's run, results/sparse_short_rows_s20_h200.json; the suite times it at 0.217)
        with opsadv.use_backend("cuda", autotune=False, impls={"sparse_attention": "cuda.triton.sparse_attention"}):
            outs = {n: f() for n, f in fns.items()}
            outs = {n: (o[0] if isinstance(o, tuple) else o).float() for n, o in outs.items()}
            ref = outs["triton_op"]
            row = {"window": w, "tiles_per_row": round(GS.tiles_per_row(ti, n_m), 3),
                   "max_abs_diff_vs_triton": {n: float((o - ref).abs().max()) for n, o in outs.items()}}
            times = interleaved(fns, 3)
        row["ms"] = {n: round(statistics.median(t), 4) for n, t in times.items()}
        row["ms_rounds"] = times
        report["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("window", "tiles_per_row", "ms", "max_abs_diff_vs_triton")}), flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparse_short_rows_probe.json")
