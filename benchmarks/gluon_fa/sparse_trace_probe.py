"""Where a work item's time goes inside the Gluon sparse forward, on an H100/H200: the TRACE build of the kernel
(gluon_sparse.launch_args(trace=...), _gluon_sparse_kernel._stamp) writes each consumer warpgroup's %clock64 at
seven points of every item; this probe turns them into per-phase cycle counts at s16384 d128 bf16 b1 h32 causal
windows, for the default and pingpong_st3 schedules with the interval mask (what auto_schedule runs).

  PYTHONPATH=. python benchmarks/gluon_fa/sparse_trace_probe.py OUT.json

Phases per item and warpgroup (cycles; stamps 0-6): q_wait (item start -> its Q ready), first_s (-> S_0 retired),
softmax0 (-> its softmax done), per_tile (the tile loops / (n_all - 1)), last_pv (-> the last P V retired),
epilogue (-> O and lse stored), gap (this item's end -> the CTA's next item's start on the same warpgroup).
"fixed" = item cycles - per_tile x n_all: the boundary cost the suite's fits see (sparse_boundary_probe.py).
The traced kernel is timed next to the untraced one: the stamps cost a few spills outside the tile loops (sm_90
compile: default 10-17 STL/LDL, pingpong_st3 2-7, 0 inside the loops), so "trace_overhead" says how far the
traced timeline is from the real one.  Items are dealt to CTAs as the kernel does (item_order when ORDER)."""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _sparse_windows import D, GS, H, dense_baseline, inputs, ms, report_header, window_case  # noqa: E402

WINDOWS = [int(w) for w in os.environ.get("TRACE_WINDOWS", "1024,2048").split(",")]
SCHEDULES = {"default_interval": {"persistent": True, "mask": "interval"},
             "pingpong_st3_interval": {"persistent": True, **GS.VARIANTS["pingpong_st3_interval"]}}
PHASES = ("q_wait", "first_s", "softmax0", "loops", "last_pv", "epilogue")


def slot_tiles(ti, n_m: int, order: bool, nprog: int) -> torch.Tensor:
    """Visited tiles of the item each slot runs (the kernel's item numbering, _item; causal items reversed)."""
    n_all = ti.rows[..., 1].expand(1, H, n_m)
    per_item = n_all.flip(-1).reshape(-1)                 # REVERSE: causal layouts walk query tiles backwards
    if not order:
        return per_item.long()
    return per_item[GS.item_order(ti, 1, H, n_m, True, nprog).long()].long()


def phases(trace: torch.Tensor, tiles: torch.Tensor, nwg: int, nprog: int) -> dict:
    """Mean cycles of each phase over items with >= 2 tiles, plus gap and fixed (module docstring)."""
    t = trace[:, :nwg].double()                           # (slots, wg, 8)
    d = t[:, :, 1:7] - t[:, :, 0:6]                       # the six phases
    many = tiles >= 2
    out = {name: float(d[many, :, i].mean()) for i, name in enumerate(PHASES)}
    per_tile = d[many, :, 3] / (tiles[many, None].double() - 1)
    out["per_tile"] = float(per_tile.mean())
    item = t[:, :, 6] - t[:, :, 0]
    out["item"] = float(item[many].mean())
    out["fixed"] = float((item[many] - per_tile.mean() * tiles[many, None].double()).mean())
    out["fixed_in_tiles"] = out["fixed"] / out["per_tile"]
    n = trace.shape[0]
    nxt = torch.arange(n) + nprog                         # the same CTA's next slot (persistent grid)
    has = nxt < n
    gap = t[nxt[has], :, 0] - t[has][:, :, 6]
    out["gap"] = float(gap.mean()) if gap.numel() else 0.0
    cta = torch.arange(n) % nprog                         # clock64 is per SM: spans are taken per CTA
    spans = [float(t[cta == c][:, :, 6].max() - t[cta == c][:, :, 0].min()) for c in range(min(nprog, n))]
    out["cta_span_cycles_median"] = statistics.median(spans)
    return {k: round(v, 1) for k, v in out.items()}


def main(path: str) -> None:
    rows = []
    report = {**report_header(), "rows": rows, "phases": list(PHASES)}
    q, k, v = inputs()
    report["dense_ms"] = dense_baseline(q, k, v)[0]
    for w in WINDOWS:
        lay, args, ti, n_m, work = window_case(w)
        n_items = n_m * H
        nprog = min(n_items, torch.cuda.get_device_properties(0).multi_processor_count)
        for name, sched in SCHEDULES.items():
            trace = torch.full((n_items, 2, 8), -1, dtype=torch.int64, device="cuda")
            plain = lambda: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5, variant=sched)  # noqa: E731
            traced = lambda: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5,  # noqa: E731
                                           variant={**sched, "trace": trace})
            a, b = plain(), traced()
            torch.cuda.synchronize()
            nwg = 2 if sched.get("pingpong") else 1
            row = {"window": w, "schedule": name,
                   "same_output": bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])),
                   "all_stamped": bool((trace[:, :nwg, :7] >= 0).all()), "ms": ms(plain), "traced_ms": ms(traced)}
            row["trace_overhead"] = round(row["traced_ms"] / row["ms"], 4)
            resolved = GS.resolve_schedule(D, sched.get("stages"), None, sched.get("pingpong", False))
            order = GS.order_auto(True, 0, resolved)
            tiles = slot_tiles(ti, n_m, order, nprog)
            row["tiles_per_item"] = round(float(tiles.double().mean()), 3)
            row["cycles"] = phases(trace.cpu(), tiles.cpu(), nwg, nprog)
            # cycles per us from the CTAs' spans against the traced kernel time (the SM clock under this load)
            row["cycles_per_us"] = round(row["cycles"]["cta_span_cycles_median"] / (row["traced_ms"] * 1e3), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparse_trace_probe.json")
