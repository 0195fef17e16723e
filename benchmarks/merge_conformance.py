"""Merge conformance JSON files from several GPU runs into one matrix (Markdown + JSON).

    python benchmarks/merge_conformance.py OUT.md OUT.json RUN1.json[:ops] RUN2.json[:ops] ... [--log LOG --note TEXT]

Each input may restrict the ops taken from it (`file.json:gemm,rms_norm`); later files win."""
from __future__ import annotations

import argparse
import json

from opsadv.testing.report import summary, to_markdown
from opsadv.testing.runner import Result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("md")
    ap.add_argument("json_out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--note", default="")
    ap.add_argument("--log", default=None, help="a conformance -v log whose lines are appended verbatim")
    ap.add_argument("--log-title", default="")
    a = ap.parse_args()
    cells: dict[tuple, Result] = {}
    meta = None
    for spec in a.inputs:
        path, _, ops = spec.partition(":")
        data = json.load(open(path))
        meta = meta or data
        keep = set(ops.split(",")) if ops else None
        for r in data["results"]:
            if keep is None or r["op"] in keep:
                cells[(r["op"], r["shape_class"], r["dtype"])] = Result(**{**r, "tol": tuple(r["tol"]) if r.get("tol") else None})
    results = list(cells.values())
    md = to_markdown(results, backend=meta["backend"], device=meta["device"], quick=meta["quick"], note=a.note)
    md = md.replace(f"# Conformance: backend `{meta['backend']}` on {meta['device']}",
                    f"# Conformance: backend `{meta['backend']}` on {meta['device_name']}")
    import opsadv
    from opsadv.registry import get_registry
    env = get_registry().env
    md = md.replace(f"torch {env.torch_version}, triton {env.triton_version}",
                    f"torch {meta['torch']}, triton {meta['triton']}")
    if a.log:
        lines = [l.rstrip() for l in open(a.log) if l.startswith("  ")]
        md += f"\n## {a.log_title}\n\n```\n" + "\n".join(lines) + "\n```\n"
    with open(a.md, "w") as f:
        f.write(md)
    with open(a.json_out, "w") as f:
        json.dump({**{k: meta[k] for k in ("backend", "device", "device_name", "torch", "triton", "date")},
                   "summary": summary(results), "note": a.note, "results": [r.to_dict() for r in results]}, f, indent=1)
    print(summary(results))


if __name__ == "__main__":
    main()
