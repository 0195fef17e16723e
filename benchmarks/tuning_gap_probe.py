"""Why does the impl tuner time the Gluon forward ~4% slower than the benchmark does? (Session 12, H200: the
fwd bf16 b4 h32 s4096 d128 causal inference bucket timed Gluon 1.047 / cuDNN 1.041 ms in tuning.json, and the
suite minutes later 1.008 / 1.067, so the bucket chose cuDNN.)  In one process, on that shape: the two impls'
inference forwards timed by the tuner's own `time_rounds` (spin-up, 5 rotated rounds of >= 8 calls) and by the
bench runner's `time_interleaved`, three times each, alternating; then the tuner's rounds again with the other
impls of the bucket in the race (flash, efficient, Triton: what the real tuning interleaves), and the op's
first call in a fresh cache (the dispatcher's own tuning, its times_ms).  Which measurement moves tells where
the gap comes from: the method (A vs B), the company in the race (C), or the moment right after the compiles (D).

    PYTHONPATH=. python3 benchmarks/tuning_gap_probe.py OUT.json
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import torch

import opsadv
from opsadv.bench.runner import time_interleaved
from opsadv.core import dispatch, tuning
from opsadv.core.ops import attention as A
from opsadv.core.policy import current_policy
from opsadv.registry import get_registry
from _probe_log import record_case  # (benchmarks/ is sys.path[0] when run as a script)

IMPLS = ("cuda.gluon.flash_attention", "cuda.sdpa.cudnn")
OTHERS = ("cuda.sdpa.flash", "cuda.sdpa.efficient", "cuda.triton.flash_attention")


def _steps(q, k, v, causal, scale, ids):
    """{impl id: its inference forward (what the infer bucket times)} for the impls that accept the case."""
    pol = dataclasses.replace(current_policy(), backend="cuda", autotune=False)
    exp, r = dispatch.explain_spec(A._spec(q, k, None, causal, False, inference=True), pol)
    accepted = {c.impl.id for c in exp.candidates if c.accepted}
    impls = {i.id: i for i in get_registry().impls_by_op["flash_attention"]}
    out = {}
    for i in ids:
        if i in accepted:
            run = impls[i].inference or impls[i].fn
            out[i] = (lambda run=run: run(r.ctx, q, k, v, None, causal, scale))
    return out


def main(path: str) -> None:
    b, h, s, d, causal = 4, 32, 4096, 128, True
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = d ** -0.5
    res = {"torch": torch.__version__, "shape": [b, h, s, d], "causal": causal, "records": []}

    def save(rec):
        record_case(res, path, rec, "records")

    with torch.no_grad():
        # D first: the dispatcher's own tuning in a fresh cache, right after the compiles (as in the suite)
        with tempfile.TemporaryDirectory() as tmp:
            old = os.environ.get("OPSADV_CACHE_DIR")
            os.environ["OPSADV_CACHE_DIR"] = tmp
            tuning.reload()
            dispatch.clear_cache()
            with opsadv.use_backend("auto", autotune=True):
                opsadv.ops.flash_attention(q, k, v, causal=causal)
                exp = opsadv.explain("flash_attention", q, k, v, causal=causal)
            save({"what": "D: dispatcher tuning, fresh cache", "chosen": exp.chosen, "why": exp.why[:300]})
            if old is None:
                os.environ.pop("OPSADV_CACHE_DIR", None)
            else:
                os.environ["OPSADV_CACHE_DIR"] = old
            tuning.reload()
            dispatch.clear_cache()
        pair = _steps(q, k, v, causal, scale, IMPLS)
        for f in pair.values():
            f()
        torch.cuda.synchronize()
        for rep in range(3):
            a = tuning.time_rounds(pair, "cuda", "wall")
            save({"what": f"A: tuner time_rounds, pair, rep {rep}", "ms": {n: round(t, 4) for n, t in a.items()}})
            bt = time_interleaved(pair)
            save({"what": f"B: bench time_interleaved, pair, rep {rep}", "ms": {n: round(t, 4) for n, t in bt.items()}})
        race = _steps(q, k, v, causal, scale, IMPLS + OTHERS)
        for f in race.values():
            f()
        for rep in range(2):
            c = tuning.time_rounds(race, "cuda", "wall")
            save({"what": f"C: tuner time_rounds, whole race, rep {rep}", "ms": {n: round(t, 4) for n, t in c.items()}})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tuning_gap_probe.json")
