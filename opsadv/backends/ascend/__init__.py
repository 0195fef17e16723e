"""The Ascend backend: torch_npu fused ops for Huawei Ascend NPUs (Atlas A2/A3/950 fully; 310P and
310B for norms and GEMM), with an AOE tuning mode (`use_backend("ascend", aoe_mode=2)`).

Implements exactly the hooks a third-party plugin implements.  torch_npu is imported only by the
probe, and only when importlib finds it; never at `import opsadv`.  The SoC is classified by
`torch_npu.npu.get_soc_version()`'s code (see soc.py).  Kernel modules expose `impls(soc)`.

When torch_npu is the in-process test double (tests/fake_torch_npu), the probe says so and the
impls also accept CPU tensors, so the contract tests run the real mapping code without an NPU."""
from __future__ import annotations

import importlib

from opsadv.core.kernel import Profile
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

from . import _npu
from .aoe import activate, aoe_cli_options  # noqa: F401  (aoe_cli_options public: the CLI's --aoe-mode)
from .soc import SocInfo, classify_soc  # noqa: F401

NAME = "ascend"
VERSION = "0.1.0"
KERNEL_MODULES = ("attention", "norm", "gemm", "rotary", "paged_attention", "varlen_attention", "scaled_gemm",
                  "fp8_attention", "attention_merge")


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="Huawei", device_types=("npu",), version=VERSION, auto_priority=150,
                       description="torch_npu fused ops (npu_fusion_attention, npu_rms_norm, ...) with AOE tuning")


@hookimpl
def opsadv_probe(env):
    st = _npu.probe_torch_npu(env)
    return ProbeResult(st.available, st.reasons, dict(st.capabilities))


@hookimpl
def opsadv_register_kernels(registry, env):
    soc = _npu.STATE.soc
    for name in KERNEL_MODULES:
        for impl in importlib.import_module(f"{__name__}.{name}").impls(soc):
            registry.add(impl)


def _family_is(fam: str):
    def matches(env) -> bool:
        soc = _npu.STATE.soc
        code = env.npu_soc_version if env.npu_soc_version is not None else (soc.code if soc else None)
        return code is not None and classify_soc(code).family == fam
    return matches


@hookimpl
def opsadv_profiles():
    rows = (("a2", "A2", "Atlas A2 (910B): fused attention, bf16, AOE modes 2/4"),
            ("a3", "A3", "Atlas A3: fused attention, bf16, AOE mode 2"),
            ("950", "950", "Ascend 950: fused attention, bf16"),
            ("310p", "310P", "Atlas 310P inference: fp16 norms and GEMM, AOE modes 1/2"),
            ("310b", "310B", "Atlas 310B edge: fp16 norms and GEMM"))
    return [Profile(name=n, backend=NAME, description=d, autotune=False, matches=_family_is(fam),
                    extra={"soc_family": fam}) for n, fam, d in rows]


@hookimpl
def opsadv_activate(options, env):
    return activate(dict(options), _npu.STATE)
