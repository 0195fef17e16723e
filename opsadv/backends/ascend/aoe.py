"""AOE (Ascend Optimization Engine) tuning mode: `opsadv.use_backend("ascend", aoe_mode=2)`.

The policy hands backend options to `opsadv_activate`, which lands here: the mode is checked
against the SoC (Atlas A2 accepts 2 and 4, A3 accepts 2, 310P accepts 1 and 2), the dump
directory and TUNE_BANK_PATH are set (default under $OPSADV_CACHE_DIR/aoe/<soc>), and
torch_npu.npu.set_aoe(dump_path) switches on the operator dumps AOE tunes from.

What AOE tunes: only torch_npu's whitelist (the MatMul family — so opsadv's gemm / swiglu_gemm and
the backward matmuls —, softmax, conv, elementwise ops); npu_fusion_attention and the fused norms
are not dumped.  Tuned kernels land in TUNE_BANK_PATH and are reused by later runs with the same
static shapes."""
from __future__ import annotations

import os
from pathlib import Path

from opsadv.core.errors import InvalidArgumentError, UnknownOptionError
from opsadv.core.tuning import cache_dir

from . import _npu

MODES = {1: "subgraph tuning", 2: "operator tuning", 4: "gradient-split tuning"}
OPTIONS = ("aoe_mode", "aoe_dump_path", "tune_bank_path")


def _describe(modes) -> str:
    return " and ".join(f"{m} ({MODES[m]})" for m in modes) if modes else "no AOE mode"


def check_mode(mode) -> int:
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in MODES:
        raise InvalidArgumentError("use_backend", "aoe_mode", f"one of {sorted(MODES)} "
                                   f"({', '.join(f'{k} {v}' for k, v in MODES.items())})", repr(mode))
    return mode


def aoe_cli_options(mode) -> dict:
    """What `--aoe-mode N` of `opsadv conformance/bench` passes to use_backend("ascend", **options):
    {} without a mode, else {"aoe_mode": N} (N checked here; the SoC check happens at activation)."""
    if mode is None:
        return {}
    try:
        mode = int(mode)
    except (TypeError, ValueError):
        raise InvalidArgumentError("opsadv --aoe-mode", "aoe_mode", f"one of {sorted(MODES)}", repr(mode)) from None
    return {"aoe_mode": check_mode(mode)}


def activate(options: dict, state) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise UnknownOptionError("use_backend", unknown[0], f"an option of backend 'ascend': {list(OPTIONS)} "
                                 "(or a policy option)", repr(options[unknown[0]]))
    if "aoe_mode" not in options:
        if options:
            raise InvalidArgumentError("use_backend", next(iter(options)), "given together with aoe_mode", "no aoe_mode")
        return {}
    mode = check_mode(options["aoe_mode"])
    soc = state.soc
    if mode not in soc.aoe_modes:
        raise InvalidArgumentError(
            "use_backend", "aoe_mode",
            f"a mode this NPU's AOE accepts: {soc.description} (SoC {soc.code}) accepts {_describe(soc.aoe_modes)}; "
            f"{mode} ({MODES[mode]}) is not available there", mode)
    base = cache_dir() / "aoe" / soc.tag
    dump = Path(options.get("aoe_dump_path") or base / "dump")
    bank = Path(options.get("tune_bank_path") or os.environ.get("TUNE_BANK_PATH") or base / "tune_bank")
    for d in (dump, bank):
        d.mkdir(parents=True, exist_ok=True)
    os.environ["TUNE_BANK_PATH"] = str(bank)   # read by CANN's AOE when it tunes and when it reuses results
    os.environ["AOE_MODE"] = str(mode)
    _npu.torch_npu().npu.set_aoe(str(dump))
    return {"aoe_mode": mode, "aoe_dump_path": str(dump), "tune_bank_path": str(bank)}
