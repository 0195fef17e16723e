"""`opsadv optimize MODEL ...` and `opsadv tune MODEL ...` (added to the main CLI's subparsers by
opsadv/cli.py through `add_subcommands`)."""
from __future__ import annotations

import argparse

import opsadv
from opsadv._progress import bar as progress_bar, enabled
from opsadv.cli_support import Parser as _Parser, report_error
from opsadv.core.device_check import check_device
from opsadv.registry import get_registry

from .demo import DEMOS, check_model_spec, example_inputs, load_model

_MEM = {"none": 0, "conservative": 1, "balanced": 2, "aggressive": 3}

_MODEL = ("MODEL is a local transformers model directory (read offline: nothing is downloaded) or one of the "
          "built-in tiny random models: {demos}.")

OPTIMIZE_HELP = """\
Convert a transformers model to run opsadv's fused ops (attention, norms, fused QKV / MLP GEMMs), check the
converted model's outputs against the original's on example inputs, and print what was replaced, what was left
alone and why. With -o, also export it as a torch.export program (.pt2) that opsadv.load() reads back.

{model}

examples:
  opsadv optimize demo-llama --device cpu
  opsadv optimize ./my-llama --precision bf16 -o my-llama.pt2
  opsadv optimize ./my-llama --json > report.json

More: docs/conversion.md."""

TUNE_HELP = """\
Convert a transformers model (as `opsadv optimize` does) and autotune its kernels at its real shapes on the
device: a forward, a padded forward and, for generative models, a decode step, with every candidate kernel
timed. The winners go to the tuning cache ($OPSADV_CACHE_DIR), so later runs on this device start with them.
Prints the conversion report and the kernels chosen per op (`opsadv info --tuning` shows the cache).

{model}

examples:
  opsadv tune ./my-llama --precision bf16 --batch-size 8 --seq-len 2048
  opsadv tune demo-bert --device cpu --json

More: docs/conversion.md."""


def _mem_policy(v: str) -> int:
    if v in _MEM:
        return _MEM[v]
    if v.isdigit() and 0 <= int(v) <= 3:
        return int(v)
    raise argparse.ArgumentTypeError(f"--mem-policy must be 0-3 or one of {list(_MEM)}; got {v!r}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=f"local transformers model directory or one of {', '.join(DEMOS)}")
    p.add_argument("--backend", default="auto", help="opsadv backend (default: auto)")
    p.add_argument("--device", default=None, help="device to run on (default: cuda if available, else cpu)")
    p.add_argument("--precision", default=None, choices=["fp16", "bf16", "fp32", "tf32", "fp8"],
                   help="cast the model and set the precision policy (default: keep the model's dtype)")
    p.add_argument("--batch-size", type=int, default=2, help="batch of the example / tuning inputs")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length of the example / tuning inputs")
    p.add_argument("--opt-level", type=int, default=2, choices=[0, 1, 2, 3],
                   help="0: nothing; 1: attention and norms; 2 (default): + fused QKV, residual + norm and MLP "
                        "GEMM epilogues; 3: + experimental kernels")
    p.add_argument("--aoe-mode", type=int, default=None, metavar="N",
                   help="Ascend AOE tuning mode (1 subgraph, 2 operator, 4 gradient split) for the ascend backend; "
                        "with another backend it is checked and reported as having no effect")
    p.add_argument("--floor", default=None, choices=["on", "off"],
                   help="time each rewrite kind and keep it only where the model is not slower (convert_model's "
                        "floor; default: on unless $OPSADV_CONVERT_FLOOR=0)")
    p.add_argument("--no-floor-cache", action="store_true",
                   help="measure the floor again instead of applying the decisions stored by an earlier conversion "
                        "of the same model on this machine (floor_cache=False)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--progress", default=None, choices=["auto", "on", "off"],
                   help="progress bar on stderr: auto (default, $OPSADV_PROGRESS: only on a terminal), on, off")


def add_subcommands(subparsers) -> None:
    import textwrap
    model = textwrap.fill(_MODEL.format(demos=", ".join(DEMOS)), 110)
    p = subparsers.add_parser("optimize", help="convert a model to opsadv ops, validate it, optionally export .pt2",
                              description=OPTIMIZE_HELP.format(model=model),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--num-streams", type=int, default=None,
                   help="streams run_batched may use (1-8; convert_model's max_streams)")
    p.add_argument("--mem-policy", type=_mem_policy, default=None,
                   help="activation memory policy: 0-3 or none/conservative/balanced/aggressive (mem_opt)")
    p.add_argument("--tile-size", type=int, default=None,
                   help="cap on the kernels' tile sizes (a power of two in 32-256)")
    p.add_argument("--use-experimental-kernels", action="store_true", help="allow experimental impls (opt level 3)")
    p.add_argument("-o", "--output", metavar="OUT.pt2", default=None, help="export a torch.export program here")
    p.set_defaults(func=optimize_main)
    t = subparsers.add_parser("tune", help="convert a model and autotune its kernels at its real shapes",
                              description=TUNE_HELP.format(model=model),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(t)
    t.set_defaults(func=tune_main)


def _device(args):
    """--device checked before anything loads (a CPU-only torch fails `.to("cuda")` with an AssertionError)."""
    import torch

    return check_device(args.device, args.command, "--device") if args.device else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")


def _load(args, bar, device):
    bar.set_description(f"loading {args.model}")
    model = load_model(args.model)
    model.to(device)
    bar.update()
    return model


def _aoe_mode(args) -> str | None:
    """--aoe-mode N: on the ascend backend (named, or what "auto" picks) the run goes under
    use_backend(..., aoe_mode=N), which switches CANN's AOE on; with any other backend N is checked as the ascend
    backend checks it and the report says it had no effect.  Returns the line for the report."""
    if args.aoe_mode is None:
        return None
    reg = get_registry()
    ascend = reg.backends.get("ascend")
    check = getattr(ascend.plugin, "aoe_cli_options", None) if ascend is not None else None
    if check is not None:
        check(args.aoe_mode)                    # the value refused the same way with or without an NPU
    if args.backend != "auto" and args.backend not in reg.backends:
        opsadv.use_backend(args.backend)        # an unknown name: the error lists the known ones
    name = reg.auto_backend().name if args.backend == "auto" else args.backend
    if name == "ascend":
        opsadv.use_backend(args.backend, aoe_mode=args.aoe_mode)
        return f"--aoe-mode {args.aoe_mode}: AOE tuning on for the ascend backend"
    return (f"--aoe-mode {args.aoe_mode} had no effect: AOE tunes the ascend backend, this run's backend is "
            f"{name!r}" + ("" if ascend is None or ascend.available else
                           f" (ascend unavailable: {'; '.join(ascend.probe.reasons) or 'no reason given'})"))


def _fail(command: str, e: Exception) -> int:
    report_error(command, e)
    return 2


def _floor_options(args) -> dict:
    return {"floor": None if args.floor is None else args.floor == "on",
            "floor_cache": False if args.no_floor_cache else None}


def optimize_main(args) -> int:

    try:
        device = _device(args)
        check_model_spec(args.model)
        aoe = _aoe_mode(args)
        opt_level = 3 if args.use_experimental_kernels else args.opt_level
        # built (and its options checked) before the model loads
        opt = opsadv.Optimizer(device=device, precision=args.precision, opt_level=opt_level,
                               backend=args.backend, tile_size=args.tile_size, max_streams=args.num_streams,
                               mem_opt=args.mem_policy, **_floor_options(args))
        with progress_bar(3 if args.output else 2, "opsadv optimize", "step", args.progress) as bar:
            model = _load(args, bar, device)
            seq = args.seq_len or 32
            x = example_inputs(model, args.batch_size, seq)
            bar.set_description("converting + validating")
            conv = opt.compile(model, example_inputs=x)
            if aoe:
                conv.opsadv_report.notes.append(aoe)
            bar.update()
            if args.output:
                bar.set_description(f"exporting {args.output}")
                opt.export(conv, args.output, x)
                bar.update()
    except opsadv.errors.OpsadvError as e:
        return _fail("optimize", e)
    if args.json:
        import json
        print(json.dumps({"report": conv.opsadv_report.to_dict(), "output": args.output}, indent=1, default=str))
        return 0
    print(conv.opsadv_report)
    if args.output:
        print(f"wrote {args.output}")
    return 0


def tune_main(args) -> int:

    try:
        device = _device(args)
        check_model_spec(args.model)
        aoe = _aoe_mode(args)
        with progress_bar(2, "opsadv tune", "step", args.progress) as bar:
            model = _load(args, bar, device)
            bar.set_description("converting + validating")
            conv = opsadv.convert_model(model, backend=args.backend, precision=args.precision,
                                        opt_level=args.opt_level, **_floor_options(args))
            if aoe:
                conv.opsadv_report.notes.append(aoe)
            bar.update()
        rep = conv.tune_for_hardware(device=str(device), batch_size=args.batch_size, seq_len=args.seq_len,
                                     progress=enabled(args.progress)).opsadv_tune_report
    except opsadv.errors.OpsadvError as e:
        return _fail("tune", e)
    if args.json:
        import json
        print(json.dumps({"report": conv.opsadv_report.to_dict(), "tune": rep.to_dict()}, indent=1, default=str))
        return 0
    print(conv.opsadv_report)
    print(rep)
    return 0


def main(argv=None) -> int:
    """Standalone entry (`python -m opsadv.convert.cli optimize ...`); `opsadv optimize` is the same."""
    parser = _Parser(prog="opsadv")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
