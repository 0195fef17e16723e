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

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import opsadv  # noqa: E402
from opsadv import SparseLayout  # noqa: E402
from opsadv.backends.cuda import gluon_sparse as GS  # noqa: E402
from opsadv.bench.suite_sparse import fwd_tiles  # noqa: E402

S, H, D = 16384, 32, 128
WINDOWS = [int(w) for w in os.environ.get("ORDER_WINDOWS", "1024,2048,4096,8192").split(",")]
ROUNDS = int(os.environ.get("ORDER_ROUNDS", "5"))


def ms(fn) -> float:
    return float(do_bench(fn, warmup=10, rep=80, return_mode="median"))


def main(path: str) -> None:
    rows = []
    report = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    with opsadv.use_backend("cuda", impls={"flash_attention": "cuda.gluon.flash_attention"}), torch.no_grad():
        dense = ms(lambda: opsadv.ops.flash_attention(q, k, v, causal=True))
    dense_tflops = 4.0 * H * S * S * D / 2 / dense / 1e9
    report["dense_ms"], report["dense_tflops"] = dense, round(dense_tflops, 1)
    for w in WINDOWS:
        lay = SparseLayout.sliding_window(S, w, causal=True, block_size=128, device="cuda")
        args = (lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal, lay.window_left,
                lay.window_right, lay.num_global)
        ti = GS.layout_index(*args, S, S)
        sched = GS.auto_schedule(D, ti, S // GS.TILE, None, 0)
        fns = {name: (lambda o=o: GS.sparse_fwd(None, q, k, v, *args, D ** -0.5, variant={**sched, "order": o}))
               for name, o in (("order", True), ("rr", False))}
        a, b = fns["order"](), fns["rr"]()
        row = {"window": w, "schedule": sched, "same_output": bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))}
        times = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                times[name].append(ms(fn))
        visited, total = fwd_tiles(lay, D)
        work = 4.0 * H * S * S * D * visited / total
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
