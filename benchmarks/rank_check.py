"""On a GPU: which impl an untuned call runs where a KernelImpl.rank() applies, and is its output right.

For each case: opsadv.explain() under use_backend("auto") without autotune (the impl, its priority here and why),
a traced call (the impl that ran), the output against the pinned Triton impl in float32 terms, and the call's
time next to the pinned Triton impl's (triton.testing.do_bench medians, one backend context per timing).

    PYTHONPATH=. python benchmarks/rank_check.py OUT.json"""
from __future__ import annotations

import json
import os
import sys

import torch
from triton.testing import do_bench

import opsadv
from opsadv import SparseLayout


def _case(name, op, args, kwargs, triton_impl):
    with torch.no_grad():
        with opsadv.use_backend("auto"):
            exp = opsadv.explain(op, *args, **kwargs)
            with opsadv.trace() as t:
                out = getattr(opsadv.ops, op)(*args, **kwargs)
            ms_auto = do_bench(lambda: getattr(opsadv.ops, op)(*args, **kwargs), warmup=10, rep=80,
                               return_mode="median")
        with opsadv.use_backend("cuda", impls={op: triton_impl}):
            ref = getattr(opsadv.ops, op)(*args, **kwargs)
            ms_triton = do_bench(lambda: getattr(opsadv.ops, op)(*args, **kwargs), warmup=10, rep=80,
                                 return_mode="median")
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    chosen = next(c for c in exp.candidates if c.chosen)
    return {"case": name, "chosen": exp.chosen, "ran": sorted(t.counts), "priority": chosen.rank_priority,
            "why": exp.why, "rel_err_vs_triton": err, "nan": bool(torch.isnan(out).any()),
            "ms_auto": round(ms_auto, 4), "ms_triton_pinned": round(ms_triton, 4)}


def main(path: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = []
    q, k, v = rnd(1, 32, 16384, 128), rnd(1, 32, 16384, 128), rnd(1, 32, 16384, 128)
    for w in (256, 1024):          # w256: no rank (Triton first); w1024: the Gluon sparse impl ranked first
        lay = SparseLayout.sliding_window(16384, w, causal=True, block_size=128, device="cuda")
        rows.append(_case(f"sparse w{w} s16384 d128 causal", "sparse_attention", (q, k, v, lay), {},
                          "cuda.triton.sparse_attention"))
    qd, kd, vd = rnd(4, 32, 4096, 128), rnd(4, 32, 4096, 128), rnd(4, 32, 4096, 128)
    rows.append(_case("flash b4 h32 s4096 d128 causal (no grad)", "flash_attention", (qd, kd, vd), {"causal": True},
                      "cuda.triton.flash_attention"))
    rows.append(_case("flash b16 h32 s1024 d128 causal (no grad)", "flash_attention",
                      (rnd(16, 32, 1024, 128), rnd(16, 32, 1024, 128), rnd(16, 32, 1024, 128)), {"causal": True},
                      "cuda.triton.flash_attention"))
    report = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    for r in rows:
        print(json.dumps(r), flush=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
