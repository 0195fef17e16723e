"""Several GPUs in one process (issue 40), on CPU with faked device properties: env reads every GPU, a node
of mixed GPUs resolves and picks profiles per device, one kind of GPU keeps the plain keys, and a resolved
impl runs with its inputs' GPU current."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from opsadv.core import devices, dispatch
from opsadv.core.env import current_env, detect
from opsadv.core.kernel import CallSpec, KernelImpl, Profile
from opsadv.core.policy import use_backend
from opsadv.registry import BackendInfo, ProbeResult, hookimpl, reset_registry


def _props(name, cc, sms):
    return SimpleNamespace(name=name, major=cc[0], minor=cc[1], multi_processor_count=sms, total_memory=80 << 30,
                           is_integrated=False, L2_cache_size=50 << 20, shared_memory_per_block_optin=227 << 10)


A100, H100 = _props("NVIDIA A100-SXM4-80GB", (8, 0), 108), _props("NVIDIA H100 80GB HBM3", (9, 0), 132)


@pytest.fixture
def gpus(monkeypatch):
    """torch.cuda dressed as a node with the given GPUs (device i has props[i])."""
    current_env()

    def make(*props):
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props[i])
        return detect(environ={})
    return make


def test_env_reads_every_gpu_and_views_one(gpus):
    env = gpus(A100, H100)
    assert env.device_count == 2 and [d.compute_capability for d in env.devices] == [(8, 0), (9, 0)]
    assert env.compute_capability == (8, 0) and env.mixed_devices
    one = env.for_device(1)
    assert (one.device_name, one.compute_capability, one.sm_count, one.arch) == (H100.name, (9, 0), 132, "sm_90")
    assert env.for_device(0) is env and env.for_device(None) is env and env.for_device(7) is env
    same = gpus(H100, H100)
    assert not same.mixed_devices and same.for_device(1) is same
    assert env.to_dict()["devices"][1]["device_name"] == H100.name


class _Twin:
    """A cuda-typed plugin: an sm_90-only impl above a generic one, and a profile per capability."""

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="twin", device_types=("cuda",))

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        def fn(ctx, x):
            return ("generic", torch.cuda.current_device())

        def fn90(ctx, x):
            return ("sm90", torch.cuda.current_device())
        registry.add(KernelImpl("twin.generic", "rms_norm", "twin", fn, priority=10, dtypes=(torch.float32,),
                                features=frozenset({"weight"})))
        registry.add(KernelImpl("twin.sm90", "rms_norm", "twin", fn90, priority=20, min_cc=(9, 0),
                                dtypes=(torch.float32,), features=frozenset({"weight"})))

    @hookimpl
    def opsadv_profiles(self):
        return [Profile("twin-a100", "twin", matches=lambda e: e.compute_capability == (8, 0)),
                Profile("twin-h100", "twin", matches=lambda e: e.compute_capability == (9, 0))]


def _spec(index):
    return CallSpec("rms_norm", "cuda", torch.float32, frozenset({"weight"}), (64, 1), shapes=((1, 64),),
                    device_index=index)


@pytest.fixture
def mixed_registry(gpus, monkeypatch):
    env = gpus(A100, H100)
    reg = reset_registry(env)
    reg.register_plugin(_Twin(), name="twin")
    try:
        with use_backend("twin"):
            yield reg
    finally:
        monkeypatch.undo()
        reset_registry()


def test_mixed_node_resolves_and_picks_profiles_per_device(mixed_registry):
    assert devices.mixed_gpus() and devices.several_gpus()
    for index, impl, profile in ((0, "twin.generic", "twin-a100"), (1, "twin.sm90", "twin-h100")):
        exp, r = dispatch.explain_spec(_spec(index))
        assert r is not None, str(exp)
        assert exp.chosen == impl and r.ctx.profile.name == profile, (index, exp.chosen, r.ctx.profile)
        assert r.ctx.env.compute_capability == ((8, 0), (9, 0))[index]
    refused = next(c for c in dispatch.explain_spec(_spec(0))[0].candidates if c.impl.id == "twin.sm90")
    assert any(">= 9.0" in why for why in refused.reasons)


def test_resolution_keys_carry_the_gpu_only_where_gpus_differ(mixed_registry, gpus):
    on1 = SimpleNamespace(device=torch.device("cuda", 1))
    assert devices.device_key(on1) == torch.device("cuda", 1) and devices.device_index(on1) == 1
    t = torch.empty(0)
    assert devices.device_key(t) == "cpu" and devices.device_index(t) is None     # CPU tensors: the type
    reset_registry(gpus(H100, H100))
    assert not devices.mixed_gpus() and devices.several_gpus()
    assert devices.device_key(on1) == "cuda" and devices.device_index(on1) is None


def test_resolved_impl_runs_on_its_inputs_gpu(mixed_registry, monkeypatch):
    """The guard switches to the first tensor argument's GPU for the call and back (faked: no GPU here)."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    class _Switch:
        def __init__(self, idx):
            self.idx, self.prev = idx, None

        def __enter__(self):
            self.prev, current[0] = current[0], self.idx

        def __exit__(self, *exc):
            current[0] = self.prev
    monkeypatch.setattr(torch.cuda, "device", _Switch)
    _, r = dispatch.explain_spec(_spec(1))
    on1 = SimpleNamespace(device=torch.device("cuda", 1), is_cuda=True)
    monkeypatch.setattr(devices, "_first_cuda_index", lambda args: args[0].device.index)
    assert r.run(r.ctx, on1) == ("sm90", 1) and current[0] == 0
    assert r.infer(r.ctx, on1) == ("sm90", 1)
    on0 = SimpleNamespace(device=torch.device("cuda", 0), is_cuda=True)
    assert r.run(r.ctx, on0) == ("sm90", 0)
    assert devices.guarded(r) is r                                  # never wrapped twice


def test_one_gpu_keeps_the_plain_path():
    """This machine (no GPU, or one): nothing is wrapped and keys hold the device type only."""
    if torch.cuda.device_count() > 1:
        pytest.skip("several GPUs here")
    _, r = dispatch.explain_spec(CallSpec("rms_norm", "cpu", torch.float32, frozenset({"weight"}), (64, 1),
                                          shapes=((1, 64),)))
    assert not hasattr(r.run, "__wrapped__")
    assert devices.device_key(torch.empty(1)) == "cpu"
