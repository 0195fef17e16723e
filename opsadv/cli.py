"""The `opsadv` command: info | demo | conformance | bench | optimize | tune."""
from __future__ import annotations

import argparse
import json
import logging
import sys

import opsadv

from .core import tuning
from .core.env import current_env
from .core.errors import InvalidArgumentError, OpsadvError, UnknownOptionError
from .core.kernel import OPS
from .demo import run_demo
from .registry import get_registry
from .testing import default_device, report as _report, run_conformance


def _cmd_info(args) -> int:
    if args.backend:
        opsadv.use_backend(args.backend)
    inf = opsadv.info(impls=args.impls)
    print(json.dumps(inf.to_dict(), indent=1, default=str) if args.json else inf)
    if args.tuning:
        print(tuning.report(current_env()))
    return 0


def _cmd_demo(args) -> int:
    return run_demo(backend=args.backend, device=args.device)


def _dtypes(spec: str) -> tuple:
    """--dtypes "float32,float16" -> torch dtypes; an unknown name is an error naming the known ones."""
    import torch
    known = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64}
    bad = [n for n in spec.split(",") if n.strip() not in known]
    if bad:
        raise UnknownOptionError("conformance", "--dtypes", f"a comma-separated list of {sorted(known)}", bad)
    return tuple(dict.fromkeys(known[n.strip()] for n in spec.split(",")))


def _cmd_conformance(args) -> int:
    if args.aoe_mode is not None:
        opsadv.use_backend(args.backend, aoe_mode=args.aoe_mode)
    device = args.device or default_device(args.backend)
    ops = args.ops.split(",") if args.ops else None
    dtypes = _dtypes(args.dtypes) if args.dtypes else None

    def progress(r):
        if args.verbose or r.status == "fail":
            print(f"  {r.status:4s} {r.op}/{r.shape_class} {r.dtype} {r.impl or ''} {r.reason[:200]}", flush=True)

    print(f"opsadv conformance: backend {args.backend} on {device} ({'quick' if args.quick else 'full'} catalogue)",
          flush=True)
    pins = _impl_pins(args.impl)
    if pins and not ops:
        ops = list(pins)
    note = args.note or ""
    if pins:
        note = (note + " " if note else "") + "Pinned impls: " + ", ".join(f"{o} -> {i}" for o, i in pins.items()) + "."
    if args.precision:
        note = (note + " " if note else "") + f"Run under precision policy {args.precision!r} (float32 cells computed in it)."
    results = []
    todo = ops or list(OPS)
    for i, op in enumerate(todo):   # one op at a time; the matrix on disk grows as each op finishes
        results += run_conformance(args.backend, quick=args.quick, device=device, ops=[op], progress=progress,
                                   precision=args.precision, impls=pins or None, dtypes=dtypes)
        left = todo[i + 1:]
        _report.write(results, backend=args.backend, device=device, quick=args.quick, json_path=args.json,
                      markdown_path=args.markdown, note=note + (f" PARTIAL: not yet run: {left}." if left else ""))
    s = _report.summary(results)
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
        from .bench.runner import run_bench
    except ImportError as e:
        print(f"opsadv bench: the benchmark runner is not available ({e})", file=sys.stderr)
        return 2
    if args.use_experimental_kernels:
        opsadv.use_backend("auto", experimental=True)
    suites = ["attention", "sparse", "gemm", "norm", "rotary", "e2e"] if args.suite == "all" else [args.suite]
    try:
        i, n = (int(x) for x in args.part.split("/"))
        assert 1 <= i <= n
    except (ValueError, AssertionError):
        raise InvalidArgumentError("bench", "--part", "I/N with 1 <= I <= N, e.g. 2/4", repr(args.part))
    return run_bench(suites, quick=args.quick, json_path=args.json, plot_path=args.plot, case_filter=args.filter,
                     part=(i, n))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opsadv", description="fused LLM operators with an answer to 'which kernel ran, and why'")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging level (INFO prints each first resolution of a shape bucket)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="hardware, backends, probe results, plugin failures, profile")
    s.add_argument("--json", action="store_true")
    s.add_argument("--backend", default=None, help="show the policy with this backend selected")
    s.add_argument("--impls", action="store_true", help="also list every registered kernel impl and what it declares")
    s.add_argument("--tuning", action="store_true",
                   help="also print what measurement decided on this device: impl winners with their times, kernel "
                        "configs and variants (the tuning caches in $OPSADV_CACHE_DIR)")
    s.set_defaults(func=_cmd_info)

    s = sub.add_parser("demo", help="run every op through the selected backend on random data and check it")
    s.add_argument("--backend", default="auto")
    s.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    s.set_defaults(func=_cmd_demo)

    s = sub.add_parser("conformance", help="compare a backend with the reference on the case catalogue")
    s.add_argument("--backend", required=True)
    s.add_argument("--quick", action="store_true")
    s.add_argument("--json", default=None, metavar="PATH")
    s.add_argument("--markdown", default=None, metavar="PATH")
    s.add_argument("--device", default=None)
    s.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
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
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=_cmd_conformance)

    s = sub.add_parser("bench", help="speed against peers on a GPU (BENCHMARKS.md)")
    s.add_argument("--suite", default="all", choices=["attention", "sparse", "gemm", "norm", "rotary", "e2e", "models", "all"])
    s.add_argument("--quick", action="store_true")
    s.add_argument("--json", default=None, metavar="PATH")
    s.add_argument("--plot", default=None, metavar="PATH")
    s.add_argument("--use-experimental-kernels", action="store_true")
    s.add_argument("--filter", default=None, metavar="REGEX", help="only cases whose name matches")
    s.add_argument("--part", default="1/1", metavar="I/N", help="every N-th case from the I-th (split long grids)")
    s.set_defaults(func=_cmd_bench)

    try:
        from .convert.cli import add_subcommands
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except OpsadvError as e:
        print(f"opsadv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
