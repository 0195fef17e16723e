"""The cuda kernels' config tuner persists its winners: a second process (here: a fresh tuner
and a cleared in-memory cache) picks the stored config without timing anything."""
import json

import pytest

pytest.importorskip("triton")

from opsadv.backends.cuda import _triton_utils as U  # noqa: E402


def test_winner_is_stored_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: False)
    timed = []
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), timed.append(1), 3.0 - len(timed))[2])
    configs = [{"BLOCK_M": 64}, {"BLOCK_M": 128}, {"BLOCK_M": 32}]
    launched = []
    best = U.ConfigTuner("t.fwd").pick(("k", 1), configs, lambda c: launched.append(c["BLOCK_M"]), autotune=True)
    assert best == {"BLOCK_M": 32} and len(timed) == 3                       # the last timed is fastest here
    data = json.loads((tmp_path / "kernel_configs.json").read_text())
    assert list(data.values())[0] == {"t.fwd|('k', 1)": {"BLOCK_M": 32}}
    monkeypatch.setattr(U, "_CONFIGS", None)                                # "a new process"
    again = U.ConfigTuner("t.fwd").pick(("k", 1), configs, lambda c: 1 / 0, autotune=True)
    assert again == {"BLOCK_M": 32} and len(timed) == 3                      # nothing timed or launched
    stale = U.ConfigTuner("t.fwd").pick(("k", 1), configs[:2], lambda c: None, autotune=True)
    assert stale in configs[:2] and len(timed) == 5                          # stored config not offered: re-tune


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
    assert events[:2] == [64, 128] and events[2] == "time" and events.count("time") == 2
    assert best == {"BLOCK_M": 64}
