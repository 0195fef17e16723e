"""The `opsadv` command as a user meets it (issue 36), run as a real process: versions, log levels, one-line
errors with a hint, refused typos, progress bars, the bench's CPU refusal / plots, help texts, --json."""
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opsadv

ROOT = Path(__file__).parent.parent
CPU_ONLY_BUILD = torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def cli(*args, env=None, timeout=300):
    e = {k: v for k, v in os.environ.items() if k != "OPSADV_PROGRESS"}
    e.update({"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "opsadv", *args], capture_output=True, text=True, cwd=ROOT, env=e,
                          timeout=timeout)


def one_line_error(p, rc=2, *needles):
    """The error is exactly one line on stderr, with a hint and no traceback."""
    assert p.returncode == rc, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr and ("hint:" in lines[0] or "--help" in lines[0]), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---- 1. versions -----------------------------------------------------------------------------------------
def test_version_flag_and_info_show_opsadv_version():
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"opsadv {opsadv.__version__}", p.stdout + p.stderr
    p = cli("info")
    assert p.returncode == 0 and f"opsadv {opsadv.__version__}" in p.stdout.splitlines()[0], p.stdout[:300]
    p = cli("info", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["opsadv_version"] == opsadv.__version__


# ---- 2. log levels and debug lines ---------------------------------------------------------------------------
def test_log_level_any_case_before_or_after_the_subcommand():
    for args in (("--log-level", "debug", "info"), ("info", "--log-level", "Debug"), ("--log-level", "warn", "info"),
                 ("info", "--log-level", "INFO")):
        p = cli(*args)
        assert p.returncode == 0, (args, p.stderr[-1000:])
    one_line_error(cli("info", "--log-level", "loud"), 2, "--log-level", "DEBUG")


def test_debug_log_shows_dispatch_details():
    p = cli("demo", "--backend", "reference", "--device", "cpu", "--log-level", "debug")
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"DEBUG opsadv\.dispatch: flash_attention candidates: reference\.flash_attention chosen", p.stderr)
    assert "DEBUG" not in cli("demo", "--backend", "reference", "--device", "cpu").stderr


class Twin:
    """A CPU backend with a float32-only rms_norm: with the reference that is two candidates to tune between."""

    from opsadv.registry import hookimpl as _hook

    @_hook
    def opsadv_backend_info(self):
        from opsadv.registry import BackendInfo
        return BackendInfo(name="twin", device_types=("cpu",), auto_priority=50)

    @_hook
    def opsadv_probe(self, env):
        from opsadv.registry import ProbeResult
        return ProbeResult(True)

    @_hook
    def opsadv_register_kernels(self, registry, env):
        from opsadv import KernelImpl
        from opsadv.ops.norm.reference import rms_norm_fwd
        registry.add(KernelImpl(id="twin.rms_norm", op="rms_norm", backend="twin", fn=rms_norm_fwd, priority=150,
                                device_types=("cpu",), dtypes=(torch.float32,), features=frozenset({"weight"})))


@pytest.mark.filterwarnings("ignore:opsadv. rms_norm falls back:RuntimeWarning")
def test_debug_log_shows_refusals_tuning_cache_misses_hits_and_decisions(tmp_path, monkeypatch, caplog):
    import dataclasses

    from opsadv.core import dispatch, tuning
    from opsadv.registry import reset_registry
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    reg.register_plugin(Twin(), name="twin")
    try:
        x, w = torch.randn(4, 40), torch.randn(40)
        with caplog.at_level(logging.DEBUG, logger="opsadv"):
            with opsadv.use_backend("auto", autotune=True):
                opsadv.ops.rms_norm(x, w)
                opsadv.ops.rms_norm(x.half(), w.half())
            dispatch.clear_cache()
            tuning.reload()
            with opsadv.use_backend("auto"):
                opsadv.ops.rms_norm(x, w)
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "tuning cache miss: rms_norm|" in text and "tuning cache hit: rms_norm|" in text, text
        assert re.search(r"autotune rms_norm\|.+: (twin|reference)\.rms_norm wins \(.*twin\.rms_norm", text), text
        assert "twin.rms_norm refused: dtype float16 not in ['float32']" in text, text
    finally:
        reset_registry()
        tuning.reload()


# ---- 3. typos refused ------------------------------------------------------------------------------------
def test_conformance_refuses_unknown_ops_and_dtypes_with_the_valid_names():
    p = cli("conformance", "--backend", "reference", "--ops", "gemmx")
    line = one_line_error(p, 2, "--ops", "gemmx", "rms_norm", "did you mean gemm?")
    assert "passed" not in p.stdout
    one_line_error(cli("conformance", "--backend", "reference", "--ops", "rms_norm", "--dtypes", "fp8"), 2,
                   "--dtypes", "fp8", "float32")
    assert line.startswith("opsadv conformance: error:")


def test_usage_errors_and_unknown_bench_suites_are_one_line():
    one_line_error(cli("bench", "--suite", "gemx"), 2, "gemx", "attention", "models")
    one_line_error(cli("nosuchcommand"), 2, "nosuchcommand")
    one_line_error(cli("conformance"), 2, "--backend")


# ---- 4. progress, bench on a CPU, plots -------------------------------------------------------------------------
def test_conformance_progress_bar_on_stderr_only_when_forced(tmp_path):
    p = cli("conformance", "--backend", "reference", "--quick", "--ops", "rms_norm", "--progress", "on")
    assert p.returncode == 0 and "0 failed" in p.stdout, p.stderr[-2000:]
    assert re.search(r"conformance: 100%\|.*\| 16/16 \[", p.stderr), p.stderr[-1000:]   # cells, with times / ETA
    assert "%|" not in p.stdout
    p = cli("conformance", "--backend", "reference", "--quick", "--ops", "rms_norm")     # not a TTY: no bar
    assert p.returncode == 0 and p.stderr == "", p.stderr[-1000:]
    p = cli("conformance", "--backend", "reference", "--quick", "--ops", "rms_norm", env={"OPSADV_PROGRESS": "on"})
    assert "16/16" in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_bench_refuses_a_cpu_only_machine_unless_allow_cpu(tmp_path):
    one_line_error(cli("bench", "--suite", "norm"), 2, "no CUDA GPU", "--allow-cpu")
    one_line_error(cli("bench", "--suite", "e2e", "--allow-cpu"), 2, "e2e", "norm")
    j, png = tmp_path / "n.json", tmp_path / "n.png"
    p = cli("bench", "--suite", "norm", "--allow-cpu", "--json", str(j), "--plot", str(png), "--progress", "on")
    assert p.returncode in (0, 1), p.stderr[-2000:]
    assert "warning: no CUDA GPU" in p.stderr and "--allow-cpu" in p.stderr
    assert re.search(r"bench: 100%\|.*\| 2/2 \[", p.stderr), p.stderr[-1000:]            # cases, with an ETA
    cases = json.loads(j.read_text())["cases"]
    assert cases and all(" t1024 " in c["case"] for c in cases)            # the CPU-sized quick grid
    assert png.stat().st_size > 0
    # --plot-only: the chart of a results file, nothing run
    png2 = tmp_path / "again.png"
    p = cli("bench", "--plot-only", str(j), "--plot", str(png2))
    assert p.returncode == 0 and png2.stat().st_size > 0 and "opsadv bench on" not in p.stdout, p.stderr
    p = cli("bench", "--plot-only", str(j))
    assert p.returncode == 0 and (tmp_path / "n.png").exists()
    one_line_error(cli("bench", "--plot-only", str(tmp_path / "missing.json")), 2, "--plot-only", "no such file")


def test_bench_plot_is_rewritten_after_every_case(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import opsadv.bench.suite_attention as S
    from opsadv.bench import runner
    monkeypatch.setattr(S, "_grid", lambda quick: [("fp16", 1, 2, 1, 24, 32, c, False) for c in (False, True)])
    seen = []
    real = runner.write_plot
    monkeypatch.setattr(runner, "write_plot",
                        lambda path, rows, title: (seen.append(len(rows)), real(path, rows, title)))
    runner.run_bench(["attention"], True, str(tmp_path / "b.json"), str(tmp_path / "b.png"), autotune=False)
    assert seen == [1, 2, 2] and (tmp_path / "b.png").stat().st_size > 0     # after each case, and at the end


# ---- 5. help texts ------------------------------------------------------------------------------------------
def test_bench_help_points_at_docs_that_exist_and_optimize_help_is_for_users():
    text = cli("bench", "--help").stdout
    docs = re.findall(r"[\w/.-]+\.md", text)
    assert docs and "BENCHMARKS.md" not in text
    for d in docs:
        assert (ROOT / d).is_file(), d
    for cmd in ("optimize", "tune"):
        text = cli(cmd, "--help").stdout
        assert "add_subcommands" not in text and "added to the main CLI" not in text
        assert "MODEL is a local transformers model directory" in text and "examples:" in text and "demo-llama" in text
        for d in re.findall(r"docs/[\w/.-]+\.md", text):
            assert (ROOT / d).is_file(), d


# ---- 6. one-line errors ---------------------------------------------------------------------------------------
def test_optimize_nonexistent_path_is_one_line_and_debug_shows_the_traceback():
    one_line_error(cli("optimize", "/nonexistent"), 2, "/nonexistent", "demo-llama")
    p = cli("optimize", "/nonexistent", "--log-level", "debug")
    assert p.returncode == 2 and "Traceback" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("opsadv optimize: error:")


def test_unknown_demo_name_refused_without_loading_anything(monkeypatch):
    one_line_error(cli("optimize", "demo-lama", "--device", "cpu"), 2, "demo-lama", "did you mean demo-llama?")
    transformers = pytest.importorskip("transformers")
    from opsadv.convert.demo import load_model
    from opsadv.errors import InvalidArgumentError

    def no_hub(*a, **k):
        raise AssertionError("transformers was asked to load a model")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    for spec in ("demo-lama", "/nonexistent", "not a model"):
        with pytest.raises(InvalidArgumentError, match="local transformers model directory"):
            load_model(spec)


@pytest.mark.skipif(not CPU_ONLY_BUILD, reason="needs a CPU-only torch build")
def test_device_cuda_on_a_cpu_only_build_is_refused_in_one_line():
    one_line_error(cli("demo", "--device", "cuda"), 2, "--device", "without CUDA", "cpu")
    one_line_error(cli("optimize", "demo-llama", "--device", "cuda"), 2, "--device", "without CUDA")
    one_line_error(cli("tune", "demo-bert", "--device", "cuda"), 2, "--device", "without CUDA")


def test_an_unexpected_failure_is_one_line_too(tmp_path):
    p = cli("conformance", "--backend", "reference", "--quick", "--ops", "rms_norm", "--json",
            str(tmp_path / "no" / "such" / "dir" / "m.json"))
    one_line_error(p, 1, "FileNotFoundError", "--log-level debug")


# ---- 9. --json -------------------------------------------------------------------------------------------------
def test_demo_json():
    p = cli("demo", "--backend", "reference", "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["device"] == "cpu" and d["failed"] == 0 and d["opsadv"] == opsadv.__version__
    assert {r["op"] for r in d["ops"]} >= {"flash_attention", "gemm", "rms_norm"}
    assert all(r["ok"] and r["impl"].startswith("reference.") for r in d["ops"])
    assert d["explain_flash_attention"]["chosen"] == "reference.flash_attention"


def test_optimize_and_tune_json(tmp_path):
    pytest.importorskip("transformers")
    p = cli("optimize", "demo-llama", "--backend", "reference", "--device", "cpu", "--seq-len", "16", "--json",
            "--floor", "on", env={"OPSADV_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["report"]["status"] and d["report"]["changes"] and d["output"] is None
    assert d["report"]["floor"] and (tmp_path / "floor_decisions.json").exists()      # measured, and stored
    p = cli("tune", "demo-bert", "--backend", "reference", "--device", "cpu", "--seq-len", "16", "--json",
            env={"OPSADV_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["tune"]["device"] == "cpu" and d["tune"]["per_op"] and d["report"]["changes"]
