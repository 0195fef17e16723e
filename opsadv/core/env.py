"""Capability detection.  `detect()` is cheap and never raises: it reads files and device
properties but creates no tensors on a device and never imports torch_npu."""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .envvars import triton_interpret


RUNTIME_VENDORS = {"cuda": "NVIDIA", "hip": "AMD", "xpu": "Intel", "npu": "Huawei"}


@dataclass(frozen=True)
class DeviceProps:
    """One GPU's facts (the EnvInfo fields that differ between the GPUs of a mixed node)."""

    index: int
    device_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    sm_count: int | None = None
    total_memory: int | None = None
    shared_memory_per_block_optin: int | None = None
    l2_cache_size: int | None = None
    gpu_arch: str | None = None
    integrated: bool = False

    def kind(self) -> tuple:
        return (self.device_name, self.compute_capability, self.gpu_arch)


@dataclass(frozen=True)
class EnvInfo:
    """What this process can run on.  Plain data: printable, comparable, JSON-able."""

    device_type: str = "cpu"                     # torch device type of the best accelerator seen: "cuda" (NVIDIA,
                                                 # or AMD under ROCm: see `runtime`), "xpu", "npu" or "cpu"
    device_name: str | None = None
    device_count: int = 0
    compute_capability: tuple[int, int] | None = None
    sm_count: int | None = None
    total_memory: int | None = None              # bytes of device memory
    shared_memory_per_block_optin: int | None = None
    l2_cache_size: int | None = None
    gpu_arch: str | None = None                  # ROCm gcnArchName, e.g. "gfx942:sramecc+:xnack-"
    integrated: bool = False                     # integrated GPU (memory shared with the CPU)
    unified_memory: bool = False
    tegra_release: str | None = None             # first line of /etc/nv_tegra_release
    device_tree_model: str | None = None
    device_tree_compatible: tuple[str, ...] = ()
    mem_available: int | None = None             # bytes, /proc/meminfo MemAvailable
    npu_installed: bool = False                  # torch_npu importable (not imported here)
    npu_soc_version: int | None = None           # only when torch_npu was already loaded
    npu_device_name: str | None = None
    triton_interpret: bool = False               # TRITON_INTERPRET=1: Triton kernels run on CPU
    torch_version: str = ""
    cuda_version: str | None = None
    hip_version: str | None = None               # torch.version.hip: set on ROCm builds (device type still "cuda")
    xpu_version: str | None = None               # torch.version.xpu: set on Intel XPU builds
    triton_version: str | None = None
    torch_npu_version: str | None = None
    cann_version: str | None = None
    python_version: str = ""
    machine: str = ""
    errors: tuple[str, ...] = ()                 # what could not be read, and why
    devices: tuple[DeviceProps, ...] = ()        # every CUDA GPU torch sees; the fields above describe device 0

    @property
    def mixed_devices(self) -> bool:
        """GPUs of more than one kind (name, capability, arch): resolution and tuning then go per device."""
        return len({d.kind() for d in self.devices}) > 1

    def for_device(self, index: int | None) -> "EnvInfo":
        """This environment as seen from GPU `index`: its name, capability, SMs and memory in the top-level
        fields (device 0, an unknown index or a node of one kind of GPU: self)."""
        if not index or index >= len(self.devices) or not self.mixed_devices:
            return self
        return _for_device(self, index)

    @property
    def is_jetson(self) -> bool:
        """Jetson needs a Tegra marker; an integrated GPU alone (e.g. DGX Spark) is not one."""
        compat = " ".join(self.device_tree_compatible)
        tegra_marker = bool(self.tegra_release) or "tegra" in compat or "nvidia,jetson" in compat
        return tegra_marker and (self.integrated or self.compute_capability in {(7, 2), (8, 7), (11, 0)}
                                 or self.device_type == "cpu")

    @property
    def runtime(self) -> str:
        """The GPU runtime behind device_type: "cuda", "hip", "xpu", "npu" or "cpu" (derived, so a faked
        device_type stays consistent)."""
        if self.device_type == "cuda":
            return "hip" if self.hip_version else "cuda"
        return self.device_type

    @property
    def vendor(self) -> str:
        return RUNTIME_VENDORS.get(self.runtime, "")

    @property
    def arch(self) -> str | None:
        """The device's architecture name as its vendor spells it: "gfx942" (ROCm, without feature flags),
        "sm_90" (CUDA); None elsewhere."""
        if self.runtime == "hip":
            return self.gpu_arch.split(":")[0] if self.gpu_arch else None
        if self.runtime == "cuda" and self.compute_capability:
            return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["is_jetson"] = self.is_jetson
        d.update(runtime=self.runtime, vendor=self.vendor, arch=self.arch)
        return d

    def __str__(self) -> str:
        rows = [f"{k:32s} {v}" for k, v in self.to_dict().items() if v not in (None, (), "", False)]
        return "EnvInfo\n  " + "\n  ".join(rows)


def _read_first_line(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode(errors="replace").replace("\x00", "\n").strip()
        return text.splitlines()[0].strip() if text else None
    except OSError:
        return None


def _read_compatible(path: Path) -> tuple[str, ...]:
    try:
        return tuple(s for s in path.read_bytes().decode(errors="replace").split("\x00") if s)
    except OSError:
        return ()


def _mem_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=64)
def _for_device(env: EnvInfo, index: int) -> EnvInfo:
    d = env.devices[index]
    return dataclasses.replace(env, device_name=d.device_name, compute_capability=d.compute_capability,
                               sm_count=d.sm_count, total_memory=d.total_memory,
                               shared_memory_per_block_optin=d.shared_memory_per_block_optin,
                               l2_cache_size=d.l2_cache_size, gpu_arch=d.gpu_arch, integrated=d.integrated,
                               unified_memory=d.integrated)


def _device_props(index: int, p, hip) -> DeviceProps:
    return DeviceProps(index=index, device_name=p.name, compute_capability=(p.major, p.minor),
                       sm_count=p.multi_processor_count, total_memory=p.total_memory,
                       shared_memory_per_block_optin=getattr(p, "shared_memory_per_block_optin", None),
                       l2_cache_size=getattr(p, "L2_cache_size", None),
                       gpu_arch=(getattr(p, "gcnArchName", None) or None) if hip else None,
                       integrated=bool(getattr(p, "is_integrated", False)))


def _cuda_properties(errors: list[str]) -> dict[str, Any]:
    """Every GPU's properties (device 0's in the top-level fields), read without allocating anything on a
    device (NVIDIA, or AMD on ROCm builds)."""
    import torch

    try:
        if not torch.cuda.is_available():
            return {}
        hip = getattr(torch.version, "hip", None)
        devices = tuple(_device_props(i, torch.cuda.get_device_properties(i), hip)
                        for i in range(torch.cuda.device_count()))
        d = devices[0]
        return dict(
            device_type="cuda",
            device_name=d.device_name,
            gpu_arch=d.gpu_arch,
            device_count=len(devices),
            compute_capability=d.compute_capability,
            sm_count=d.sm_count,
            total_memory=d.total_memory,
            shared_memory_per_block_optin=d.shared_memory_per_block_optin,
            l2_cache_size=d.l2_cache_size,
            integrated=d.integrated,
            unified_memory=d.integrated,
            devices=devices,
        )
    except Exception as e:  # a broken driver must not break detection
        errors.append(f"cuda properties: {type(e).__name__}: {e}")
        return {}


def _xpu_properties(errors: list[str]) -> dict[str, Any]:
    """Intel XPU device 0 (torch.xpu), read without allocating anything on the device."""
    import torch

    xpu = getattr(torch, "xpu", None)
    try:
        if xpu is None or not xpu.is_available():
            return {}
        p = xpu.get_device_properties(0)
        return dict(device_type="xpu", device_name=getattr(p, "name", None), device_count=xpu.device_count(),
                    total_memory=getattr(p, "total_memory", None),
                    sm_count=getattr(p, "gpu_subslice_count", None) or getattr(p, "max_compute_units", None))
    except Exception as e:  # a broken driver must not break detection
        errors.append(f"xpu properties: {type(e).__name__}: {e}")
        return {}


def _npu_properties(errors: list[str]) -> dict[str, Any]:
    """Read the NPU only if torch_npu is already loaded (e.g. by torch's autoload):
    detection itself never imports it."""
    mod = sys.modules.get("torch_npu")
    if mod is None:
        return {}
    try:
        import torch

        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return {}
        return dict(device_type="npu", device_count=torch.npu.device_count(),  # type: ignore[attr-defined]
                    npu_device_name=mod.npu.get_device_name(),
                    npu_soc_version=int(mod.npu.get_soc_version()))
    except Exception as e:
        errors.append(f"npu properties: {type(e).__name__}: {e}")
        return {}


def detect(*, root: str | os.PathLike = "/", cuda_properties: Callable[[list[str]], dict] | None = None,
           environ: dict[str, str] | None = None,
           xpu_properties: Callable[[list[str]], dict] | None = None) -> EnvInfo:
    """Describe this machine.  `root`, `cuda_properties`, `xpu_properties` and `environ` exist so tests
    can fake a Jetson or a GPU; normal callers pass nothing.  A ROCm build reports its AMD GPU through
    the cuda properties (device type "cuda", hip_version set: runtime "hip")."""
    import torch

    env = os.environ if environ is None else environ
    root = Path(root)
    errors: list[str] = []
    info: dict[str, Any] = dict(
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        hip_version=getattr(torch.version, "hip", None),
        xpu_version=getattr(torch.version, "xpu", None),
        triton_version=_version("triton"),
        torch_npu_version=_version("torch-npu") or _version("torch_npu"),
        cann_version=env.get("ASCEND_TOOLKIT_VERSION") or _read_first_line(
            Path(env.get("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")) / "version.cfg"),
        python_version=platform.python_version(),
        machine=platform.machine(),
        triton_interpret=triton_interpret(env),
        tegra_release=_read_first_line(root / "etc/nv_tegra_release"),
        device_tree_model=_read_first_line(root / "proc/device-tree/model"),
        device_tree_compatible=_read_compatible(root / "proc/device-tree/compatible"),
        mem_available=_mem_available(root / "proc/meminfo"),
    )
    try:
        info["npu_installed"] = importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        info["npu_installed"] = False
    info.update((cuda_properties or _cuda_properties)(errors))
    if info.get("device_type") != "cuda":
        info.update((xpu_properties or _xpu_properties)(errors))
    if info.get("device_type") not in ("cuda", "xpu"):
        info.update(_npu_properties(errors))
    info["errors"] = tuple(errors)
    return EnvInfo(**info)


_cached: EnvInfo | None = None


def current_env() -> EnvInfo:
    """detect() once per process (cheap after the first call)."""
    global _cached
    if _cached is None:
        _cached = detect()
    return _cached


def _reset_after_fork() -> None:
    global _cached
    _cached = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
