"""autotune times the accepted impls; on a device it leaves the reference backend (the oracle) out."""
from types import SimpleNamespace

import torch

from opsadv.core import tuning
from opsadv.core.kernel import CallSpec, KernelImpl


def _impl(id_, backend):
    calls = []
    return KernelImpl(id_, "x", backend, lambda ctx, *a: calls.append(a) or id_, None), calls


def _run(device_type, monkeypatch):
    dev, dev_calls = _impl("cuda.triton.x", "cuda")
    ven, ven_calls = _impl("cuda.vendor.x", "cuda")
    ref, ref_calls = _impl("reference.x", "reference")
    spec = CallSpec("x", device_type, torch.float16, frozenset(), (16,))
    exp = SimpleNamespace(spec=spec, why="highest priority",
                          candidates=[SimpleNamespace(impl=i, accepted=True) for i in (dev, ven, ref)])
    stored = []
    monkeypatch.setattr(tuning, "store", lambda spec, env, m: stored.append(m))
    ms = {"cuda.triton.x": 2.0, "cuda.vendor.x": 1.0, "reference.x": 0.5}      # (the reference "wins" if timed)
    monkeypatch.setattr(tuning, "time_fn", lambda fn, dt, timing="wall": ms[fn()])
    resolved = SimpleNamespace(ctx=SimpleNamespace(env=None))
    got = tuning.autotune(exp, resolved, (1,))
    return got, stored, dev_calls, ven_calls, ref_calls


def test_device_autotune_skips_reference(monkeypatch):
    got, stored, dev_calls, ven_calls, ref_calls = _run("cuda", monkeypatch)
    assert dev_calls and ven_calls and not ref_calls
    assert set(stored[0].times_ms) == {"cuda.triton.x", "cuda.vendor.x"}
    assert got.impl.id == "cuda.vendor.x"


def test_cpu_autotune_times_reference_too(monkeypatch):
    _, stored, _, _, ref_calls = _run("cpu", monkeypatch)
    assert ref_calls and "reference.x" in stored[0].times_ms


def _tune_two(monkeypatch, spec, seen, timing="wall"):
    """Autotune two cuda impls (x 1 ms, vendor 2 ms) for spec into an in-memory tuning store."""
    impls = [_impl("cuda.triton.x", "cuda")[0], _impl("cuda.vendor.x", "cuda")[0]]
    exp = SimpleNamespace(spec=spec, why="highest priority",
                          candidates=[SimpleNamespace(impl=i, accepted=True) for i in impls])
    data = {}
    monkeypatch.setattr(tuning._TUNING, "get", lambda sec, key: data.get(sec, {}).get(key))
    monkeypatch.setattr(tuning._TUNING, "put", lambda sec, key, v: data.setdefault(sec, {}).__setitem__(key, v))
    monkeypatch.setattr(tuning, "_device_key", lambda env: "dev")
    ms = {"cuda.triton.x": 1.0, "cuda.vendor.x": 2.0}
    monkeypatch.setattr(tuning, "time_fn", lambda fn, dt, timing="wall": seen.append(timing) or ms[fn()])
    got = tuning.autotune(exp, SimpleNamespace(ctx=SimpleNamespace(env=None)), (1,), timing=timing)
    return got, [i.id for i in impls]


def test_autotune_times_with_the_policy_timing(monkeypatch):
    """timing="graph" reaches time_fn and keys the stored winner apart from wall-clock winners."""
    seen = []
    spec = CallSpec("x", "cuda", torch.float16, frozenset(), (16,))
    got, ids = _tune_two(monkeypatch, spec, seen, timing="graph")
    assert set(seen) == {"graph"} and len(seen) >= 2 and got.impl.id == "cuda.triton.x"
    assert tuning.lookup(spec, ids, None, "wall") is None            # a wall-clock resolution does not see it
    m = tuning.lookup(spec, ids, None, "graph")
    assert m.winner == "cuda.triton.x" and "CUDA-graph" in m.describe()


def test_timing_option_validated_and_set_by_graphed_conversion():
    import pytest
    import opsadv
    from opsadv.convert.api import build_policy
    from opsadv.core.errors import InvalidArgumentError
    from opsadv.core.precision import PrecisionPolicy
    with pytest.raises(InvalidArgumentError, match="timing"):
        opsadv.use_backend("reference", timing="gpu")
    with opsadv.use_backend("reference", timing="graph") as b:
        assert b.policy.timing == "graph" and "timing=graph" in b.policy.describe()
    for backend in ("auto", "reference"):
        assert build_policy(backend, PrecisionPolicy(), 2, None, None, None, cuda_graphs=True).effective().timing == "graph"
        plain = build_policy(backend, PrecisionPolicy(), 2, None, None, None)
        assert plain.effective().timing == "wall"


def test_measurement_names_the_shapes_it_was_taken_at(monkeypatch):
    """A bucket spans several shapes; explain says where its winner was measured and flags a call of
    another shape (the BERT GEMM winners at 16384 rows did not hold at 12252)."""
    measured_at = CallSpec("x", "cuda", torch.float16, frozenset(), (16384,), shapes=((16384, 768), (768, 768)))
    _, ids = _tune_two(monkeypatch, measured_at, [])
    same = tuning.lookup(measured_at, ids, None)
    assert same.shapes == ((16384, 768), (768, 768))
    assert "at shapes (16384, 768), (768, 768)" in same.describe() and "another shape" not in same.describe()
    other = CallSpec("x", "cuda", torch.float16, frozenset(), (16384,), shapes=((12252, 768), (768, 768)))
    m = tuning.lookup(other, ids, None)
    assert m.winner == "cuda.triton.x" and "another shape of this call's bucket" in m.describe()


def test_autotune_rotates_the_order_and_takes_the_median(monkeypatch):
    """The first candidate timed after a compile pause runs on ramping clocks (a one-off +1 ms here): timed
    once in a fixed order, the slower impl would win; over rotated rounds the median drops the outlier."""
    impls = [_impl("cuda.gluon.x", "cuda")[0], _impl("cuda.vendor.x", "cuda")[0]]
    exp = SimpleNamespace(spec=CallSpec("x", "cuda", torch.float16, frozenset(), (16,)), why="highest priority",
                          candidates=[SimpleNamespace(impl=i, accepted=True) for i in impls])
    monkeypatch.setattr(tuning, "store", lambda spec, env, m: None)
    order, ms = [], {"cuda.gluon.x": 1.0, "cuda.vendor.x": 1.05}
    monkeypatch.setattr(tuning, "time_fn", lambda fn, dt, timing="wall": order.append(fn()) or
                        ms[order[-1]] + (1.0 if len(order) == 1 else 0.0))
    got = tuning.autotune(exp, SimpleNamespace(ctx=SimpleNamespace(env=None)), (1,))
    assert got.impl.id == "cuda.gluon.x"
    assert order[:2] == ["cuda.gluon.x", "cuda.vendor.x"] and order[2:4] == ["cuda.vendor.x", "cuda.gluon.x"]


def test_tuning_key_tells_head_dims_apart(monkeypatch):
    """d64 and d128 calls of one (s_q, s_k, batch*heads) bucket are measured and looked up apart."""
    seen = []
    d64 = CallSpec("flash_attention", "cuda", torch.bfloat16, frozenset({"causal"}), (1024, 1024, 512), head_dim=64)
    d128 = CallSpec("flash_attention", "cuda", torch.bfloat16, frozenset({"causal"}), (1024, 1024, 512), head_dim=128)
    assert tuning.spec_key(d64) != tuning.spec_key(d128)
    _, ids = _tune_two(monkeypatch, d64, seen)
    assert tuning.lookup(d64, ids, None).winner == "cuda.triton.x"
    assert tuning.lookup(d128, ids, None) is None


def test_candidates_far_behind_after_the_first_round_are_not_timed_again(monkeypatch):
    """A candidate over OUT_OF_RACE x the fastest after round one keeps that time and is not re-run; the
    others go through every round (the winner is still the median's)."""
    impls = [_impl(i, "cuda")[0] for i in ("cuda.a", "cuda.b", "cuda.slow")]
    exp = SimpleNamespace(spec=CallSpec("x", "cuda", torch.float16, frozenset(), (16,)), why="highest priority",
                          candidates=[SimpleNamespace(impl=i, accepted=True) for i in impls])
    stored = []
    monkeypatch.setattr(tuning, "store", lambda spec, env, m: stored.append(m))
    ms = {"cuda.a": 1.0, "cuda.b": 1.1, "cuda.slow": 10.0}
    timed = []
    monkeypatch.setattr(tuning, "time_fn", lambda fn, dt, timing="wall": timed.append(fn()) or ms[timed[-1]])
    got = tuning.autotune(exp, SimpleNamespace(ctx=SimpleNamespace(env=None)), (1,))
    assert got.impl.id == "cuda.a" and timed.count("cuda.slow") == 1
    assert timed.count("cuda.a") == timed.count("cuda.b") == tuning.TUNE_ROUNDS
    assert stored[0].times_ms == ms


def test_tuning_spins_the_gpu_up_before_its_first_round(monkeypatch):
    """On a GPU the first candidate runs back to back for SPIN_UP_MS before any round is timed (clocks ramp
    after the compiles); the spin-up's calls are not timed, and a failing candidate is left to the rounds."""
    from opsadv.core import tuning
    import torch
    monkeypatch.setattr(tuning, "_gpu_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    monkeypatch.setattr(tuning, "time_fn", lambda fn, dev, timing="wall": (fn(), 1.0)[1])
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = tuning.time_rounds(steps, "cuda", "wall")
    assert times == {"a": 1.0, "b": 1.0}
    spun = len(calls) - 2 * tuning.TUNE_ROUNDS
    assert spun >= 1 and set(calls[:spun]) == {"a"}
    tuning._spin_up(lambda: 1 / 0, ms=10_000)       # returns at once: the failure is the rounds' to report
