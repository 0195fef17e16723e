"""The cuda kernels' config tuner persists its winners: a second process (here: a fresh tuner
and a cleared in-memory cache) picks the stored config without timing anything."""
import json

import pytest

pytest.importorskip("triton")

from opsadv.backends.triton_common import utils as U  # noqa: E402
from opsadv.core.tuning import TUNE_ROUNDS  # noqa: E402


def test_winner_is_stored_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: False)
    timed = []
    import triton.testing
    speed = {64: 1.0, 128: 1.2, 32: 0.9}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (timed.append(1), speed[fn()])[1])
    configs = [{"BLOCK_M": 64}, {"BLOCK_M": 128}, {"BLOCK_M": 32}]
    best = U.ConfigTuner("t.fwd").pick(("k", 1), configs, lambda c: c["BLOCK_M"], autotune=True)
    assert best == {"BLOCK_M": 32} and len(timed) == 3 * TUNE_ROUNDS
    data = json.loads((tmp_path / "kernel_configs.json").read_text())
    assert data["schema"] == 2
    (section,) = data["sections"].values()
    assert list(section) == ["t.fwd|('k', 1)"] and section["t.fwd|('k', 1)"]["value"] == {"BLOCK_M": 32}
    monkeypatch.setattr(U, "_CONFIGS", None)                                # "a new process"
    again = U.ConfigTuner("t.fwd").pick(("k", 1), configs, lambda c: 1 / 0, autotune=True)
    assert again == {"BLOCK_M": 32} and len(timed) == 3 * TUNE_ROUNDS       # nothing timed or launched
    stale = U.ConfigTuner("t.fwd").pick(("k", 1), configs[:2], lambda c: c["BLOCK_M"], autotune=True)
    assert stale == {"BLOCK_M": 64} and len(timed) == 5 * TUNE_ROUNDS       # stored config not offered: re-tune


def test_every_config_compiles_before_any_is_timed(tmp_path, monkeypatch):
    """All configs launch once (compile) before the first is timed; one that fails there is dropped."""
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: False)
    events = []
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (events.append("time"), fn(), 1.0)[2])

    def launch(c):
        if c["BLOCK_M"] == 256:
            raise RuntimeError("out of shared memory")
        events.append(c["BLOCK_M"])
    configs = [{"BLOCK_M": 64}, {"BLOCK_M": 256}, {"BLOCK_M": 128}]
    best = U.ConfigTuner("t.warm").pick(("k", 2), configs, launch, autotune=True)
    assert events[:2] == [64, 128] and events[2] == "time" and events.count("time") == 2 * TUNE_ROUNDS
    assert best == {"BLOCK_M": 64}


def test_configs_are_timed_in_rotated_rounds(tmp_path, monkeypatch):
    """The default config, timed first right after the compiles, reads 30% slow (clocks ramping): timed
    once each in order it lost to a config 5% slower; the median over rotated rounds keeps it."""
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: False)
    order = []
    import triton.testing

    def bench(fn, **kw):
        m = fn()
        order.append(m)
        return {64: 1.0, 128: 1.05}[m] * (1.3 if len(order) == 1 else 1.0)
    monkeypatch.setattr(triton.testing, "do_bench", bench)
    best = U.ConfigTuner("t.ramp").pick(("k", 3), [{"BLOCK_M": 64}, {"BLOCK_M": 128}], lambda c: c["BLOCK_M"],
                                        autotune=True)
    assert best == {"BLOCK_M": 64}
    assert order[:4] == [64, 128, 128, 64]          # round 2 starts with the other config


def test_tuple_configs_are_reused_from_disk(tmp_path, monkeypatch):
    """Configs with tuples (the norm forward's (ROWS, warps), swiglu's {"cfg": (...)}) read back from JSON as
    lists: a second process must still find its stored winner (guards against re-tuning in every process)."""
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: False)
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())
    configs = [(4, 8), (2, 4), {"cfg": (1, 1024, 4)}]
    speed = {(4, 8): 1.0, (2, 4): 0.5}
    best = U.ConfigTuner("t.tuple").pick(("k", 3), configs[:2], lambda c: speed[c], autotune=True)
    assert best == (2, 4)
    monkeypatch.setattr(U, "_CONFIGS", None)                                # "a new process"
    again = U.ConfigTuner("t.tuple").pick(("k", 3), configs[:2], lambda c: 1 / 0, autotune=True)
    assert again == (2, 4) and isinstance(again, tuple)
    U.ConfigTuner("t.dict").pick(("k", 4), [{"cfg": (9, 9, 9)}, configs[2]],
                                 lambda c: 0.1 if c is configs[2] else 1.0, autotune=True)
    monkeypatch.setattr(U, "_CONFIGS", None)
    assert U.ConfigTuner("t.dict").pick(("k", 4), [{"cfg": (9, 9, 9)}, configs[2]], lambda c: 1 / 0,
                                        autotune=True) is configs[2]
