"""Where the Gluon sparse forward's time per work item goes, on an H100/H200: s16384 d128 bf16 b1 h32 causal windows,
kernels called directly (gluon_sparse.sparse_fwd with a variant), plus the Gluon dense causal forward (the issue's
effective-rate denominator).

  PYTHONPATH=. python benchmarks/gluon_fa/sparse_boundary_probe.py OUT.json

Variants (BOUNDARY_VARIANTS): the default and pingpong_st3 schedules with the element mask, the interval mask, and
"unmasked_probe" -- the same tile walk with no mask arithmetic at all (wrong results: a control whose time
difference is what the partial tiles' masks cost).  Each window: every variant's output compared with its twin
(bitwise: the interval mask changes no arithmetic) and with the float32 reference, then ROUNDS interleaved rounds
of triton.testing.do_bench (median, L2 flushed).  A fit of the median times over the windows (ms = fixed +
per_tile x tiles per item) splits each variant's time into a per-item part and a per-tile part; work counts
visited tiles of the suite's grid (bench.suite_sparse.fwd_tiles).

Session 19 (8c5ae80, results/sparse_boundary_s19_h200.json) also timed CARRY -- an item's last step issuing the
next item's first S beside its last P V -- and took it out again: bitwise right without ping-pong, but slower at
every window (w1024 0.837 vs 0.726 ms default, w2048 1.300 vs 1.219; with pingpong_st3 1.166 vs 1.093 at w2048), and
its ping-pong form spilled (d128 windows: 35 STL/LDL, 14 inside the tile loops) and, with 2 Q slots, gave wrong
results (max abs err 0.34; not pursued).  The interval mask: bitwise equal, 0.680 vs 0.726 ms at w1024 (default
schedule), 1.787 vs 1.819 at w4096 (pingpong_st3), a tie at w2048."""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _sparse_windows import D, GS, S, dense_baseline, inputs, interleaved, report_header, window_case  # noqa: E402

WINDOWS = [int(w) for w in os.environ.get("BOUNDARY_WINDOWS", "1024,2048,4096").split(",")]
ROUNDS = int(os.environ.get("BOUNDARY_ROUNDS", "3"))
REP = 60                # do_bench ms per timing
# name -> (variant, twin whose output it must equal bitwise or None)
BOUNDARY_VARIANTS = {
    "default": ({"persistent": True}, None),
    "default_interval": ({"persistent": True, "mask": "interval"}, "default"),
    "default_unmasked": ({"persistent": True, "mask": "unmasked_probe"}, None),
    "pingpong_st3": ({"persistent": True, "pingpong": True, "stages": 3}, None),
    "pingpong_st3_interval": ({"persistent": True, "pingpong": True, "stages": 3, "mask": "interval"},
                              "pingpong_st3"),
    "pingpong_st3_unmasked": ({"persistent": True, "pingpong": True, "stages": 3, "mask": "unmasked_probe"}, None),
}
ONLY = [n for n in os.environ.get("BOUNDARY_ONLY", "").split(",") if n]


def reference(q, k, v, lay) -> torch.Tensor:
    """float32 attention of the first 4 heads under the causal window (allowed: i - window_left <= j <= i), chunked
    over query rows (a dense s16384 mask would take 1 GiB per head)."""
    outs = []
    qf, kf, vf = (t[:, :4].float() for t in (q, k, v))
    j = torch.arange(S, device="cuda")[None, :]
    for r0 in range(0, S, 2048):
        r = torch.arange(r0, min(r0 + 2048, S), device="cuda")[:, None]
        ok = (j <= r) & (j >= r - lay.window_left)
        s = (qf[:, :, r0:r0 + 2048] @ kf.transpose(-1, -2)) * D ** -0.5
        outs.append(torch.softmax(s.masked_fill(~ok, float("-inf")), -1) @ vf)
    return torch.cat(outs, 2)


def fit(xs, ys):
    """Least-squares line ys = a + b xs: (a, b)."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    return my - b * mx, b


def main(path: str) -> None:
    rows = []
    report = {**report_header(), "rows": rows}
    q, k, v = inputs()
    dense, dense_tflops = dense_baseline(q, k, v, REP)
    report["dense_ms"], report["dense_tflops"] = dense, round(dense_tflops, 1)
    names = [n for n in BOUNDARY_VARIANTS if not ONLY or n in ONLY]
    for w in WINDOWS:
        lay, args, ti, n_m, work = window_case(w)
        row = {"window": w, "tiles_per_item": round(GS.tiles_per_row(ti, n_m), 3),
               "auto": GS.auto_schedule(D, ti, n_m, None, 0), "variants": {}}
        ref = reference(q, k, v, lay)
        fns, outs = {}, {}
        for name in names:
            variant = BOUNDARY_VARIANTS[name][0]
            fns[name] = lambda variant=variant: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5, variant=variant)
            try:
                outs[name] = fns[name]()
                torch.cuda.synchronize()
            except Exception as e:  # a variant that cannot run here is recorded, not fatal
                row["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
                fns.pop(name)
        for name in list(fns):
            out, lse = outs[name]
            twin = BOUNDARY_VARIANTS[name][1]
            rec = {"max_abs_err": float((out[:, :4].float() - ref).abs().max()),
                   "finite": bool(torch.isfinite(out).all())}
            if twin in outs:
                rec["equals_" + twin] = bool(torch.equal(out, outs[twin][0]) and torch.equal(lse, outs[twin][1]))
            row["variants"][name] = rec
        times = interleaved(fns, ROUNDS, REP)
        for name in fns:
            t = statistics.median(times[name])
            row["variants"][name].update(ms=round(t, 5), tflops=round(work / t / 1e9, 1),
                                         eff_vs_dense=round(work / t / 1e9 / dense_tflops, 4),
                                         ms_range=[round(min(times[name]), 5), round(max(times[name]), 5)])
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    fits = {}
    for name in names:
        pts = [(r["tiles_per_item"], r["variants"][name]["ms"]) for r in rows if "ms" in r["variants"].get(name, {})]
        if len(pts) >= 2:
            a, b = fit([p[0] for p in pts], [p[1] for p in pts])
            fits[name] = {"fixed_ms": round(a, 4), "per_tile_ms": round(b, 5), "fixed_in_tiles": round(a / b, 2)}
    report["fits"] = fits
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"dense_ms": dense, "dense_tflops": round(dense_tflops, 1), "fits": fits}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparse_boundary_probe.json")
