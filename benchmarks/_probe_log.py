"""Shared by the GPU probe scripts: a JSON record log rewritten after every record (a killed run keeps
what it had), a wall-clock budget, and sections that record their error or skip instead of ending the run."""
from __future__ import annotations

import json
import time
import traceback


class ProbeLog:
    def __init__(self, out: str, budget_s: float, meta: dict, t0: float | None = None):
        self.out, self.budget, self.data = out, budget_s, meta
        self.t0 = time.time() if t0 is None else t0
        meta.setdefault("records", [])

    def save(self, rec: dict) -> None:
        rec["t"] = round(time.time() - self.t0, 1)
        self.data["records"].append(rec)
        with open(self.out, "w") as f:
            json.dump(self.data, f, indent=1)
        print(json.dumps(rec), flush=True)

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def guarded(self, name: str, fn, need: float = 5.0) -> None:
        """Run section `fn` if `need` seconds are left; record a skip or the error and go on."""
        if self.left() < need:
            self.save({"section": name, "skipped": f"time budget ({self.left():.0f}s left)"})
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded, the next section still runs
            self.save({"section": name, "error": f"{type(e).__name__}: {str(e)[:400]}",
                       "tb": traceback.format_exc()[-800:]})


def probe_setup(default_out: str, default_budget_s: float):
    """(out path, budget s, tiny, device, dtype, meta) of a probe run: `probe.py [OUT.json] [budget_s]`;
    PROBE_TINY=1 (with TRITON_INTERPRET=1) is the CPU dry run: tiny shapes, fp16 (the interpreter's bf16
    dot is wrong)."""
    import os
    import sys

    import torch
    import triton
    tiny = os.environ.get("PROBE_TINY") == "1"
    out = sys.argv[1] if len(sys.argv) > 1 else default_out
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else default_budget_s
    meta = {"device": "cpu" if tiny else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": os.environ.get("OPSADV_COMMIT", "?"), "records": []}
    return out, budget, tiny, ("cpu" if tiny else "cuda"), (torch.float16 if tiny else torch.bfloat16), meta


def warm_and_time(fns: dict, rounds: int = 5) -> dict:
    """Each fn called once (compile, plan, tune) before any is timed, then median ms over `rounds` interleaved
    rounds (opsadv.bench.runner.time_interleaved)."""
    from opsadv.bench.runner import time_interleaved
    for f in fns.values():
        f()
    return time_interleaved(fns, rounds=rounds)


def record_case(res: dict, path: str, row: dict, key: str = "cases") -> None:
    """Print row, append it to res[key] and rewrite the JSON at path (a killed run keeps what it had)."""
    print(json.dumps(row), flush=True)
    res.setdefault(key, []).append(row)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
