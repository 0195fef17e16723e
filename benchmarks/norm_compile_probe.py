"""Why does torch.compile's RMSNorm forward beat ours at 16384 x 8192 (0.1300 vs 0.1358 ms, 0.957x, 2fc9344) and
tie it with the residual at 65536 x 1024?  (issue 4: norm forward >= 1.0x torch.compile in every row.)

Per shape (no-grad forward, bf16): Inductor's generated Triton source (saved next to the JSON: its tile, warps,
eviction hints, loop structure), then our forward kernel with every (ROWS, num_warps, EVICT, CHUNK) candidate forced,
a few beyond the tuner's list, and the compiled peer, interleaved in one run.

    PYTHONPATH=. python3 benchmarks/norm_compile_probe.py OUT.json
"""
from __future__ import annotations

import os
import sys

import torch
from _probe_log import record_case, warm_and_time

from opsadv.backends.cuda import norm as N
from opsadv.bench.suite_norm import _compiled

SHAPES = [(16384, 8192, False), (65536, 1024, True), (32768, 4096, False)]     # tokens, hidden, residual


def main(path: str) -> None:
    from torch._inductor.utils import run_and_get_code
    res = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(), "cases": []}
    for t, h, has_res in SHAPES:
        torch.manual_seed(0)
        x, r = (torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        comp = _compiled("rms_norm", has_res)
        with torch.no_grad():
            _, code = run_and_get_code(comp, x, r, w, None)
        src = os.path.splitext(path)[0] + f"_inductor_{t}x{h}{'_res' if has_res else ''}.py"
        with open(src, "w") as f:
            f.write("\n\n# ----\n".join(code))
        cands = list(N.fwd_candidates(h))
        for extra in ((1, 4, False, 0), (1, 8, False, 0), (1, 16, False, 0), (2, 8, False, 0), (2, 16, False, 0),
                      (4, 16, False, 0), (1, 16, True, 1024), (1, 32, True, 4096)):
            if extra not in cands and extra[0] * min(N._next_pow2(h), extra[3] or h) >= 32 * extra[1]:
                cands.append(extra)
        rr = r if has_res else None
        fns = {"compile": lambda: comp(x, r, w, None)}
        for c in cands:
            fns[f"ours{c}"] = (lambda c=c: N._forward(None, True, x, w, None, 1e-6, rr, 0.0, stats=False, cfg=c))
        with torch.no_grad():
            ms = warm_and_time(fns, rounds=7)
        best = min((k for k in ms if k != "compile"), key=ms.get)
        record_case(res, path, {"tokens": t, "hidden": h, "residual": has_res,
                                "ms": {k: round(v, 5) for k, v in sorted(ms.items(), key=lambda kv: kv[1])},
                                "best_ours": best, "best_vs_compile": round(ms["compile"] / ms[best], 4),
                                "inductor_source": os.path.basename(src)})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "norm_compile_probe.json")
