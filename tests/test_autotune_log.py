"""The INFO line of a bucket's first resolution names the impl that runs and what decided it: after autotune
picked another impl than priority would, the line says so (with the times), never the priority reason."""
import dataclasses
import logging

import pytest
import torch

import opsadv
from opsadv import KernelImpl
from opsadv.ops.norm.reference import rms_norm_fwd
from opsadv.core import dispatch, tuning
from opsadv.registry import BackendInfo, ProbeResult, hookimpl, reset_registry


class Gadget:
    """A CPU backend whose rms_norm outranks the reference's (priority 150)."""

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="gadget", device_types=("cpu",), auto_priority=50)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        registry.add(KernelImpl(id="gadget.rms_norm", op="rms_norm", backend="gadget", fn=rms_norm_fwd,
                                priority=150, device_types=("cpu",), dtypes=(torch.float32,),
                                features=frozenset({"weight"})))


@pytest.fixture
def gadget(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning._TUNING.reset()
    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    reg.register_plugin(Gadget(), name="gadget")
    yield
    reset_registry()
    tuning._TUNING.reset()


def _lines(caplog):
    return [r.message for r in caplog.records if r.name == "opsadv.dispatch" and "rms_norm" in r.message
            and r.levelno == logging.INFO]


@pytest.mark.filterwarnings("ignore:opsadv. rms_norm falls back")
@pytest.mark.parametrize("fast", ["reference.rms_norm", "gadget.rms_norm"])
def test_autotune_line_names_the_measured_winner_and_what_it_replaced(gadget, caplog, monkeypatch, fast):
    times = {"reference.rms_norm": 2.0, "gadget.rms_norm": 2.0, fast: 1.0}
    order = []

    def fake_time(fn, device_type, reps=10, timing="wall"):
        fn()
        return times[order.pop(0)]
    real_rounds = tuning.time_rounds

    def rounds(steps, device_type, timing):        # tells the fake clock which candidate it times
        def tag(name, step):
            return lambda: (order.append(name), step())[1]
        return real_rounds({n: tag(n, s) for n, s in steps.items()}, device_type, timing)
    monkeypatch.setattr(tuning, "time_fn", fake_time)
    monkeypatch.setattr(tuning, "time_rounds", rounds)
    x, w = torch.randn(3, 40), torch.randn(40)
    with caplog.at_level(logging.INFO, logger="opsadv.dispatch"):
        with opsadv.use_backend("auto"), torch.no_grad():
            opsadv.ops.rms_norm(x, w)
        with opsadv.use_backend("auto", autotune=True), torch.no_grad():
            opsadv.ops.rms_norm(x, w)
    first, tuned = _lines(caplog)
    assert "-> gadget.rms_norm (highest priority" in first
    assert f"-> {fast} (autotune: measured fastest" in tuned and "highest priority" not in tuned
    assert "reference.rms_norm 2 ms" in tuned or "gadget.rms_norm 2 ms" in tuned
    if fast == "reference.rms_norm":
        assert "priority alone would pick gadget.rms_norm" in tuned
    else:
        assert "priority alone" not in tuned
    dispatch.clear_cache()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="opsadv.dispatch"):
        with opsadv.use_backend("auto"), torch.no_grad():    # a later resolution reads the stored winner
            opsadv.ops.rms_norm(x, w)
    (later,) = _lines(caplog)
    assert f"-> {fast} (measured fastest" in later
