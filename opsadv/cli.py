"""The `opsadv` command: info | demo | conformance | bench | optimize | tune.

Every error is one line on stderr with a hint (exit 2 for a refused command, 1 for a failure); the
traceback is shown only with --log-level debug."""
from __future__ import annotations

import argparse
import json
import logging
import sys

import opsadv
from opsadv.registry import get_registry
from opsadv.testing import default_device, iter_cases, run_conformance
from opsadv.testing.cases import DTYPES
from opsadv.testing.report import summary, write

from ._progress import MODES, bar, say
from .cli_support import Parser, report_error
from .core import tuning
from .core.device_check import check_device
from .core.env import current_env
from .core.errors import BackendUnavailableError, InvalidArgumentError, OpsadvError, UnknownOptionError
from .core.opdef import OPS
from .demo import run_demo

log = logging.getLogger("opsadv")

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
CPU_SUITES = ("attention", "gemm", "norm", "mlp", "lce", "models", "ring")   # their quick grids shrink to CPU sizes without a GPU
BENCH_DOC = "benchmarks/README.md (how a suite measures, committed results); where each op stands: docs/performance.md"


def _log_level(v: str) -> str:
    v = v.upper()
    return "WARNING" if v == "WARN" else v


def _add_log_level(p: argparse.ArgumentParser, top: bool) -> None:
    # on the subcommands too (`opsadv info --log-level debug`); SUPPRESS there keeps the top-level value
    p.add_argument("--log-level", type=_log_level, choices=LEVELS, metavar="LEVEL",
                   default="WARNING" if top else argparse.SUPPRESS,
                   help="logging level: debug, info, warning (default) or error, any case; info prints each first "
                        "resolution of a shape bucket, debug also why the other kernels refused, the tuning cache "
                        "hits and misses and the tuning decisions, and the traceback of an error")


def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", default=None, choices=MODES,
                   help="progress bar with an ETA on stderr: auto (default, $OPSADV_PROGRESS: only on a terminal), "
                        "on, off")


def _version() -> str:
    return opsadv.__version__


def _print_json(data) -> None:
    print(json.dumps(data, indent=1, default=str))


def _cmd_info(args) -> int:
    if args.backend:
        opsadv.use_backend(args.backend)
    inf = opsadv.info(impls=args.impls)
    if args.json:
        d = inf.to_dict()
        if args.tuning:
            d["tuning"] = tuning.report(current_env()) + "\n" + _floor_report()
        _print_json(d)
        return 0
    print(inf)
    if args.tuning:
        print(tuning.report(current_env()))
        print(_floor_report())
    return 0


def _floor_report() -> str:
    from opsadv.convert import floor        # (the conversion stack loads only for this flag)
    return floor.report()


def _cmd_demo(args) -> int:
    return run_demo(backend=args.backend, device=args.device, as_json=args.json)


def _split(spec: str) -> list[str]:
    return [n.strip() for n in spec.split(",") if n.strip()]


def _dtypes(spec: str) -> tuple:
    """--dtypes "float32,float16" -> torch dtypes; an unknown name is an error naming the known ones."""
    import torch
    known = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64}
    names = _split(spec)
    bad = [n for n in names if n not in known] or ([] if names else [spec])
    if bad:
        raise UnknownOptionError("conformance", "--dtypes", f"a comma-separated list of {sorted(known)}", bad)
    return tuple(dict.fromkeys(known[n] for n in names))


def _ops(spec: str) -> list[str]:
    """--ops "gemm,rms_norm" -> op names; an unknown one (a typo ran nothing and passed) is refused."""
    names = _split(spec)
    if any(n not in OPS for n in names):
        get_registry()          # plugins' ops (opsadv_register_ops) are known once discovery ran
    bad = [n for n in names if n not in OPS] or ([] if names else [spec])
    if bad:
        import difflib
        near = [m for n in bad for m in difflib.get_close_matches(n, OPS, 1)]
        raise UnknownOptionError("conformance", "--ops", f"a comma-separated list of {list(OPS)}",
                                 f"{bad}" + (f" -- did you mean {', '.join(near)}?" if near else ""))
    return list(dict.fromkeys(names))


def _cmd_conformance(args) -> int:


    ops = _ops(args.ops) if args.ops else None
    dtypes = _dtypes(args.dtypes) if args.dtypes else None
    pins = _impl_pins(args.impl)
    reg = get_registry()
    if args.backend not in reg.backends or not reg.backends[args.backend].available:   # before the header line
        rec = reg.backends.get(args.backend)
        raise BackendUnavailableError(args.backend, list(rec.probe.reasons) if rec else
                                      [f"unknown; known: {sorted(reg.backends)}"])
    if args.aoe_mode is not None:
        opsadv.use_backend(args.backend, aoe_mode=args.aoe_mode)
    device = args.device or default_device(args.backend)
    if args.device:
        check_device(args.device, "conformance", "--device")

    say(f"opsadv conformance: backend {args.backend} on {device} ({'quick' if args.quick else 'full'} catalogue)")
    if pins and not ops:
        ops = list(pins)
    note = args.note or ""
    if pins:
        note = (note + " " if note else "") + "Pinned impls: " + ", ".join(f"{o} -> {i}" for o, i in pins.items()) + "."
    if args.precision:
        note = (note + " " if note else "") + f"Run under precision policy {args.precision!r} (float32 cells computed in it)."
    results = []
    todo = ops or list(OPS)
    cases = iter_cases(args.quick, todo)
    n_dtypes = len(dtypes) if dtypes else 3 if args.quick else len(DTYPES)    # run_conformance's defaults
    # one tick per cell, and one per op for its compile / export checks
    total = len(cases) * n_dtypes + len({c.op for c in cases})
    with bar(total, "conformance", "cell", args.progress) as pb:
        def progress(r):
            pb.update()
            if args.verbose or r.status == "fail":
                say(f"  {r.status:4s} {r.op}/{r.shape_class} {r.dtype} {r.impl or ''} {r.reason[:200]}")

        for i, op in enumerate(todo):   # one op at a time; the matrix on disk grows as each op finishes
            pb.set_postfix(op)
            results += run_conformance(args.backend, quick=args.quick, device=device, ops=[op], progress=progress,
                                       precision=args.precision, impls=pins or None, dtypes=dtypes)
            left = todo[i + 1:]
            write(results, backend=args.backend, device=device, quick=args.quick, json_path=args.json,
                  markdown_path=args.markdown, note=note + (f" PARTIAL: not yet run: {left}." if left else ""))
    s = summary(results)
    print(f"{s['pass']} passed, {s['fail']} failed, {s['skip']} skipped")
    return 1 if s["fail"] else 0


def _impl_pins(ids) -> dict:
    """--impl IDs -> {op: impl id} (each id's op looked up in the registry)."""
    if not ids:
        return {}
    by_id = {i.id: i for impls in get_registry().impls_by_op.values() for i in impls}
    pins: dict = {}
    for i in ids:
        if i not in by_id:
            raise InvalidArgumentError("conformance", "--impl", f"a registered impl id: {sorted(by_id)}", repr(i))
        pins[by_id[i].op] = i
    return pins


def _cmd_bench(args) -> int:
    try:
        from .bench import runner
    except ImportError as e:
        raise OpsadvError(f"the benchmark runner is not available ({e}); `pip install -e .[bench]` adds what it "
                          "needs") from None
    if args.plot_only:
        return runner.plot_from_json(args.plot_only, args.plot)
    try:
        i, n = (int(x) for x in args.part.split("/"))
        if not 1 <= i <= n:
            raise ValueError
    except ValueError:
        raise InvalidArgumentError("bench", "--part", "I/N with 1 <= I <= N, e.g. 2/4", repr(args.part)) from None
    import torch

    quick = args.quick
    suites = ["attention", "sparse", "gemm", "norm", "rotary", "mlp", "lce", "e2e", "decode"] if args.suite == "all" else [args.suite]
    if not torch.cuda.is_available():
        if not args.allow_cpu:
            raise OpsadvError(f"no CUDA GPU here (torch {torch.__version__}): the suites time GPU kernels against "
                              "their GPU peers, and on a CPU the numbers mean nothing; pass --allow-cpu to run a "
                              "small grid on the CPU anyway (a smoke test)")
        gpu_only = [x for x in suites if x not in CPU_SUITES]
        suites = [x for x in suites if x in CPU_SUITES]
        if not suites:
            raise OpsadvError(f"suite {args.suite} has no CPU-sized grid (GPU-sized inputs only); with --allow-cpu "
                              f"run one of {', '.join(CPU_SUITES)}")
        print("opsadv bench: warning: no CUDA GPU: running the quick grid at CPU sizes (--allow-cpu); the timings "
              "decide nothing" + (f"; skipped {', '.join(gpu_only)} (GPU-sized only)" if gpu_only else ""),
              file=sys.stderr, flush=True)
        quick = True
    if args.use_experimental_kernels:
        opsadv.use_backend("auto", experimental=True)
    return runner.run_bench(suites, quick=quick, json_path=args.json, plot_path=args.plot, case_filter=args.filter,
                            part=(i, n), progress=args.progress)


INFO_HELP = "hardware, opsadv and library versions, backends, probe results, plugin failures and side effects, profile"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="opsadv", description="fused LLM operators with an answer to 'which kernel ran, and why'")
    p.add_argument("--version", action="version", version=f"opsadv {_version()}")
    _add_log_level(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help=INFO_HELP, description=INFO_HELP)
    s.add_argument("--json", action="store_true", help="print it as JSON")
    s.add_argument("--backend", default=None, help="show the policy with this backend selected")
    s.add_argument("--impls", action="store_true", help="also list every registered kernel impl and what it declares")
    s.add_argument("--tuning", action="store_true",
                   help="also print what measurement decided on this device: impl winners with their times, kernel "
                        "configs and variants, and the conversion floor's decisions (the caches in "
                        "$OPSADV_CACHE_DIR)")
    s.set_defaults(func=_cmd_info)

    s = sub.add_parser("demo", help="run every op through the selected backend on random data and check it",
                       description="Run every op through the selected backend on random data, check each against "
                                   "the reference backend in float64 and print the kernel that ran.")
    s.add_argument("--backend", default="auto")
    s.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    s.set_defaults(func=_cmd_demo)

    s = sub.add_parser("conformance", help="compare a backend with the reference on the case catalogue",
                       description="Compare a backend with the reference backend (float64) on the case catalogue: "
                                   "the backend x op x dtype x shape-class matrix (docs/conformance.md). Exit 1 on "
                                   "any failure.")
    s.add_argument("--backend", required=True)
    s.add_argument("--quick", action="store_true")
    s.add_argument("--json", default=None, metavar="PATH")
    s.add_argument("--markdown", default=None, metavar="PATH")
    s.add_argument("--device", default=None)
    s.add_argument("--ops", default=None, metavar="LIST", help="comma-separated op names (default: all)")
    s.add_argument("--dtypes", default=None, metavar="LIST",
                   help="comma-separated input dtypes, e.g. float32 (default: the catalogue's; --quick: fp16, fp32, "
                        "bf16)")
    s.add_argument("--note", default=None, help="a line to put in the report")
    s.add_argument("--aoe-mode", type=int, default=None, help="Ascend AOE tuning mode (ascend backend only)")
    s.add_argument("--precision", default=None, choices=["fp16", "bf16", "tf32", "fp32"],
                   help="precision policy for the run (float32 inputs computed in it)")
    s.add_argument("--impl", action="append", default=None, metavar="ID",
                   help="test this impl only (repeatable; e.g. cuda.triton.flash_attention): its op's cells run it "
                        "pinned, cells it cannot serve are skipped with its reasons")
    _add_progress(s)
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=_cmd_conformance)

    s = sub.add_parser("bench", help=f"speed against peers on a GPU ({BENCH_DOC})",
                       description=f"Time opsadv's ops against their peers on a GPU and check every result against "
                                   f"the fastest peer's. How the runner times, the JSON schema and how to rerun the "
                                   f"committed numbers: {BENCH_DOC}.")
    s.add_argument("--suite", default="all", choices=["attention", "sparse", "gemm", "norm", "rotary", "mlp", "lce", "e2e", "decode", "models",
                                                      "fp8", "ring", "all"],
                   help="all: the nine op suites (not models; not fp8: FP8 GPUs only; not ring: one ring_attention "
                        "step per chunk)")
    s.add_argument("--quick", action="store_true", help="a few cases per suite")
    s.add_argument("--json", default=None, metavar="PATH", help="merge the rows into this file (after every case)")
    s.add_argument("--plot", default=None, metavar="PATH", help="speedup chart, rewritten after every case")
    s.add_argument("--plot-only", default=None, metavar="JSON",
                   help="run nothing: write the plot of this results file (to --plot, default JSON's name .png)")
    s.add_argument("--allow-cpu", action="store_true",
                   help="run without a CUDA GPU: the quick grid at CPU sizes, of the suites that have one "
                        f"({', '.join(CPU_SUITES)}); a smoke test, CPU timings decide nothing")
    s.add_argument("--use-experimental-kernels", action="store_true")
    s.add_argument("--filter", default=None, metavar="REGEX", help="only cases whose name matches")
    s.add_argument("--part", default="1/1", metavar="I/N", help="every N-th case from the I-th (split long grids)")
    _add_progress(s)
    s.set_defaults(func=_cmd_bench)

    try:
        from .convert.cli import add_subcommands
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    for sp in sub.choices.values():
        _add_log_level(sp, top=False)
    return p


def _opsadv_or_warning(record: logging.LogRecord) -> bool:
    # --log-level debug is about opsadv: other libraries' debug / info lines (matplotlib, urllib3) stay out
    return record.levelno >= logging.WARNING or record.name == "opsadv" or record.name.startswith("opsadv.")


def _setup_logging(level_name: str) -> None:
    root = logging.getLogger()
    fresh = not root.handlers          # an embedding program's (or pytest's) handlers are left alone
    logging.basicConfig(level=getattr(logging, level_name), format="%(levelname)s %(name)s: %(message)s")
    if fresh:
        for h in root.handlers:
            h.addFilter(_opsadv_or_warning)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except OpsadvError as e:
        report_error(args.command, e)
        return 2
    except BrokenPipeError:         # `opsadv info | head`: the reader left; no error to report
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"opsadv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an environment problem: one line, the traceback under --log-level debug
        report_error(args.command, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
