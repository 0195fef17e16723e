"""`opsadv optimize MODEL ...` and `opsadv tune MODEL ...` (added to the main CLI's subparsers by
opsadv/cli.py through `add_subcommands`).  MODEL is a local transformers model directory or a
built-in demo architecture (demo-llama, demo-bert, ...; tiny random configs)."""
from __future__ import annotations

import argparse
import sys

from opsadv.core.errors import OpsadvError

from . import demo as _demo
from .api import convert_model
from .export import Optimizer

_MEM = {"none": 0, "conservative": 1, "balanced": 2, "aggressive": 3}


def _mem_policy(v: str) -> int:
    if v in _MEM:
        return _MEM[v]
    if v.isdigit() and 0 <= int(v) <= 3:
        return int(v)
    raise argparse.ArgumentTypeError(f"--mem-policy must be 0-3 or one of {list(_MEM)}; got {v!r}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help=f"local transformers model directory or one of {', '.join(_demo.DEMOS)}")
    p.add_argument("--backend", default="auto", help="opsadv backend (default: auto)")
    p.add_argument("--device", default=None, help="device to run on (default: cuda if available, else cpu)")
    p.add_argument("--precision", default=None, choices=["fp16", "bf16", "fp32", "tf32"],
                   help="cast the model and set the precision policy (default: keep the model's dtype)")
    p.add_argument("--batch-size", type=int, default=2, help="batch of the example / tuning inputs")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length of the example / tuning inputs")


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser("optimize", help="convert a model to opsadv ops, validate it, optionally export .pt2",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--opt-level", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--num-streams", type=int, default=None, help="max_streams seed parameter (1-8)")
    p.add_argument("--mem-policy", type=_mem_policy, default=None,
                   help="mem_opt seed parameter: 0-3 or none/conservative/balanced/aggressive")
    p.add_argument("--tile-size", type=int, default=None, help="tile_size seed parameter (32-256, power of two)")
    p.add_argument("--use-experimental-kernels", action="store_true", help="allow experimental impls (opt level 3)")
    p.add_argument("-o", "--output", metavar="OUT.pt2", default=None, help="export a torch.export program here")
    p.set_defaults(func=optimize_main)
    t = subparsers.add_parser("tune", help="convert a model and autotune its kernels at its real shapes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(t)
    t.add_argument("--opt-level", type=int, default=2, choices=[0, 1, 2, 3])
    t.set_defaults(func=tune_main)


def _device(args):
    import torch
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _load(args, bar):
    bar.set_description(f"loading {args.model}")
    model = _demo.load_model(args.model)
    model.to(_device(args))
    bar.update()
    return model


def optimize_main(args) -> int:
    from tqdm.auto import tqdm

    try:
        with tqdm(total=3 if args.output else 2, desc="opsadv optimize", file=sys.stderr) as bar:
            model = _load(args, bar)
            seq = args.seq_len or 32
            x = _demo.example_inputs(model, args.batch_size, seq)
            bar.set_description("converting + validating")
            opt_level = 3 if args.use_experimental_kernels else args.opt_level
            opt = Optimizer(device=_device(args), precision=args.precision, opt_level=opt_level,
                            backend=args.backend, tile_size=args.tile_size, max_streams=args.num_streams,
                            mem_opt=args.mem_policy)
            conv = opt.compile(model, example_inputs=x)
            bar.update()
            if args.output:
                bar.set_description(f"exporting {args.output}")
                opt.export(conv, args.output, x)
                bar.update()
    except OpsadvError as e:
        print(f"opsadv optimize: {e}", file=sys.stderr)
        return 2
    print(conv.opsadv_report)
    if args.output:
        print(f"wrote {args.output}")
    return 0


def tune_main(args) -> int:
    from tqdm.auto import tqdm
    try:
        with tqdm(total=2, desc="opsadv tune", file=sys.stderr) as bar:
            model = _load(args, bar)
            bar.set_description("converting + validating")
            conv = convert_model(model, backend=args.backend, precision=args.precision, opt_level=args.opt_level)
            bar.update()
        rep = conv.tune_for_hardware(device=str(_device(args)), batch_size=args.batch_size, seq_len=args.seq_len)
    except OpsadvError as e:
        print(f"opsadv tune: {e}", file=sys.stderr)
        return 2
    print(conv.opsadv_report)
    print(rep)
    return 0


def main(argv=None) -> int:
    """Standalone entry (`python -m opsadv.convert.cli optimize ...`) until the main CLI wires it in."""
    parser = argparse.ArgumentParser(prog="opsadv")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
