"""Which Jetson this is, from EnvInfo's signals: /etc/nv_tegra_release, the device tree's model
and compatible strings (tegra194 Xavier, tegra234 Orin, tegra264 Thor), the integrated-GPU flag
and the compute capability (7.2, 8.7, 11.0).  An integrated GPU alone is not a Jetson (DGX Spark)."""
from __future__ import annotations

import re

# generation -> (device-tree marker, compute capability, name words)
GENERATIONS = {
    "thor": ("tegra264", (11, 0), ("thor",)),
    "orin": ("tegra234", (8, 7), ("orin",)),
    "xavier": ("tegra194", (7, 2), ("xavier",)),
}
BF16_MIN_CC = (8, 0)


def generation(env) -> str | None:
    """"thor", "orin", "xavier", "other" (a Tegra we do not know) or None (not a Jetson)."""
    if not env.is_jetson:
        return None
    compat = " ".join(env.device_tree_compatible).lower()
    names = f"{env.device_tree_model or ''} {env.device_name or ''}".lower()
    for gen, (marker, cc, words) in GENERATIONS.items():
        if marker in compat:
            return gen
    for gen, (marker, cc, words) in GENERATIONS.items():
        if env.compute_capability == cc or any(w in names for w in words):
            return gen
    return "other"


def l4t_version(env) -> str | None:
    """"35.4.1" from '# R35 (release), REVISION: 4.1, ...' (the L4T / JetPack base)."""
    m = re.search(r"R(\d+)\b.*?REVISION:\s*([0-9.]+)", env.tegra_release or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def has_bf16(env) -> bool:
    cc = env.compute_capability
    return cc is None or cc >= BF16_MIN_CC


def compute_dtype(env) -> str:
    """The half type models should run in here: bfloat16, or float16 where bf16 is missing (Xavier)."""
    return "bfloat16" if has_bf16(env) else "float16"


def not_jetson_reasons(env) -> list[str]:
    """Why EnvInfo does not describe a Jetson, signal by signal."""
    why = []
    compat = " ".join(env.device_tree_compatible).lower()
    tegra = bool(env.tegra_release) or "tegra" in compat or "nvidia,jetson" in compat
    if not env.tegra_release:
        why.append("no /etc/nv_tegra_release (not an L4T / JetPack system)")
    if env.device_tree_compatible and "tegra" not in compat:
        why.append(f"device-tree compatible {list(env.device_tree_compatible)} names no tegra SoC")
    elif not env.device_tree_compatible:
        why.append("no /proc/device-tree/compatible")
    if env.integrated and not tegra:
        why.append(f"integrated GPU {env.device_name or ''} (cc {_cc(env)}) without Tegra markers (e.g. DGX Spark): "
                   "not a Jetson; the cuda backend serves it")
    elif tegra and env.device_type == "cuda":
        why.append(f"Tegra markers, but the GPU {env.device_name or ''} (cc {_cc(env)}) is discrete "
                   "(not integrated, not cc 7.2/8.7/11.0): the cuda backend serves it")
    return why


def _cc(env) -> str:
    cc = env.compute_capability
    return f"{cc[0]}.{cc[1]}" if cc else "?"
