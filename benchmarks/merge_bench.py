"""Merge bench rows from GPU runs into benchmarks/results/h200.json (by case name; newer replace
older), keeping each row's commit.

    python benchmarks/merge_bench.py TARGET.json SRC.json[@KEY][#COMMIT] ...

@KEY takes the cases under a top-level key of SRC (e.g. RUN.json@bench_quick_attention);
#COMMIT sets the commit of rows that carry none (else SRC's header commit)."""
from __future__ import annotations

import json
import sys


def main() -> None:
    target, *sources = sys.argv[1:]
    data = json.load(open(target))
    rows = {c["case"]: c for c in data["cases"]}
    for spec in sources:
        spec, _, commit = spec.partition("#")
        path, _, key = spec.partition("@")
        src = json.load(open(path))
        src = src[key] if key else src
        for c in src["cases"]:
            c = dict(c)
            c.setdefault("commit", commit or src.get("commit"))
            if commit:
                c["commit"] = commit
            rows[c["case"]] = c
    data["cases"] = list(rows.values())
    data["note"] = ("rows measured at different commits (each row's 'commit'); ratios are within one run of the "
                    "row's suite")
    json.dump(data, open(target, "w"), indent=1)
    print(f"{target}: {len(rows)} cases")


if __name__ == "__main__":
    main()
