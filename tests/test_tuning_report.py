"""`opsadv info --tuning` / opsadv.core.tuning.report: what measurement decided on this device, from the tuning
caches (impl winners with their times, kernel configs and variants), and only this device's section."""
from __future__ import annotations

import json
import subprocess
import sys

from opsadv.core import tuning
from opsadv.core.env import current_env


def _write(tmp_path, name, data):
    """data: {section: {key: value}} in the cache file's schema (core/cachefile.py)."""
    sections = {s: {k: {"value": v, "time": 1.0} for k, v in entries.items()} for s, entries in data.items()}
    (tmp_path / name).write_text(json.dumps({"schema": 2, "sections": sections}))


def test_report_lists_this_devices_winners_and_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    here = tuning._device_key(current_env())
    _write(tmp_path, "tuning.json", {
        here: {"flash_attention|train|bfloat16|cuda|(4096,)|causal|d128": {
            "winner": "cuda.gluon.flash_attention", "times_ms": {"cuda.sdpa.cudnn": 4.1, "cuda.gluon.flash_attention": 4.0}}},
        "Other GPU|torch 0|triton 0": {"gemm|fwd|x": {"winner": "cuda.cublas.gemm", "times_ms": {"cuda.cublas.gemm": 1.0}}}})
    _write(tmp_path, "kernel_configs.json", {
        here: {"flash_attention.bwd_variant|('torch.bfloat16', 128, True)": {"variant": "ds_pipe"}}})
    try:
        text = tuning.report(current_env())
    finally:
        tuning.reload()
    assert str(tmp_path) in text
    assert "cuda.gluon.flash_attention (cuda.gluon.flash_attention 4, cuda.sdpa.cudnn 4.1 ms)" in text
    assert 'flash_attention.bwd_variant' in text and '"variant": "ds_pipe"' in text
    assert "Other GPU" not in text and "cuda.cublas.gemm" not in text        # another device's section


def test_report_says_when_nothing_was_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    try:
        text = tuning.report(current_env())
    finally:
        tuning.reload()
    assert text.count("nothing measured for this device yet") == 2


def test_info_tuning_flag(tmp_path):
    out = subprocess.run([sys.executable, "-m", "opsadv", "info", "--tuning"], capture_output=True, text=True,
                         env={**__import__("os").environ, "OPSADV_CACHE_DIR": str(tmp_path)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "opsadv tuning caches in" in out.stdout and "tuning.json" in out.stdout
    assert "floor_decisions.json: conversion floor decisions" in out.stdout and "none stored" in out.stdout


def test_seconds_spent_counts_nested_tuning_once():
    import time as _time
    from opsadv.core import tuning
    before = tuning.seconds_spent()
    with tuning.spending():
        _time.sleep(0.02)
        with tuning.spending():             # a config tuning inside an impl autotune: not counted twice
            _time.sleep(0.02)
    spent = tuning.seconds_spent() - before
    assert 0.04 <= spent < 0.07
