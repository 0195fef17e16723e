"""Where a work item's time goes inside the Gluon sparse forward, on an H100/H200: the TRACE build of the kernel
(cuda/sparse_attention/gluon.py launch_args(trace=...), gluon_kernel.py _stamp) writes each consumer warpgroup's %clock64 at
seven points of every item; this probe turns them into per-phase cycle counts at s16384 d128 bf16 b1 h32 causal
windows, for the default and pingpong_st3 schedules with the interval mask (what auto_schedule runs).

  PYTHONPATH=. python benchmarks/gluon_fa/sparse_trace_probe.py OUT.json

Phases per item and warpgroup (cycles; the kernel's TRACE_STAMPS, in time order): decode (item start -> its tile
counts loaded), q_wait (-> its Q ready), first_s (-> S_0 retired), softmax0 (-> its softmax done), loops (the tile
loops; per_tile = loops / (n_all - 1)), last_pv (-> the last P V retired), and the epilogue split into release
(-> the last slot freed, or not yet with o_kslot), redecode (-> the item read again), lse (-> O / l and lse
stored) and o_store (-> O stored from registers, or its TMA copy issued and -- except with o_kslot, which waits
for it at the next item's first S -- read); gap (this item's end -> the CTA's next item's start
on the same warpgroup).  A stamp marks when the instructions before it were issued; the two decode stamps wait for
their loads.  Means over items with >= 2 tiles; *_median: the medians.
"fixed" = item cycles - per_tile x n_all: the per-item boundary cost.
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
from opsadv.backends.cuda.sparse_attention import gluon_kernel as K  # noqa: E402

WINDOWS = [int(w) for w in os.environ.get("TRACE_WINDOWS", "1024,2048").split(",")]
ALL_SCHEDULES = {"default_interval": {"persistent": True, "mask": "interval"},
                 "st3_interval": {"persistent": True, "stages": 3, "mask": "interval"},
                 **{n: {"persistent": True, **GS.VARIANTS[n]} for n in ("pingpong_st3_interval", "pingpong_st3_kslot")}}
SCHEDULES = {n: ALL_SCHEDULES[n] for n in os.environ.get("TRACE_SCHEDULES", ",".join(ALL_SCHEDULES)).split(",")}
# (name, stamp at its start, stamp at its end): the kernel's stamps in time order
PHASES = (("decode", 0, 11), ("q_wait", 11, 1), ("first_s", 1, 2), ("softmax0", 2, 3), ("loops", 3, 4),
          ("last_pv", 4, 5), ("release", 5, 8), ("redecode", 8, 9), ("lse", 9, 10), ("o_store", 10, 6))
USED_STAMPS = sorted({k for _, a, b in PHASES for k in (a, b)})


def slot_tiles(ti, n_m: int, order: bool, nprog: int) -> torch.Tensor:
    """Visited tiles of the item each slot runs (the kernel's item numbering, _item; causal items reversed)."""
    n_all = ti.rows[..., 1].expand(1, H, n_m)
    per_item = n_all.flip(-1).reshape(-1)                 # REVERSE: causal layouts walk query tiles backwards
    if not order:
        return per_item.long()
    return per_item[GS.item_order(ti, 1, H, n_m, True, nprog).long()].long()


def phases(trace: torch.Tensor, tiles: torch.Tensor, nwg: int, nprog: int) -> dict:
    """Mean cycles of each phase over items with >= 2 tiles, plus gap and fixed (module docstring)."""
    t = trace[:, :nwg].double()                           # (slots, wg, TRACE_STAMPS)
    many = tiles >= 2
    out = {}
    for name, a, b in PHASES:
        d = t[many, :, b] - t[many, :, a]
        out[name], out[name + "_median"] = float(d.mean()), float(d.median())
    per_tile = (t[many, :, 4] - t[many, :, 3]) / (tiles[many, None].double() - 1)
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
    report = {**report_header(), "rows": rows, "phases": [p[0] for p in PHASES]}
    q, k, v = inputs()
    report["dense_ms"] = dense_baseline(q, k, v)[0]
    for w in WINDOWS:
        lay, args, ti, n_m, work = window_case(w)
        n_items = n_m * H
        nprog = min(n_items, torch.cuda.get_device_properties(0).multi_processor_count)
        for name, sched in SCHEDULES.items():
            trace = torch.full((n_items, 2, K.TRACE_STAMPS.value), -1, dtype=torch.int64, device="cuda")
            plain = lambda: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5, variant=sched)  # noqa: E731
            traced = lambda: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5,  # noqa: E731
                                           variant={**sched, "trace": trace})
            a, b = plain(), traced()
            torch.cuda.synchronize()
            nwg = 2 if sched.get("pingpong") else 1
            row = {"window": w, "schedule": name,
                   "same_output": bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])),
                   "all_stamped": bool((trace[:, :nwg, USED_STAMPS] >= 0).all()), "ms": ms(plain),
                   "traced_ms": ms(traced)}
            row["trace_overhead"] = round(row["traced_ms"] / row["ms"], 4)
            resolved = GS.resolve_schedule(D, sched.get("stages"), None, sched.get("pingpong", False),
                                           o_kslot=sched.get("o_kslot", False))
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
