"""`opsadv bench`: run bench suites side by side with their peers, print a table, write JSON/PNG.

For each case (opsadv/bench/case.py): setup, one warm-up call of opsadv and of every peer
(compilation, autotuning and cuDNN plan selection stay out of the numbers), timing with
triton.testing.do_bench (median; CUDA events) in interleaved rounds (time_interleaved), then verification of opsadv's output against the
fastest peer's (rel_err), so a fast wrong kernel never counts.  The JSON (schema in
benchmarks/README.md) is merged by case name into an existing file, so suites run separately
accumulate."""
from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import opsadv
from opsadv._progress import bar, enabled, say
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.policy import current_policy
from opsadv.core.tuning import MIN_CALLS, one_call_ms, per_call_ms, sample_window  # noqa: F401  (MIN_CALLS: re-exported)

from .model_report import write_heatmap

SUITES = ("attention", "sparse", "gemm", "norm", "rotary", "mlp", "lce", "e2e", "decode", "models", "fp8", "ring")
MISMATCH = 5e-2          # rel_err above this marks a case wrong (and the run fails)


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn) -> float:
    """Median ms: do_bench (CUDA events) on a GPU; perf_counter where there is none."""
    import torch
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


ROUNDS = 5               # interleaved timing rounds per case (see time_interleaved)
SPREAD = 1.10            # rounds whose paired ratios spread by more than this get more rounds, up to 2x ROUNDS,
EXTRA_ROUNDS_S = 90.0    # while the case's timing stays under this (a decode cell's round is 10-20 s)
# do_bench windows of >= MIN_CALLS calls per contender and round, however long one call is: the tuner's rule
bench_window = sample_window


def calls_ms(fn, calls: int) -> float:
    """Median ms of `calls` calls of fn, each timed on its own (CUDA events on a GPU, perf_counter elsewhere)."""
    import torch

    return statistics.median(per_call_ms(fn, calls, torch.cuda.is_available()))


def _spread(seen: dict, ours: str | None) -> float:
    """The largest max/min over rounds of any peer's per-round ratio against `ours` (1.0: the rounds agree)."""
    if ours is None or ours not in seen or len(seen[ours]) < 2:
        return 1.0
    out = 1.0
    for n, v in seen.items():
        if n != ours:
            r = [p / o for p, o in zip(v, seen[ours]) if o > 0 and p > 0]
            if len(r) >= 2:
                out = max(out, max(r) / min(r))
    return out


def time_interleaved(fns: dict, rounds: int = ROUNDS, per_round: dict | None = None, calls: int | None = None,
                     ours: str | None = None, max_rounds: int | None = None) -> dict:
    """Median ms of each fn, measured in `rounds` interleaved rounds (each round times every fn
    once with do_bench over a window of >= MIN_CALLS calls, the order rotated per round) and the median
    over rounds taken: clock ramps, thermal drift and order effects fall on every contender alike, not on
    whoever runs first or last.  per_round (optional) receives each fn's time in every round (paired_speedup).
    `calls`: each round times that many single calls instead (calls_ms; for calls long enough that a do_bench
    window of MIN_CALLS calls plus its estimate would take seconds), on any device.
    Off a GPU without `calls`: time_ms once each.
    `ours` / `max_rounds`: while some peer's per-round ratio against `ours` spreads by more than SPREAD (max / min
    over the rounds), fewer than max_rounds ran and one more round keeps the timing under EXTRA_ROUNDS_S, one more
    round: on an H100 holding its power cap the same ViT cell read 0.75-1.07x over three rounds (median 0.79x) and
    1.05-1.06x in another run."""
    import torch
    names = list(fns)
    if calls is None and not torch.cuda.is_available():
        seen = {n: [time_ms(fns[n])] for n in names}
    else:
        if calls is None:
            from triton.testing import do_bench
            window = {n: bench_window(one_call_ms(fns[n])) for n in names}

            def one(n):
                warmup, rep = window[n]
                return float(do_bench(fns[n], warmup=warmup, rep=rep, return_mode="median"))
        else:
            def one(n):
                return calls_ms(fns[n], calls)
        seen = {n: [] for n in names}
        r, t0 = 0, time.perf_counter()
        while r < rounds or (r < (max_rounds or 0) and _spread(seen, ours) > SPREAD
                             and (time.perf_counter() - t0) * (r + 1) / r <= EXTRA_ROUNDS_S):
            for n in names[r % len(names):] + names[:r % len(names)]:
                seen[n].append(one(n))
            r += 1
    if per_round is not None:
        per_round.update(seen)
    return {n: statistics.median(v) for n, v in seen.items()}


def paired_speedup(peer_rounds: list, ours_rounds: list) -> tuple[float, float, float]:
    """(median, min, max) over rounds of peer / ours timed in the same round.  Two contenders timed
    seconds apart share the clock state of that moment; a drift between rounds (the same
    cuDNN kernel once 7.19 ms as the peer, 7.55 through the op, in medians of 3 rounds) cancels in the
    per-round ratio, where it moves a ratio of medians taken over different rounds."""
    ratios = [p / o for p, o in zip(peer_rounds, ours_rounds)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _tensors(x) -> list:
    import torch
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return [t for t in (getattr(x, "logits", None), getattr(x, "last_hidden_state", None)) if t is not None]


def rel_err(a, b) -> float:
    """max over paired tensors of ||a - b|| / ||b|| (in float64); NaN anywhere -> inf."""
    import torch
    ta, tb = _tensors(a), _tensors(b)
    if not ta or len(ta) != len(tb):
        return float("nan")
    worst = 0.0
    for x, y in zip(ta, tb):
        x, y = x.detach().double(), y.detach().double()
        if x.shape != y.shape or not bool(torch.isfinite(x).all()):
            return float("inf")
        worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-30)).item())
    return worst


def _commit() -> str:
    if os.environ.get("OPSADV_COMMIT"):
        return os.environ["OPSADV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _header() -> dict[str, Any]:
    import torch
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": dev, "torch": torch.__version__, "triton": tv, "commit": _commit(),
            "date": time.strftime("%Y-%m-%d")}


def _chosen(case) -> str:
    """Impl ids the dispatcher ran for one opsadv call (opsadv.trace), or the case's own answer."""
    if case.impl is not None:
        try:
            return case.impl()
        except Exception:
            pass
    with opsadv.trace() as t:
        case.opsadv()
    _sync()
    return " + ".join(sorted(t.counts)) or "?"


def run_case(case) -> list[dict[str, Any]]:
    """Measure one case; returns its JSON rows (the case, plus an "[own]" row when the
    dispatcher chose a vendor kernel and the case offers the library's own kernel)."""
    row: dict[str, Any] = {"suite": case.suite, "case": case.case, "unit": case.unit}

    def extra() -> dict:
        return {k: v for k, v in case.extra.items() if not callable(v) and k != "own_prefix"}
    try:
        if case.setup is not None:
            case.setup()
    except Exception as e:       # the case's error row (with what setup found); the suite's other cases still run
        row["error"] = f"setup: {type(e).__name__}: {str(e)[:300]}"
        return [{**extra(), **row}]
    try:
        out = case.opsadv()
        _sync()
        row["opsadv_impl"] = _chosen(case)
    except Exception as e:
        row["error"] = f"opsadv: {type(e).__name__}: {str(e)[:300]}"
        return [{**extra(), **row}]
    errors: dict[str, str] = {}
    ok: dict = {}
    for name, fn in case.peers.items():
        try:
            fn()                                 # warm-up: compilation, autotuning, plan selection
            _sync()
            ok[name] = fn
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    own, prefix = case.extra.get("own"), case.extra.get("own_prefix")
    want_own = own is not None and prefix and not all(i.strip().startswith(prefix)
                                                      for i in row["opsadv_impl"].split("+"))
    oout = own_err = None
    if want_own:
        try:
            oout = own()
            _sync()
        except Exception as e:
            own_err = f"{type(e).__name__}: {str(e)[:300]}"
    contenders = {"\0opsadv": case.opsadv, **ok}
    if want_own and own_err is None:
        contenders["\0own"] = own
    rounds: dict = {}
    n_rounds = case.rounds or ROUNDS
    times = time_interleaved(contenders, n_rounds, per_round=rounds, calls=case.calls, ours="\0opsadv",
                             max_rounds=2 * n_rounds)
    if len(rounds["\0opsadv"]) > n_rounds:
        row["rounds_run"] = len(rounds["\0opsadv"])      # the first ones disagreed by more than SPREAD
    ms = times.pop("\0opsadv")
    oms = times.pop("\0own", None)
    peers: dict[str, float] = times
    row.update(opsadv_ms=round(ms, 5), peers={k: round(v, 5) for k, v in peers.items()},
               opsadv_rate=round(case.work / ms / 1e9, 2))
    if errors:
        row["peer_errors"] = errors
    if peers:
        best = min(peers, key=peers.get)
        # against the named baseline where it ran (the fastest peer otherwise, or where it failed: said so)
        against = case.baseline if case.baseline in peers else best
        if case.baseline is not None:
            row["baseline"] = case.baseline
            if against != case.baseline:
                row["baseline_missing"] = True
            row["ratios"] = {p: round(paired_speedup(rounds[p], rounds["\0opsadv"])[0], 3) for p in peers}
        ref = case.peers[against]()
        cmp = case.compare or rel_err
        row["rel_err"] = float(f"{cmp(out, ref):.3g}")
        row["best_peer"] = best
        row["speedup"], lo, hi = (round(x, 3) for x in paired_speedup(rounds[against], rounds["\0opsadv"]))
        row["speedup_range"] = [lo, hi]     # over the rounds; speedup is their median (paired_speedup)
        del ref
    row.update(extra())
    rows = [row]
    if want_own:
        orow = {"suite": case.suite, "case": case.case + " [own]", "unit": case.unit,
                # own_prefix may be one prefix or a tuple of them (str.startswith takes both)
                "opsadv_impl": case.extra.get("own_impl")
                or " | ".join(p + "*" for p in ((prefix,) if isinstance(prefix, str) else prefix))}
        if own_err is not None:
            orow["error"] = own_err
        else:
            orow.update(opsadv_ms=round(oms, 5), peers=row["peers"], opsadv_rate=round(case.work / oms / 1e9, 2))
            if peers:
                orow["rel_err"] = float(f"{(case.compare or rel_err)(oout, case.peers[row['best_peer']]()):.3g}")
                orow["best_peer"] = row["best_peer"]
                sp, lo, hi = paired_speedup(rounds[row["best_peer"]], rounds["\0own"])
                orow["speedup"], orow["speedup_range"] = round(sp, 3), [round(lo, 3), round(hi, 3)]
        del oout
        rows.append(orow)
    del out
    return rows


def _print_rows(rows: list[dict[str, Any]], peer_names: list[str]) -> None:
    head = f"{'case':58} {'opsadv ms':>10} " + " ".join(f"{p:>14}" for p in peer_names) + \
           f" {'speedup':>8} {'rounds':>11} {'rate':>12} {'rel_err':>9}  impl"
    say(head)
    for r in rows:
        if "error" in r:
            say(f"{r['case']:58} ERROR {r['error']}")
            continue
        cells = " ".join(f"{r['peers'][p]:>14.4f}" if p in r.get("peers", {}) else f"{'-':>14}" for p in peer_names)
        lo_hi = r.get("speedup_range")        # the lowest and highest per-round ratio (paired_speedup)
        rng = f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}" if lo_hi else "-"
        say(f"{r['case']:58} {r['opsadv_ms']:>10.4f} {cells} {r.get('speedup', float('nan')):>8.3f} {rng:>11} "
              f"{r['opsadv_rate']:>8.1f} {r['unit']:<4}{r.get('rel_err', float('nan')):>9.2g}  {r['opsadv_impl']}")


def write_json(path: str, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Merge rows into the file by case name (new rows replace old ones of the same name)."""
    p = Path(path)
    data: dict[str, Any] = {}
    if p.exists():
        try:
            data = json.loads(p.read_text())
        except ValueError:
            data = {}
    cases = {c["case"]: c for c in data.get("cases", [])}
    for r in rows:
        cases[r["case"]] = {**r, "commit": r.get("commit", header.get("commit"))}   # provenance per case
    data.update(header)
    data["cases"] = list(cases.values())
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=1) + "\n")


def write_plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "speedup" in r]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.5))
    names = [r["case"] for r in rows]
    vals = [r["speedup"] for r in rows]
    ax.barh(range(len(rows)), vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("speedup over the best peer (higher is better)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    dens = [r for r in rows if r.get("density") is not None and r["case"].startswith("fwd ")
            and "varlen" not in r["case"] and not r["case"].endswith("[own]")]
    if len(dens) >= 2:
        write_density_plot(str(Path(path).with_name(Path(path).stem + "_density.png")), dens, title)


def write_density_plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    """Sparse suite: forward time vs the fraction of tiles computed, opsadv and each peer (the
    issue's time-vs-density plot); written next to the speedup plot as <name>_density.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted(rows, key=lambda r: r["density"])
    x = [r["density"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(x, [r["opsadv_ms"] for r in rows], "o-", label="opsadv")
    for peer in sorted({p for r in rows for p in r.get("peers", {})}):
        pts = [(r["density"], r["peers"][peer]) for r in rows if peer in r.get("peers", {})]
        ax.plot([a for a, _ in pts], [b for _, b in pts], "s--", label=peer)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("density (fraction of (query, key) tiles computed)")
    ax.set_ylabel("forward ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(plot_path: str, rows: list[dict[str, Any]], header: dict[str, Any], json_path: str | None) -> list[str]:
    """The speedup chart of the op-suite rows and the models heatmap of the models rows (from the whole JSON
    where there is one: the grid's other parts too); returns the paths written."""
    written = []
    other = [r for r in rows if r.get("suite") != "models"]
    if other:
        write_plot(plot_path, other, f"opsadv vs best peer, {header.get('device')}, commit {header.get('commit')}")
        written.append(plot_path)
    if len(other) < len(rows):
        hpath = plot_path if not other else str(Path(plot_path).with_name(Path(plot_path).stem + "_models.png"))
        write_heatmap(json_path, hpath, rows=None if json_path else [r for r in rows if r.get("suite") == "models"])
        written.append(hpath)
    return written


def plot_from_json(json_path: str, plot_path: str | None = None) -> int:
    """`opsadv bench --plot-only JSON [--plot PNG]`: the plots of a results file, nothing run (default PNG:
    the JSON's name with .png)."""
    try:
        data = json.loads(Path(json_path).read_text())
        rows = data["cases"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = "no such file" if isinstance(e, FileNotFoundError) else f"{type(e).__name__}: {e}".splitlines()[0]
        raise InvalidArgumentError("bench", "--plot-only", "a results JSON written by `opsadv bench --json`",
                                   f"{json_path!r} ({why})") from None
    rows = [r for r in rows if isinstance(r, dict) and "error" not in r]
    if not rows:
        raise InvalidArgumentError("bench", "--plot-only", "a results JSON with measured cases",
                                   f"{json_path!r} (none)")
    for p in write_plots(plot_path or str(Path(json_path).with_suffix(".png")), rows, data, json_path):
        print(f"wrote {p}")
    return 0


def _selected(names: list[str], quick: bool, pattern, part: tuple[int, int]) -> int:
    """How many cases the run will time (for the progress bar's ETA): a dry pass over the suites' generators, each
    case dropped at once (the suites make their tensors per case, so one case's worth is alive at a time)."""
    index = n = 0
    for name in names:
        mod = f"opsadv.bench.suite_{name}"
        if importlib.util.find_spec(mod) is None:
            continue
        for case in importlib.import_module(mod).cases(quick):
            if pattern is not None and not pattern.search(case.case):
                continue
            index += 1
            n += not (index - part[0]) % part[1]
            del case
    gc.collect()
    return n


def run_bench(suites: list[str], quick: bool, json_path: str | None, plot_path: str | None,
              autotune: bool = True, case_filter: str | None = None, part: tuple[int, int] = (1, 1),
              progress: str | None = "off") -> int:
    """Run the named suites ("all" = every suite); returns the process exit code (0: every
    case ran and matched its peers).  `case_filter` (a regex) keeps the matching case names;
    `part=(i, n)` keeps every n-th case starting at the i-th, so a long grid splits over several
    time-limited runs.  The JSON and the plot are rewritten after every case: a run stopped by a
    time limit keeps what finished.  `progress` ("auto", "on", "off"): a bar with an ETA on stderr."""
    import re


    pattern = re.compile(case_filter) if case_filter else None
    index = 0
    import torch


    names: list[str] = []
    for s in suites:
        for n in (SUITES if s == "all" else (s,)):
            if n not in names:
                names.append(n)
    header = _header()
    print(f"opsadv bench on {header['device']} (torch {header['torch']}, triton {header['triton']}, "
          f"commit {header['commit']}){' quick' if quick else ''}", flush=True)
    rows: list[dict[str, Any]] = []
    failed = False
    cur = current_policy()   # keep what the caller set (backend, experimental, ...); add measured choice
    total = _selected(names, quick, pattern, part) if enabled(progress) else None
    with opsadv.use_backend(cur.backend, strict=cur.strict, profile=cur.profile, experimental=cur.experimental,
                            deterministic=cur.deterministic, precision=cur.precision, autotune=autotune,
                            **dict(cur.options)), bar(total, "bench", "case", progress) as pb:
        for name in names:
            mod = f"opsadv.bench.suite_{name}"
            if importlib.util.find_spec(mod) is None:
                say(f"suite {name!r}: skipped ({mod} does not exist yet)")
                continue
            suite_rows: list[dict[str, Any]] = []
            peer_names: list[str] = []
            for case in importlib.import_module(mod).cases(quick):
                if pattern is not None and not pattern.search(case.case):
                    continue
                index += 1
                if (index - part[0]) % part[1]:
                    continue
                for p in case.peers:
                    if p not in peer_names:
                        peer_names.append(p)
                pb.set_postfix(f"{name}: {case.case}")
                case_rows = run_case(case)
                del case
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                for r in case_rows:
                    bad = "error" in r or not (r.get("rel_err", 0.0) <= MISMATCH)
                    if bad and not r["case"].endswith("[own]"):
                        failed = True
                    if bad and "error" not in r:
                        r["mismatch"] = True
                    say(f"  {r['case']}: " + (r.get("error") or
                        f"{r['opsadv_ms']:.4f} ms, speedup {r.get('speedup', float('nan')):.3f}, "
                        f"rel_err {r.get('rel_err', float('nan')):.2g}, {r['opsadv_impl']}"))
                suite_rows += case_rows
                if json_path:
                    write_json(json_path, header, case_rows)
                if plot_path:       # rewritten after every case, as the JSON: a stopped run keeps its chart
                    _plots_quietly(plot_path, rows + suite_rows, header, json_path)
                pb.update()
            say(f"\nsuite {name}:")
            _print_rows(suite_rows, peer_names)
            rows += suite_rows
    if json_path:
        print(f"wrote {json_path}")
    if plot_path and rows:
        for p in write_plots(plot_path, rows, header, json_path):
            print(f"wrote {p}")
    return 1 if failed else 0


def _plots_quietly(plot_path: str, rows: list[dict[str, Any]], header: dict[str, Any], json_path: str | None) -> None:
    # a plot that fails mid-run (no matplotlib, nothing measured yet) must not stop the benchmark
    try:
        write_plots(plot_path, [r for r in rows if "error" not in r], header, json_path)
    except Exception as e:
        import logging
        logging.getLogger("opsadv.bench").debug("plot after the case not written: %s", e)
