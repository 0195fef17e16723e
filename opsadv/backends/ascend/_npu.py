"""Access to torch_npu without importing it at `import opsadv` time, and the probe logic.

`probe_torch_npu(env)` is the only place that imports torch_npu, and only after
`importlib.util.find_spec("torch_npu")` found it.  Device work is limited to what is needed to
read the SoC code (see `_read_soc`)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any

from .soc import SocInfo, classify_soc

HINT_CANN = ("the CANN environment is probably not sourced: run `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
             "(or your CANN install's set_env.sh) so libascendcl/libhccl are found, and check that the torch_npu "
             "version matches your CANN and torch versions")
HINT_TWO_ACCELERATORS = ("torch_npu is installed next to a CUDA build of torch (\"Two accelerators cannot be used at "
                         "the same time\"): use a CPU build of torch with the matching torch_npu in this environment, "
                         "or uninstall torch_npu on CUDA machines")
TEST_DOUBLE_FLAG = "OPSADV_TEST_DOUBLE"   # set by tests/fake_torch_npu: the double runs on CPU tensors


@dataclass
class NpuState:
    """What the last probe found; kernels and activate() read it (never re-probe)."""
    available: bool = False
    reasons: tuple[str, ...] = ()
    soc: SocInfo | None = None
    device_name: str | None = None
    test_double: bool = False
    capabilities: dict[str, Any] = field(default_factory=dict)


STATE = NpuState()


def torch_npu():
    """The loaded torch_npu module (only called after a successful probe)."""
    mod = sys.modules.get("torch_npu")
    return mod if mod is not None else importlib.import_module("torch_npu")


def device_types() -> tuple[str, ...]:
    """npu, plus cpu when the in-process test double stands in for torch_npu."""
    return ("npu", "cpu") if STATE.test_double else ("npu",)


def _find_spec() -> bool:
    if "torch_npu" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def _read_soc(mod, env) -> tuple[int, str | None]:
    """The SoC code (and name).  EnvInfo already has it when torch_npu was loaded before
    detection; otherwise torch_npu.npu.get_soc_version() reads it: that call lets torch_npu
    initialize its ACL runtime lazily (it creates no tensors and no streams of ours), which is
    the one piece of device work the probe does."""
    if env.npu_soc_version is not None:
        return int(env.npu_soc_version), env.npu_device_name
    code = int(mod.npu.get_soc_version())
    try:
        name = mod.npu.get_device_name()
    except Exception:  # the name is informative only
        name = None
    return code, name


def probe_torch_npu(env) -> NpuState:
    """Find, import and classify; never raises.  Updates and returns STATE."""
    global STATE
    if env.device_type == "cuda" and "torch_npu" not in sys.modules:
        STATE = NpuState(False, ("a CUDA device is in use in this process; the ascend backend needs an Ascend NPU "
                                 "(torch_npu is not imported next to CUDA torch)",))
        return STATE
    if not _find_spec():
        STATE = NpuState(False, ("torch_npu is not installed (pip install 'opsadv[ascend]' with the CANN toolkit; "
                                 "see docs/backends/ascend.md)",))
        return STATE
    try:
        mod = importlib.import_module("torch_npu")
    except ImportError as e:
        STATE = NpuState(False, (f"import torch_npu failed: {type(e).__name__}: {e}", HINT_CANN))
        return STATE
    except RuntimeError as e:
        hint = HINT_TWO_ACCELERATORS if "two accelerators" in str(e).lower() else HINT_CANN
        STATE = NpuState(False, (f"import torch_npu failed: RuntimeError: {e}", hint))
        return STATE
    except Exception as e:  # a broken install must not break discovery
        STATE = NpuState(False, (f"import torch_npu failed: {type(e).__name__}: {e}",))
        return STATE
    double = bool(getattr(mod, TEST_DOUBLE_FLAG, False))
    try:
        if not mod.npu.is_available():
            STATE = NpuState(False, ("torch_npu imported but no NPU is visible (torch_npu.npu.is_available() is "
                                     "False): check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES",), test_double=double)
            return STATE
        code, name = _read_soc(mod, env)
    except Exception as e:
        STATE = NpuState(False, (f"reading the NPU's SoC version failed: {type(e).__name__}: {e}", HINT_CANN),
                         test_double=double)
        return STATE
    soc = classify_soc(code)
    caps = {"soc_version": code, "soc_family": soc.family, "device_name": name, "bf16": soc.bf16,
            "fusion_attention": soc.fusion_attention, "aoe_modes": soc.aoe_modes, "test_double": double,
            "torch_npu_version": getattr(mod, "__version__", None)}
    if not soc.supported:
        STATE = NpuState(False, (f"{name or 'NPU'} (SoC {code}): {soc.reason}",), soc, name, double, caps)
        return STATE
    reasons = [f"{name or soc.description} (SoC {code}, {soc.family})"]
    if soc.reason:
        reasons.append(soc.reason)
    if double:
        reasons.append("torch_npu is the in-process test double: impls also take CPU tensors")
    STATE = NpuState(True, tuple(reasons), soc, name, double, caps)
    return STATE
