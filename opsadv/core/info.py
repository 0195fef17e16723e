"""opsadv.info(): hardware, backends with probe results, plugin failures, chosen profile."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .policy import current_policy


@dataclass
class Info:
    env: Any
    backends: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    policy: str
    primary: str
    profile: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"env": self.env.to_dict(), "backends": self.backends, "plugin_failures": self.failures,
                "policy": self.policy, "primary_backend": self.primary, "profile": self.profile}

    def __str__(self) -> str:
        e = self.env
        lines = ["opsadv info", "== hardware ==",
                 f"  device      {e.device_type} {e.device_name or ''} "
                 + (f"cc {e.compute_capability[0]}.{e.compute_capability[1]} " if e.compute_capability else "")
                 + (f"{e.sm_count} SMs " if e.sm_count else "")
                 + (f"{e.total_memory / 2**30:.1f} GiB" if e.total_memory else ""),
                 f"  versions    torch {e.torch_version}, triton {e.triton_version}, cuda {e.cuda_version}"
                 + (f", torch_npu {e.torch_npu_version}" if e.torch_npu_version else ""),
                 f"  jetson      {e.is_jetson}" + (f" ({e.tegra_release})" if e.tegra_release else ""),
                 f"  triton interpreter {'on' if e.triton_interpret else 'off'}",
                 "== backends =="]
        for b in self.backends:
            state = "available" if b["available"] else "unavailable"
            lines.append(f"  {b['name']:10s} {state:11s} v{b['version']} ({b['source']}), {b['impls']} impls, "
                         f"profiles {b['profiles']}")
            for r in b["reasons"]:
                lines.append(f"      - {r}")
        lines.append("== plugin failures ==")
        lines += [f"  {f['name']} {f['version']} at {f['stage']}: {f['error']}" for f in self.failures] or ["  none"]
        lines += ["== policy ==", f"  {self.policy}; primary backend {self.primary}, profile {self.profile}"]
        return "\n".join(lines)


def info() -> Info:
    from ..registry import get_registry
    from .dispatch import select_profile

    reg = get_registry()
    pol = current_policy()
    rows = []
    for b in reg.backends.values():
        rows.append({"name": b.name, "available": b.available, "version": b.info.version, "source": b.source,
                     "vendor": b.info.vendor, "device_types": list(b.info.device_types),
                     "reasons": list(b.probe.reasons), "capabilities": {k: str(v) for k, v in b.probe.capabilities.items()},
                     "impls": len(b.impls), "profiles": [p.name for p in b.profiles]})
    primary = reg.auto_backend() if pol.backend == "auto" else reg.backends.get(pol.backend)
    try:
        prof = select_profile(primary, pol) if primary is not None and primary.profiles else None
    except Exception:
        prof = None
    fails = [{"name": f.name, "version": f.version, "stage": f.stage, "error": f.error} for f in reg.failures]
    return Info(reg.env, rows, fails, pol.describe(), primary.name if primary else "none", prof.name if prof else None)
