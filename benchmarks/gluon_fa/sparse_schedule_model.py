"""A timing model of the Gluon sparse forward's ping-pong schedule (two consumer warpgroups sharing one tensor core),
to weigh schedule ideas for the per-item fixed cost before building them (docs/performance.md sessions 20-22).

    python3 benchmarks/gluon_fa/sparse_schedule_model.py [--tiles 9] [--items 64]

Not a simulator of the GPU: each warpgroup is a sequence of steps (issue its GEMMs, wait, softmax, ...), the tensor
core runs the issued GEMMs one after another in issue order, and a turn rule says which warpgroup may issue next.
Costs are cycles per warpgroup, chosen so that the lockstep rule reproduces what the TRACE build measured on the H200
(sparse_trace_s20d_h200.json: ~2.7k cycles per tile-time, ~3.8k fixed per item = 1.4 tile-times; first S + its
softmax ~3.3k, epilogue ~2.1k).  Its output is a ranking and a rough size, not a promise: it ranked early S_0 at
+3.6% and the H200 measured that variant 3-5% slower (session 23, results/sparse_ab_s23_h200.json) -- the model has
no K/V ring (early S_0 holds the O tile in a ring slot across the next item's first S) and no register pressure.

Turn rules:
  lockstep -- the kernel today: the warpgroups alternate strictly, step for step (pingpong_st3_kslot);
  lag      -- the same alternation, warpgroup 1 one step behind (an idle turn at its start; session 20's sketch);
  greedy   -- no alternation: whichever warpgroup is ready first issues ("turn donation" at item boundaries), the
              warpgroups at most MAX_AHEAD steps apart (they read the same K/V tiles: the ring holds ~MAX_AHEAD + 1);
  greedyN  -- greedy with warpgroup 1 started N steps late, so the two reach their item boundaries N steps apart
              (needs a K/V ring of ~N + 2 tiles: 3 stages fit beside Q at d128).
"""
from __future__ import annotations

import argparse
import json

GEMM = 675          # one warpgroup's S = Q K^T or P V on a 64 x 128 x 128 tile (two per step: 2.7k per tile-time)
LATENCY = 250       # wgmma latency beyond its share of the tensor core (issue to first result)
SOFTMAX = 1000      # online softmax of a full tile (hidden under the other warpgroup's two GEMMs)
SOFTMAX_MASKED = 1500
RESCALE = 100       # O *= alpha after the P V wait
EPILOGUE = 2100     # lse + 1/l + the O copy issue (ping-pong warpgroups share issue slots: traced 2.1k)
N_PARTIAL = 2       # partial (masked) tiles per item, listed first (sliding window, causal)
MAX_AHEAD = 2       # greedy: steps one warpgroup may run ahead of the other beyond its start offset (ring depth)


def _steps(n_items: int, n_tiles: int, early_s0: bool = False):
    """Per warpgroup: a list of (gemm costs issued at this step, work after the first GEMM retires, work after the
    last retires, work right after the issue) for every step of every item: S_0; S_{j+1} + P_j V_j; the last P V.
    early_s0: the next item's S_0 is issued as soon as the last P V has retired and the epilogue runs under it (the
    S_0 softmax waits for both); the last item's epilogue stays after its P V."""
    steps = []
    for i in range(n_items):
        steps.append(([GEMM], SOFTMAX_MASKED, 0, EPILOGUE if early_s0 and i > 0 else 0))
        for j in range(1, n_tiles):
            steps.append(([GEMM, GEMM], SOFTMAX_MASKED if j < N_PARTIAL else SOFTMAX, RESCALE, 0))
        steps.append(([GEMM], 0, 0 if early_s0 and i < n_items - 1 else EPILOGUE, 0))
    return steps


def simulate(rule: str, n_items: int, n_tiles: int, early_s0: bool = False) -> float:
    """Cycles until both warpgroups finish n_items items of n_tiles tiles each."""
    offset = int(rule[6:]) if rule.startswith("greedy") and rule[6:] else 0
    steps = [_steps(n_items, n_tiles, early_s0) for _ in range(2)]
    nxt = [0, 0]                  # next step index per warpgroup
    ready = [0.0, 0.0]            # when each warpgroup can issue its next step
    tc_free = 0.0                 # when the tensor core has run every issued GEMM
    last = 1                      # warpgroup that issued last (warpgroup 0 goes first)
    idle = [False, rule == "lag"]  # lag: warpgroup 1 owes one idle turn first
    while nxt[0] < len(steps[0]) or nxt[1] < len(steps[1]):
        if rule in ("lockstep", "lag"):
            wg = 1 - last
            if nxt[wg] >= len(steps[wg]):                  # this one is done: the other keeps its turns
                wg = 1 - wg
            if idle[wg]:                                   # an idle turn: pass without issuing
                idle[wg] = False
                last = wg
                continue
        else:
            lead = [nxt[0] - nxt[1] - offset, nxt[1] - nxt[0] + offset]     # steps ahead of the planned gap
            cands = [w for w in (0, 1) if nxt[w] < len(steps[w]) and lead[w] < MAX_AHEAD]
            if not cands:
                cands = [w for w in (0, 1) if nxt[w] < len(steps[w])]
            wg = min(cands, key=lambda w: (ready[w], w == last))
        gemms, after_first, after_last, beside = steps[wg][nxt[wg]]
        t = ready[wg]
        done = []
        for cost in gemms:                                  # FIFO on the tensor core, in issue order
            start = max(t, tc_free)
            tc_free = start + cost
            done.append(tc_free + LATENCY)
        # the first GEMM's result -> its softmax (under the second GEMM); then the second's -> rescale / epilogue
        t1 = max(done[0], t + beside) + after_first
        ready[wg] = max(t1, done[-1]) + after_last
        nxt[wg] += 1
        last = wg
    return max(ready)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=float, default=8.7, help="tiles per item (w1024 at s16384: ~8.7)")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tile_time = 4 * GEMM          # both warpgroups' S and P V of one tile
    rows = {}
    for rule in ("lockstep", "lag", "greedy", "greedy2", "greedy4", "lockstep+early_s0", "greedy4+early_s0"):
        # per-item time at whole tile counts around the mean, interpolated
        base_rule, early = rule.split("+")[0], rule.endswith("+early_s0")
        lo, hi = int(args.tiles), int(args.tiles) + 1
        per = {n: simulate(base_rule, args.items, n, early) / args.items for n in (lo, hi)}
        at = per[lo] + (per[hi] - per[lo]) * (args.tiles - lo)
        fixed = at - args.tiles * tile_time
        rows[rule] = {"cycles_per_item": round(at), "fixed_tile_times": round(fixed / tile_time, 2)}
    base = rows["lockstep"]["cycles_per_item"]
    for rule, r in rows.items():
        r["speedup_vs_lockstep"] = round(base / r["cycles_per_item"], 3)
        print(f"{rule:18s} {r['cycles_per_item']:7d} cycles/item  fixed {r['fixed_tile_times']:.2f} tile-times  "
              f"{r['speedup_vs_lockstep']:.3f}x lockstep")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tiles_per_item": args.tiles, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
