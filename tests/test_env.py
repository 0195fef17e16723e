"""Capability detection from faked files and device properties; never raises."""
import pytest

import opsadv
from opsadv.core.env import detect


def _props(cc, integrated=False, name="GPU", smem=228 * 1024):
    def f(errors):
        return dict(device_type="cuda", device_name=name, device_count=1, compute_capability=cc, sm_count=16,
                    total_memory=8 << 30, shared_memory_per_block_optin=smem, l2_cache_size=4 << 20,
                    integrated=integrated, unified_memory=integrated)
    return f


def _tegra(root, model, compat):
    (root / "etc").mkdir()
    (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 3.0, GCID: 1, BOARD: generic\n")
    dt = root / "proc/device-tree"
    dt.mkdir(parents=True)
    (dt / "model").write_bytes(model.encode() + b"\x00")
    (dt / "compatible").write_bytes(b"\x00".join(c.encode() for c in compat) + b"\x00")
    (root / "proc/meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 5000000 kB\n")


def test_orin_is_jetson(tmp_path):
    _tegra(tmp_path, "NVIDIA Jetson AGX Orin Developer Kit", ["nvidia,p3737-0000", "nvidia,tegra234"])
    env = detect(root=tmp_path, cuda_properties=_props((8, 7), integrated=True, name="Orin"))
    assert env.is_jetson and env.tegra_release.startswith("# R36") and env.mem_available == 5000000 * 1024
    assert "nvidia,tegra234" in env.device_tree_compatible and "Orin" in env.device_tree_model


def test_integrated_without_tegra_is_not_jetson(tmp_path):
    env = detect(root=tmp_path, cuda_properties=_props((12, 1), integrated=True, name="NVIDIA GB10"))
    assert env.integrated and not env.is_jetson


def test_discrete_gpu_fields(tmp_path):
    env = detect(root=tmp_path, cuda_properties=_props((9, 0), name="NVIDIA H200"))
    assert env.device_type == "cuda" and env.compute_capability == (9, 0) and not env.is_jetson
    assert "NVIDIA H200" in str(env) and env.to_dict()["is_jetson"] is False


def test_broken_driver_never_raises(tmp_path):
    def broken(errors):
        errors.append("cuda properties: RuntimeError: driver too old")
        return {}
    env = detect(root=tmp_path, cuda_properties=broken)
    assert env.device_type == "cpu" and env.errors == ("cuda properties: RuntimeError: driver too old",)


def test_this_machine():
    env = opsadv.detect()
    assert env.torch_version and env.python_version and isinstance(env.triton_interpret, bool)
