"""The models suite's heatmap and the README's headline table, both from the suite's JSON alone.

  python -m opsadv.bench.model_report benchmarks/results/models_h200.json --heatmap models_h200.png
  python -m opsadv.bench.model_report benchmarks/results/models_h200.json --table     # markdown on stdout

Rows of the models suite carry `arch`, `size` and `mode` (suite_models.py) and `speedup`: the paired ratio
against the cell's baseline (unconverted eager, torch.compile of it for the compiled cells, transformers'
StaticCache under generate's auto-compile for the paged decode cells).  The heatmap
puts "arch size" on one axis and the mode on the other, colour = that ratio with 1.0 in the middle, the
number in each cell; cells that failed are grey and say so.  The headline table groups the cells by mode
family (prefill / decode / decode paged / train / padded train, eager or compiled): cells, median ratio over them, the
lowest cell, how many reach 1.0, and the median ratio against Liger where it ran."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def load_rows(json_path: str) -> list[dict[str, Any]]:
    data = json.loads(Path(json_path).read_text())
    return [r for r in data.get("cases", []) if r.get("suite") == "models" and "arch" in r and "mode" in r]


def _order(values, key=None):
    seen: list = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return sorted(seen, key=key) if key else seen


_MODE_ORDER = ("prefill", "decode", "train")


def _mode_key(mode: str):
    words = mode.split()
    fam = _MODE_ORDER.index(words[0]) if words and words[0] in _MODE_ORDER else len(_MODE_ORDER)
    return ("compiled" in words, fam, mode)


def write_heatmap(json_path: str | None, png_path: str, rows: list[dict[str, Any]] | None = None,
                  title: str | None = None) -> int:
    """Heatmap of the models rows of `json_path` (or of `rows`); returns the number of cells drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    head: dict = {}
    if rows is None:
        rows = load_rows(json_path)
        head = json.loads(Path(json_path).read_text())
    rows = [r for r in rows if "arch" in r and "mode" in r]
    if not rows:
        return 0
    models = _order((f"{r['arch']} {r['size']}" for r in rows))
    modes = _order((r["mode"] for r in rows), key=_mode_key)
    grid = [[None] * len(modes) for _ in models]
    for r in rows:
        grid[models.index(f"{r['arch']} {r['size']}")][modes.index(r["mode"])] = r
    vals = [r["speedup"] for r in rows if isinstance(r.get("speedup"), (int, float))]
    lo, hi = min(vals + [0.9]), max(vals + [1.1])
    # colours saturate outside [0.5, 2]: one cell far off must not wash out the rest
    norm = TwoSlopeNorm(vcenter=1.0, vmin=max(min(lo, 0.9), 0.5), vmax=min(max(hi, 1.1), 2.0))
    cmap = plt.get_cmap("RdYlGn")
    fig, ax = plt.subplots(figsize=(1.0 + 0.62 * len(modes), 1.6 + 0.34 * len(models)))
    for i, row in enumerate(grid):
        for j, r in enumerate(row):
            if r is None:
                continue
            sp = r.get("speedup")
            if isinstance(sp, (int, float)):
                colour, text = cmap(norm(min(max(sp, norm.vmin), norm.vmax))), f"{sp:.2f}"
            else:
                colour, text = (0.75, 0.75, 0.75, 1.0), "err"
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=colour))
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, len(modes))
    ax.set_ylim(len(models), 0)
    ax.set_xticks([j + 0.5 for j in range(len(modes))], modes, rotation=60, ha="right", fontsize=6)
    ax.set_yticks([i + 0.5 for i in range(len(models))], models, fontsize=7)
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, fraction=0.03, pad=0.01).set_label("converted / baseline speed (paired ratio)", fontsize=7)
    ax.set_title(title or "opsadv.convert_model vs the unconverted model (eager cells)\n/ torch.compile of it "
                 f"(compiled cells)\n{head.get('device', '')}, torch {head.get('torch', '')}, "
                 f"\n{_commits(rows, head)}", fontsize=7)
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=130)
    plt.close(fig)
    return len(rows)


def family(mode: str) -> str:
    """The headline group of a mode label: "prefill", "decode", "decode paged", "train", "train padded",
    + " compiled"; "prefill fp8" / "train fp8" apart (their baseline is our bf16 conversion)."""
    words = mode.split()
    fam = words[0] if words else "?"
    if fam == "train" and "padded" in words:
        fam = "train padded"
    if fam == "decode" and "paged" in words:     # its baseline is the static-compiled peer, not the eager model
        fam = "decode paged"
    if "fp8" in words:
        fam += " fp8"
    return fam + (" compiled" if "compiled" in words else "")


def headline(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(family(r["mode"]), []).append(r)
    out = []
    for fam in sorted(groups, key=lambda f: ("compiled" in f, _mode_key(f))):
        rs = groups[fam]
        ok = [r for r in rs if isinstance(r.get("speedup"), (int, float))]
        lig = [r["ratios"]["liger"] for r in ok if isinstance(r.get("ratios", {}).get("liger"), (int, float))]
        worst = min(ok, key=lambda r: r["speedup"]) if ok else None
        out.append({"group": fam, "cells": len(rs), "measured": len(ok),
                    "median": statistics.median([r["speedup"] for r in ok]) if ok else None,
                    "min": worst["speedup"] if worst else None, "min_cell": worst["case"] if worst else None,
                    "at_least_1": sum(1 for r in ok if r["speedup"] >= 1.0),
                    "median_vs_liger": statistics.median(lig) if lig else None, "liger_cells": len(lig)})
    return out


def _commits(rows: list[dict[str, Any]], head: dict) -> str:
    """'commit X' or 'rows at commits X, Y': each row names the commit it measured."""
    seen = _order(r.get("commit") or head.get("commit", "?") for r in rows) or [head.get("commit", "?")]
    return f"commit {seen[0]}" if len(seen) == 1 else "rows at commits " + ", ".join(seen)


def headline_markdown(json_path: str) -> str:
    """The README's headline table (markdown) from the models JSON."""
    data = json.loads(Path(json_path).read_text())
    rows = load_rows(json_path)
    f = lambda v: "-" if v is None else f"{v:.2f}x"   # noqa: E731
    lines = [f"Models matrix on {data.get('device', '?')} (torch {data.get('torch', '?')}, "
             f"{_commits(rows, data)}): converted vs the unconverted model in the same mode (eager vs eager, "
             "compiled vs compiled; decode paged: convert_model(cuda_graphs=True) + a static PagedKVCache vs "
             "transformers' StaticCache under generate's auto-compile; fp8: convert_model(precision=\"fp8\") vs our "
             "bf16 conversion), paired per-round ratios, >1 = converted faster.", "",
             "| mode | cells | median | lowest cell | cells >= 1.0x | median vs Liger |",
             "|---|---|---|---|---|---|"]
    for g in headline(rows):
        low = f"{f(g['min'])} ({g['min_cell']})" if g["min_cell"] else "-"
        failed = g["cells"] - g["measured"]
        lines.append(f"| {g['group']} | {g['measured']}" + (f" (+{failed} failed)" if failed else "") +
                     f" | {f(g['median'])} | {low} | {g['at_least_1']}/{g['measured']} | "
                     f"{f(g['median_vs_liger'])}" + (f" ({g['liger_cells']} cells)" if g["liger_cells"] else "") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsadv.bench.model_report", description=__doc__.splitlines()[0])
    p.add_argument("json", help="the models suite's JSON (benchmarks/results/models_h200.json)")
    p.add_argument("--heatmap", metavar="PNG", default=None, help="write the heatmap there")
    p.add_argument("--table", action="store_true", help="print the headline table (markdown)")
    a = p.parse_args(argv)
    if not a.heatmap and not a.table:
        a.table = True
    if a.heatmap:
        n = write_heatmap(a.json, a.heatmap)
        print(f"wrote {a.heatmap} ({n} cells)", file=sys.stderr)
    if a.table:
        sys.stdout.write(headline_markdown(a.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
