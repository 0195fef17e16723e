"""`opsadv optimize` / `opsadv tune` (opsadv.convert.cli) on built-in demo architectures."""
import argparse

import pytest

from opsadv.convert import cli

pytest.importorskip("transformers")


def _run(argv):
    parser = argparse.ArgumentParser(prog="opsadv")
    cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_optimize_demo_llama_exports(tmp_path, capsys):
    out = tmp_path / "m.pt2"
    rc = _run(["optimize", "demo-llama", "--backend", "reference", "--device", "cpu", "--opt-level", "2",
               "--num-streams", "2", "--mem-policy", "balanced", "--seq-len", "16", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists(), text
    assert "opsadv.swiglu_gemm" in text and "validation: passed" in text and "wrote" in text


def test_optimize_rejects_bad_seed(capsys):
    rc = _run(["optimize", "demo-bert", "--backend", "reference", "--device", "cpu", "--num-streams", "9"])
    assert rc == 2 and "max_streams" in capsys.readouterr().err


def test_tune_demo_bert(capsys):
    rc = _run(["tune", "demo-bert", "--backend", "reference", "--device", "cpu", "--batch-size", "2",
               "--seq-len", "24"])
    text = capsys.readouterr().out
    assert rc == 0 and "chosen kernels" in text and "reference" in text, text


def test_mem_policy_parsing():
    assert cli._mem_policy("aggressive") == 3 and cli._mem_policy("0") == 0
    with pytest.raises(argparse.ArgumentTypeError):
        cli._mem_policy("huge")


def test_main_cli_has_subcommands():
    from opsadv import cli as main_cli
    parser = main_cli.build_parser()
    args = parser.parse_args(["optimize", "demo-gpt2", "--opt-level", "1"])
    assert args.func is cli.optimize_main and args.opt_level == 1
