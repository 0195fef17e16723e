"""Device facts behind backend hooks (issue 35), on CPU with faked device properties: env knows ROCm and XPU,
the rocm backend probes / declares / refuses, the cuda backend refuses ROCm builds, capability checks belong
to the runtime they name, the tuning timer syncs the right device, jetson's chunking reads memory traits."""
import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch

import opsadv
from opsadv.backends.jetson import chunking as C
from opsadv.backends.jetson.kernels import _wrap
from opsadv.ops.flash_attention.reference import attention_bwd, attention_fwd
from opsadv.ops.gemm.reference import gemm_fwd
from opsadv.ops.norm.reference import rms_norm_fwd
from opsadv.core import tuning
from opsadv.core.errors import BackendUnavailableError
from opsadv.core.env import current_env, detect
from opsadv.core.kernel import (MEMORY_FLASH, MEMORY_FUSED, CallSpec, KernelImpl, materializes_scores,
                                temporaries)
from opsadv.registry import BackendInfo, ProbeResult, get_registry, hookimpl, reset_registry

from conftest import rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
MI300X = SimpleNamespace(name="AMD Instinct MI300X", major=9, minor=4, multi_processor_count=304,
                         total_memory=192 << 30, gcnArchName="gfx942:sramecc+:xnack-", is_integrated=False,
                         L2_cache_size=4 << 20, shared_memory_per_block_optin=64 << 10)


@pytest.fixture
def registry_with(monkeypatch):
    """Reset the registry with a faked EnvInfo; rebuilt from the real machine (torch unpatched) afterwards."""
    yield reset_registry
    monkeypatch.undo()
    reset_registry()


@pytest.fixture
def hip_build(monkeypatch):
    """torch dressed as a ROCm build: torch.version.hip set, torch.cuda sees `props` (None: no GPU)."""
    current_env()       # this machine's facts are cached before torch is dressed up

    def make(props=MI300X, count=1):
        monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
        monkeypatch.setattr(torch.version, "cuda", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: props is not None)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count if props is not None else 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    return make


def _hip_env(tmp_path, hip_build, props=MI300X, interpret=False):
    hip_build(props)
    return detect(root=tmp_path, environ={"TRITON_INTERPRET": "1"} if interpret else {})


# ---- env -------------------------------------------------------------------------------------------------
def test_env_knows_rocm(tmp_path, hip_build):
    env = _hip_env(tmp_path, hip_build)
    assert env.device_type == "cuda" and env.runtime == "hip" and env.vendor == "AMD"
    assert env.arch == "gfx942" and env.gpu_arch == "gfx942:sramecc+:xnack-" and env.hip_version.startswith("6.2")
    assert env.compute_capability == (9, 4) and env.sm_count == 304 and not env.is_jetson
    d = env.to_dict()
    assert (d["runtime"], d["vendor"], d["arch"]) == ("hip", "AMD", "gfx942") and "hip" in str(env)


def test_env_nvidia_and_cpu_runtimes(tmp_path):
    def h200(errors):
        return dict(device_type="cuda", device_name="NVIDIA H200", compute_capability=(9, 0))
    env = detect(root=tmp_path, cuda_properties=h200)
    assert (env.runtime, env.vendor, env.arch) == ("cuda", "NVIDIA", "sm_90") and env.gpu_arch is None
    cpu = detect(root=tmp_path, cuda_properties=lambda errors: {})
    assert (cpu.runtime, cpu.vendor, cpu.arch) == ("cpu", "", None)


def test_env_knows_xpu(tmp_path, monkeypatch):
    props = SimpleNamespace(name="Intel(R) Data Center GPU Max 1550", total_memory=64 << 30, gpu_subslice_count=448)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda *a: props)
    env = detect(root=tmp_path, cuda_properties=lambda errors: {})
    assert (env.device_type, env.runtime, env.vendor) == ("xpu", "xpu", "Intel")
    assert env.device_name.startswith("Intel") and env.device_count == 2 and env.sm_count == 448

    def broken():
        raise RuntimeError("level zero missing")
    monkeypatch.setattr(torch.xpu, "is_available", broken)
    env = detect(root=tmp_path, cuda_properties=lambda errors: {})
    assert env.device_type == "cpu" and any("xpu properties" in e for e in env.errors)


# ---- rocm backend ----------------------------------------------------------------------------------------
def test_rocm_probes_and_declares_on_a_faked_mi300(tmp_path, hip_build, registry_with):
    env = _hip_env(tmp_path, hip_build)
    reg = registry_with(env)
    rocm, cuda = reg.backends["rocm"], reg.backends["cuda"]
    assert rocm.available and "MI300X" in rocm.probe.reasons[0] and "gfx942" in rocm.probe.reasons[0]
    assert rocm.probe.capabilities["arch"] == "gfx942"
    assert not cuda.available and "ROCm build" in cuda.probe.reasons[0] and "'rocm'" in cuda.probe.reasons[0]
    assert not reg.backends["jetson"].available
    assert reg.auto_backend().name == "rocm"
    b = opsadv.use_backend("auto")
    assert (b.name, b.profile) == ("rocm", "rocm")
    if not HAS_TRITON:
        assert not rocm.impls
        return
    ids = {i.id for i in rocm.impls}
    for mod, expect in (("flash_attention.attention", "rocm.triton.flash_attention"), ("gemm.gemm", "rocm.triton.gemm"),
                        ("norm.norm", "rocm.triton.rms_norm"), ("swiglu.swiglu", "rocm.triton.swiglu")):
        if importlib.util.find_spec(f"opsadv.backends.triton_common.{mod}") is not None:
            assert expect in ids, ids
    assert all(i.startswith("rocm.triton.") for i in ids)
    assert not any(w in i for i in ids for w in ("gluon", "cublas", "sdpa", "_tma", "persistent", "aten")), ids
    for impl in rocm.impls:
        assert impl.backend == "rocm" and impl.cc_runtime == "hip" and "gfx942" in impl.archs
        assert impl.min_cc is None and impl.max_cc is None and impl.device_types == ("cuda",)
    assert reg.backends["rocm"].timers["cuda"].triton_bench


def _spec(op="flash_attention", device="cuda"):
    return CallSpec(op, device, torch.float16, frozenset({"causal"} if op == "flash_attention" else ()), (64, 64, 64),
                    head_dim=64,
                    shapes=((1, 2, 64, 64), (1, 2, 64, 64)))


def _reasons(impl, env, spec=None):
    return impl.rejection_reasons(spec or _spec(impl.op), env, experimental_ok=True, deterministic=False)


@pytest.mark.skipif(not HAS_TRITON, reason="the rocm impls are Triton's")
def test_rocm_capability_checks_are_its_own(tmp_path, hip_build, registry_with):
    env = _hip_env(tmp_path, hip_build)
    reg = registry_with(env)
    flash = next(i for i in reg.backends["rocm"].impls if i.op == "flash_attention")
    assert not _reasons(flash, env)
    old = dataclasses.replace(env, gpu_arch="gfx906:sramecc+:xnack-")         # MI50: not declared
    assert any("arch gfx906 not in" in r for r in _reasons(flash, old))
    nvidia = dataclasses.replace(env, hip_version=None, gpu_arch=None, compute_capability=(9, 0))
    assert any("for AMD (hip) devices; this device is NVIDIA (cuda, sm_90)" in r for r in _reasons(flash, nvidia))


def test_cuda_capability_never_claims_an_amd_gpu(tmp_path, hip_build):
    """MI300 reports "cc 9.4" through torch: an NVIDIA cc range is refused there for its vendor, not compared."""
    env = _hip_env(tmp_path, hip_build)
    sm80 = KernelImpl("x.sm80", "gemm", "x", lambda *a: None, min_cc=(8, 0))            # 9.4 >= 8.0 numerically
    sm90 = KernelImpl("x.sm90", "gemm", "x", lambda *a: None, min_cc=(9, 0), max_cc=(9, 0), device_types=("cuda", "cpu"))
    for impl in (sm80, sm90):
        why = _reasons(impl, env, _spec("gemm"))
        assert why == ["capability requirements are for NVIDIA (cuda) devices; this device is AMD (hip, gfx942)"]
    nvidia = dataclasses.replace(env, hip_version=None, gpu_arch=None, compute_capability=(9, 0))
    assert not _reasons(sm90, nvidia, _spec("gemm")) and not _reasons(sm80, nvidia, _spec("gemm"))
    assert any("<= 9.0" in r for r in _reasons(sm90, dataclasses.replace(nvidia, compute_capability=(10, 0)),
                                               _spec("gemm")))
    assert not _reasons(sm90, env, _spec("gemm", device="cpu"))          # interpreter calls: no device to check
    xpu = KernelImpl("x.pvc", "gemm", "x", lambda *a: None, device_types=("xpu",), cc_runtime="xpu", archs=("pvc",))
    assert any("for Intel (xpu) devices; this device is AMD" in r for r in _reasons(xpu, env, _spec("gemm", "xpu")))


def test_rocm_refuses_without_hip(tmp_path, hip_build, registry_with):
    from opsadv.backends.rocm import opsadv_probe
    plain = get_registry().backends["rocm"]          # this machine: not a ROCm build
    assert not plain.available and "not a ROCm build" in plain.probe.reasons[0] and not plain.impls
    with pytest.raises(BackendUnavailableError, match="not a ROCm build"):
        opsadv.use_backend("rocm")
    nvidia = detect(root=tmp_path, cuda_properties=lambda e: dict(device_type="cuda", compute_capability=(9, 0)))
    assert not opsadv_probe(env=nvidia).available
    no_gpu = _hip_env(tmp_path, hip_build, props=None)
    assert no_gpu.device_type == "cpu" and no_gpu.hip_version
    probe = opsadv_probe(env=no_gpu)
    assert not probe.available and "sees no AMD GPU" in probe.reasons[0]
    reg = registry_with(no_gpu)
    assert not reg.backends["cuda"].available and "ROCm build" in reg.backends["cuda"].probe.reasons[0]


@pytest.mark.skipif(not HAS_TRITON, reason="the rocm impls are Triton's")
def test_rocm_runs_the_cuda_triton_kernels_under_the_interpreter(tmp_path, hip_build, registry_with, seed):
    """A ROCm build without a GPU under TRITON_INTERPRET=1: rocm serves CPU tensors with cuda's Triton kernels
    (its interpreter profile); the cuda backend still refuses the ROCm build."""
    env = _hip_env(tmp_path, hip_build, props=None, interpret=True)
    reg = registry_with(env)
    assert reg.backends["rocm"].available and not reg.backends["cuda"].available
    x = torch.randn(5, 72, dtype=torch.float16)
    w = torch.randn(72, dtype=torch.float16)
    with opsadv.use_backend("rocm") as b, opsadv.trace() as t:
        assert b.profile == "interpreter"
        y = opsadv.ops.rms_norm(x, w, eps=1e-6)
        q = torch.randn(1, 2, 33, 32, dtype=torch.float16)
        o = opsadv.ops.flash_attention(q, q, q, causal=True)
    assert set(t.counts) == {"rocm.triton.rms_norm", "rocm.triton.flash_attention"}, t.counts
    assert rel_err(y, rms_norm_fwd(None, x.double(), w.double(), 1e-6, None, 0.0)[0]) < 2e-3
    want, _ = attention_fwd(None, q.double(), q.double(), q.double(), None, True, 32 ** -0.5)
    assert rel_err(o, want) < 2e-3


# ---- tuning timers ---------------------------------------------------------------------------------------
def _record_syncs(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("cuda"))
    monkeypatch.setattr(torch.xpu, "synchronize", lambda *a: seen.append("xpu"))
    monkeypatch.setattr(torch, "npu", SimpleNamespace(synchronize=lambda *a: seen.append("npu"),
                                                      is_available=lambda: True), raising=False)
    return seen


@pytest.mark.parametrize("device", ["xpu", "npu", "cpu"])
def test_time_fn_syncs_the_device_it_times(monkeypatch, device):
    seen = _record_syncs(monkeypatch)
    monkeypatch.setattr(tuning, "_DECLARED_TIMERS", {})
    ms = tuning.time_fn(lambda: None, device, reps=3)
    assert ms >= 0 and seen == ([device] * 3 if device != "cpu" else [])


def test_time_rounds_spins_up_and_syncs_xpu(monkeypatch):
    seen = _record_syncs(monkeypatch)
    monkeypatch.setattr(tuning, "_DECLARED_TIMERS", {})
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    calls = []
    times = tuning.time_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, "xpu", "wall")
    assert set(times) == {"a", "b"} and seen and set(seen) == {"xpu"}


def test_per_call_ms_uses_the_device_events(monkeypatch):
    seen = _record_syncs(monkeypatch)
    monkeypatch.setattr(tuning, "_DECLARED_TIMERS", {})

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            seen.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.5
    monkeypatch.setattr(torch.xpu, "Event", Event)
    assert tuning.per_call_ms(lambda: None, 2, False, device_type="xpu") == [1.5, 1.5]
    assert seen == ["xpu", "record", "record"] * 2
    assert tuning.per_call_ms(lambda: None, 1, False)[0] >= 0 and "cuda" not in seen     # cpu: host clock


def test_a_backend_declares_its_device_timer(monkeypatch):
    synced = []

    class Widget:
        @hookimpl
        def opsadv_backend_info(self):
            return BackendInfo(name="widget", device_types=("xpu",))

        @hookimpl
        def opsadv_probe(self, env):
            return ProbeResult(True)

        @hookimpl
        def opsadv_register_kernels(self, registry, env):
            pass

        @hookimpl
        def opsadv_device_timer(self, device_type):
            return tuning.DeviceTimer(device_type, synchronize=lambda: synced.append(device_type))

    reg = get_registry()
    try:
        rec = reg.register_plugin(Widget(), name="widget")
        assert rec.timers["xpu"].device_type == "xpu" and tuning.timer_for("xpu") is rec.timers["xpu"]
        tuning.time_fn(lambda: None, "xpu", reps=2)
        assert synced == ["xpu", "xpu"]
        assert tuning.timer_for("cuda").triton_bench            # cuda's declaration: torch.cuda, Triton's bench
    finally:
        reg.backends.pop("widget", None)
        reg.publish_timers()
    assert tuning.timer_for("xpu") is not rec.timers["xpu"]


# ---- jetson reads memory traits --------------------------------------------------------------------------
def _attn(id_, memory, features=frozenset({"causal", "cross_length"})):
    return KernelImpl(id_, "flash_attention", "cuda", attention_fwd, attention_bwd, features=features,
                      memory=memory)


def test_jetson_chunking_reads_memory_traits_not_ids():
    assert C.attn_bytes_per_score(_attn("mycorp.flash", MEMORY_FLASH)) == 0
    assert C.attn_bytes_per_score(_attn("cuda.triton.unfused", materializes_scores(12))) == 12
    assert C.attn_bytes_per_score(_attn("cuda.sdpa.x", None)) == C.ATTN_DEFAULT_BYTES_PER_SCORE     # undeclared
    gemm = KernelImpl("cuda.triton.gemm_x", "gemm", "cuda", gemm_fwd, memory=temporaries(2))
    assert C.gemm_factor(gemm) == 2 and C.gemm_factor(dataclasses.replace(gemm, memory=MEMORY_FUSED)) == 0
    assert C.gemm_factor(dataclasses.replace(gemm, memory=None)) == C.GEMM_DEFAULT_FACTOR
    # a "cuda.triton." id that declares a score matrix is chunked; a third party's flash kernel is not
    chunked = _wrap(_attn("cuda.triton.unfused", materializes_scores(8)))
    assert chunked.fn is not attention_fwd and "query-chunked" in chunked.description
    fused = _wrap(_attn("mycorp.flash", MEMORY_FLASH))
    assert fused.fn is attention_fwd and "no chunking needed" in fused.description
    expanding = _wrap(_attn("mycorp.efficient", dataclasses.replace(MEMORY_FLASH, expands_kv=True)))
    assert "GQA K/V expansion" in expanding.description
    gqa = CallSpec("flash_attention", "cuda", torch.float16, frozenset({"causal", "gqa"}), (8192, 8192, 32),
                   head_dim=128, shapes=((1, 32, 8192, 128), (1, 4, 8192, 128)))
    assert any("expands K/V" in r for r in expanding.check(gqa, None))


def test_cuda_impls_declare_memory_traits():
    from opsadv.backends.cuda.flash_attention import sdpa
    from opsadv.backends.cuda.gemm import cublas as CB
    from opsadv.backends.triton_common.gemm import gemm as G
    env = get_registry().env
    by_id = {i.id: i for i in sdpa.impls(env) + CB.impls(env) + G.impls(env)}
    assert by_id["cuda.sdpa.cudnn"].memory == MEMORY_FLASH and by_id["cuda.sdpa.flash"].memory.kind == "flash"
    assert by_id["cuda.sdpa.efficient"].memory.expands_kv and not by_id["cuda.sdpa.cudnn"].memory.expands_kv
    assert by_id["cuda.cublas.gemm"].memory == MEMORY_FUSED
    assert by_id["cuda.cublas.gemm_epilogue"].memory == temporaries(2)
    assert by_id["cuda.cublas.swiglu_gemm"].memory == temporaries(3)
    if HAS_TRITON:
        assert by_id["cuda.triton.gemm"].memory == MEMORY_FUSED
        from opsadv.backends.triton_common.flash_attention import attention
        assert all(i.memory == MEMORY_FLASH for i in attention.impls(env))


def test_jetson_profile_lives_in_the_jetson_backend():
    from opsadv.backends.cuda import profiles as CP
    from opsadv.backends.jetson import profiles as JP
    assert "jetson" not in {p.name for p in CP.PROFILES} and not hasattr(CP, "JETSON")
    reg = get_registry()
    assert [p.backend for p in reg.backends["jetson"].profiles] == ["jetson"]
    lent = next(p for p in reg.backends["cuda"].profiles if p.name == "jetson")     # use_backend("cuda", profile=...)
    assert lent.backend == "cuda" and lent.tiles == JP.JETSON.tiles and not lent.matches(reg.env)
    if reg.backends["cuda"].available:
        assert opsadv.use_backend("cuda", profile="jetson").profile == "jetson"
