"""opsadv.info(): hardware, backends with probe results, plugin failures and side effects, chosen profile; with
impls=True also every registered kernel impl and what it declares (`opsadv info --impls`)."""
from __future__ import annotations

from .version import __version__

from dataclasses import dataclass
from typing import Any

from . import hooks
from .policy import current_policy, select_profile


@dataclass
class Info:
    env: Any
    backends: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    policy: str
    primary: str
    profile: str | None
    impls: list[dict[str, Any]] | None = None
    version: str = ""                   # opsadv's own
    side_effects: list[str] | None = None   # process globals plugins changed while loading (registry.manager)

    def to_dict(self) -> dict[str, Any]:
        d = {"opsadv_version": self.version, "env": self.env.to_dict(), "backends": self.backends,
             "plugin_failures": self.failures, "policy": self.policy, "primary_backend": self.primary,
             "profile": self.profile, "plugin_side_effects": list(self.side_effects or [])}
        if self.impls is not None:
            d["impls"] = self.impls
        return d

    def __str__(self) -> str:
        e = self.env
        lines = [f"opsadv info (opsadv {self.version})", "== hardware ==",
                 f"  device      {e.device_type} {e.device_name or ''} "
                 + (f"({e.runtime}{' ' + e.arch if e.arch else ''}) " if e.runtime not in ("cpu", e.device_type) else "")
                 + (f"cc {e.compute_capability[0]}.{e.compute_capability[1]} " if e.compute_capability else "")
                 + (f"{e.sm_count} SMs " if e.sm_count else "")
                 + (f"{e.total_memory / 2**30:.1f} GiB" if e.total_memory else ""),
                 f"  versions    opsadv {self.version}, torch {e.torch_version}, triton {e.triton_version}, "
                 f"cuda {e.cuda_version}" + (f", hip {e.hip_version}" if e.hip_version else "")
                 + (f", torch_npu {e.torch_npu_version}" if e.torch_npu_version else ""),
                 f"  jetson      {e.is_jetson}" + (f" ({e.tegra_release})" if e.tegra_release else ""),
                 f"  triton interpreter {'on' if e.triton_interpret else 'off'}",
                 "== backends =="]
        for b in self.backends:
            state = "available" if b["available"] else "unavailable"
            lines.append(f"  {b['name']:10s} {state:11s} v{b['version']} ({b['source']}), {b['impls']} impls, "
                         f"profiles {b['profiles']}" + (f", defines ops {b['ops']}" if b.get("ops") else ""))
            for r in b["reasons"]:
                lines.append(f"      - {r}")
        lines.append("== plugin failures ==")
        lines += [f"  {f['name']} {f['version']} at {f['stage']}: {f['error']}" for f in self.failures] or ["  none"]
        lines.append("== plugin side effects (process globals changed while loading) ==")
        lines += [f"  {s}" for s in self.side_effects or []] or ["  none"]
        lines += ["== policy ==", f"  {self.policy}; primary backend {self.primary}, profile {self.profile}"]
        if self.impls is not None:
            lines.append("== impls (op: id, priority, declared support) ==")
            for i in self.impls:
                flags = [f for f in ("experimental", "deterministic") if i[f]] + \
                    [f"{f} forward" for f in ("inference", "train") if i.get(f)]
                cc = "" if not (i["min_cc"] or i["max_cc"]) else \
                    f" cc {_cc(i['min_cc']) or '*'}..{_cc(i['max_cc']) or '*'}"
                cc += f" archs {'/'.join(i['archs'])}" if i.get("archs") else ""
                hd = f" head_dim {i['head_dims']}" if i["head_dims"] else ""
                lines.append(f"  {i['op']}: {i['id']} prio {i['priority']}" + (f" [{', '.join(flags)}]" if flags else "")
                             + f"\n      {'/'.join(i['dtypes'])} on {'/'.join(i['device_types'])}{cc}{hd}"
                             + (f"; features {', '.join(i['features'])}" if i["features"] else ""))
                if i["description"]:
                    lines.append(f"      {i['description']}")
        return "\n".join(lines)


def _cc(cc) -> str:
    return f"{cc[0]}.{cc[1]}" if cc else ""


def impl_rows(reg) -> list[dict[str, Any]]:
    """Every registered impl as data, by op then priority (highest first)."""
    rows = []
    for op in sorted(reg.impls_by_op):
        for i in sorted(reg.impls_by_op[op], key=lambda i: (-i.priority, i.id)):
            rows.append({"op": op, "id": i.id, "backend": i.backend, "priority": i.priority,
                         "dtypes": [str(d).replace("torch.", "") for d in i.dtypes],
                         "device_types": list(i.device_types),
                         "head_dims": list(i.head_dims) if i.head_dims else None,
                         "min_cc": list(i.min_cc) if i.min_cc else None, "max_cc": list(i.max_cc) if i.max_cc else None,
                         "cc_runtime": i.cc_runtime, "archs": list(i.archs) if i.archs is not None else None,
                         "memory": i.memory.kind if i.memory is not None else None,
                         "features": sorted(i.features), "experimental": i.experimental,
                         "deterministic": i.deterministic, "description": i.description,
                         # its own forward for no-grad calls that skip statistics / for grad-recording calls
                         "inference": i.inference is not None, "train": i.train is not None})
    return rows


def info(impls: bool = False) -> Info:
    reg = hooks.get_registry()
    pol = current_policy()
    rows = []
    for b in reg.backends.values():
        rows.append({"name": b.name, "available": b.available, "version": b.info.version, "source": b.source,
                     "vendor": b.info.vendor, "device_types": list(b.info.device_types),
                     "reasons": list(b.probe.reasons), "capabilities": {k: str(v) for k, v in b.probe.capabilities.items()},
                     "impls": len(b.impls), "profiles": [p.name for p in b.profiles], "ops": list(b.ops)})
    primary = reg.auto_backend() if pol.backend == "auto" else reg.backends.get(pol.backend)
    try:
        prof = select_profile(primary, pol) if primary is not None and primary.profiles else None
    except Exception:
        prof = None
    fails = [{"name": f.name, "version": f.version, "stage": f.stage, "error": f.error} for f in reg.failures]
    effects = reg.side_effects() if hasattr(reg, "side_effects") else []
    return Info(reg.env, rows, fails, pol.describe(), primary.name if primary else "none", prof.name if prof else None,
                impl_rows(reg) if impls else None, __version__, effects)
