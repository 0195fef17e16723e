"""The conformance matrix as JSON and Markdown."""
from __future__ import annotations

import json
import time
from collections import Counter

import opsadv
from opsadv.registry import get_registry


def summary(results) -> dict[str, int]:
    c = Counter(r.status for r in results)
    return {"pass": c.get("pass", 0), "skip": c.get("skip", 0), "fail": c.get("fail", 0)}


def to_json(results, *, backend: str, device: str, quick: bool, note: str = "") -> dict:
    env = get_registry().env
    return {"backend": backend, "device": device, "device_name": env.device_name or device, "quick": quick,
            "torch": env.torch_version, "triton": env.triton_version, "opsadv": opsadv.__version__,
            "interpreter": env.triton_interpret, "date": time.strftime("%Y-%m-%d"), "note": note,
            "summary": summary(results), "results": [r.to_dict() for r in results]}


def to_markdown(results, *, backend: str, device: str, quick: bool, note: str = "") -> str:
    env = get_registry().env
    s = summary(results)
    lines = [f"# Conformance: backend `{backend}` on {env.device_name or device}",
             "",
             f"torch {env.torch_version}, triton {env.triton_version}, opsadv {opsadv.__version__}, "
             f"device `{device}`{' (Triton interpreter)' if env.triton_interpret and device == 'cpu' else ''}, "
             f"{'quick' if quick else 'full'} catalogue, {time.strftime('%Y-%m-%d')}.",
             "",
             f"**{s['pass']} pass, {s['skip']} skip, {s['fail']} fail.** Every cell compares the backend's impl with the "
             "float64 reference: error at most 3x the reference backend's on the same low-precision inputs plus a floor, "
             "forward and backward (docs/conformance.md); fresh random inputs, seed recorded.",
             ""]
    if note:
        lines += [note, ""]
    dtypes = sorted({r.dtype for r in results})
    ops = list(dict.fromkeys(r.op for r in results))
    for op in ops:
        rows = [r for r in results if r.op == op]
        classes = list(dict.fromkeys(r.shape_class for r in rows))
        lines += [f"## {op}", "", "| shape class | " + " | ".join(dtypes) + " |",
                  "|---|" + "---|" * len(dtypes)]
        for sc in classes:
            cells = []
            for d in dtypes:
                r = next((x for x in rows if x.shape_class == sc and x.dtype == d), None)
                if r is None:
                    cells.append("")
                elif r.status == "pass":
                    err = f" fwd {r.fwd_err:.1e}" if r.fwd_err is not None else ""
                    err += f" bwd {r.bwd_err:.1e}" if r.bwd_err is not None else " (fwd only)" if r.fwd_err is not None and sc not in ("compile", "export") else ""
                    cells.append(f"pass `{r.impl}`{err}")
                else:
                    cells.append(f"**{r.status}**: {r.reason[:160]}".replace("|", "/"))
            lines.append(f"| {sc} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write(results, *, backend, device, quick, json_path=None, markdown_path=None, note="") -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(to_json(results, backend=backend, device=device, quick=quick, note=note), f, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(to_markdown(results, backend=backend, device=device, quick=quick, note=note) + "\n")
