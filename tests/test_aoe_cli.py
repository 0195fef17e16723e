"""`opsadv optimize / tune --aoe-mode N`: AOE tuning on the ascend backend; with another backend N is checked as
the ascend backend checks it and the report says it had no effect (never silently accepted)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import opsadv
from opsadv.convert import cli as convert_cli
from opsadv.registry import reset_registry

pytest.importorskip("transformers")
ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from test_ascend_contract import activate_double  # noqa: E402


def cli(*args):
    e = {k: v for k, v in os.environ.items() if k != "OPSADV_PROGRESS"}
    e.update({"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    return subprocess.run([sys.executable, "-m", "opsadv", *args], capture_output=True, text=True, cwd=ROOT, env=e,
                          timeout=300)


@pytest.mark.parametrize("command", ["optimize", "tune"])
def test_aoe_mode_is_reported_inert_for_another_backend(command):
    p = cli(command, "demo-bert", "--backend", "reference", "--device", "cpu", "--seq-len", "16", "--aoe-mode", "2",
            "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    notes = json.loads(p.stdout)["report"]["notes"]
    assert any("--aoe-mode 2 had no effect" in n and "'reference'" in n for n in notes), notes


def test_aoe_mode_value_is_checked_without_an_npu():
    p = cli("optimize", "demo-bert", "--backend", "reference", "--device", "cpu", "--aoe-mode", "3")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert "aoe_mode" in line and "[1, 2, 4]" in line and "3" in line, line


def test_aoe_mode_switches_aoe_on_for_the_ascend_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    for var in ("TUNE_BANK_PATH", "AOE_MODE"):
        monkeypatch.delenv(var, raising=False)
    prev = opsadv.current_policy()
    state = activate_double(monkeypatch)           # torch_npu = the test double on an Atlas A2
    try:
        for backend in ("ascend", "auto"):
            line = convert_cli._aoe_mode(SimpleNamespace(aoe_mode=2, backend=backend))
            assert "AOE tuning on" in line
            assert opsadv.current_policy().option_dict["aoe_mode"] == 2 and os.environ["AOE_MODE"] == "2"
            assert state.aoe_dump_paths
        with pytest.raises(opsadv.errors.InvalidArgumentError, match="aoe_mode"):
            convert_cli._aoe_mode(SimpleNamespace(aoe_mode=1, backend="ascend"))   # 910B: no subgraph tuning
    finally:
        opsadv.core.policy._set_global(prev)
        sys.modules.pop("torch_npu", None)
        reset_registry()
