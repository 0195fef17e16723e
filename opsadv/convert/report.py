"""ConversionReport: what a conversion replaced, fused and skipped (with reasons) and how the
converted model compared with the original.  Printable; `to_dict()` for JSON."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Change:
    kind: str           # "replaced" | "fused" | "skipped" | "attention" | "fx" | "fp8" | "kept" (left as it was)
    where: str          # module path (or graph node) it applies to
    what: str           # e.g. "LlamaRMSNorm -> opsadv.rms_norm"
    reason: str = ""    # for skips: why

    def __str__(self) -> str:
        tail = f"  ({self.reason})" if self.reason else ""
        return f"  {self.kind:9} {self.where or '<root>'}: {self.what}{tail}"


@dataclass
class ConversionReport:
    model: str
    opt_level: int
    backend: str
    precision: str
    changes: list[Change] = field(default_factory=list)
    validation: dict[str, Any] | None = None
    status: str = "converted"            # "converted" | "converted (validation warning)" | "refused"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    floor: list[dict[str, Any]] | None = None   # per rewrite step: kept?, ratio, ms both ways (convert/floor.py)
    fp8: dict[str, Any] | None = None   # precision="fp8": blocks in FP8 / kept bf16 and why (convert/fp8.py)
    phases: dict[str, float] = field(default_factory=dict)   # seconds: floor, autotune, validation, rewrites

    def add(self, kind: str, where: str, what: str, reason: str = "") -> None:
        self.changes.append(Change(kind, where, what, reason))

    def count(self, kind: str) -> int:
        return sum(1 for c in self.changes if c.kind == kind)

    def summary(self) -> dict[str, int]:
        return dict(Counter(c.kind for c in self.changes))

    def __str__(self) -> str:
        head = (f"opsadv conversion of {self.model}: {self.status} "
                f"(opt_level={self.opt_level}, backend={self.backend}, precision={self.precision}, "
                f"{self.seconds:.2f} s" + (": " + ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items())
                                           if self.phases else "") + ")")
        rows = [head]
        # Group identical (kind, what, reason) lines so a 22-layer model stays readable.
        groups: dict[tuple[str, str, str], list[str]] = {}
        for c in self.changes:
            groups.setdefault((c.kind, c.what, c.reason), []).append(c.where or "<root>")
        for (kind, what, reason), wheres in groups.items():
            where = wheres[0] if len(wheres) == 1 else f"{len(wheres)}x e.g. {wheres[0]}"
            rows.append(f"  {kind:9} {what} [{where}]" + (f"  ({reason})" if reason else ""))
        if self.validation:
            v = self.validation
            nums = ", ".join(f"{k}={_fmt(val)}" for k, val in v.items() if k not in ("limits", "passed"))
            rows.append(f"  validation: {'passed' if v.get('passed') else 'FAILED'}: {nums}")
            rows.append(f"    limits: {v.get('limits')}")
        if self.fp8:
            f = self.fp8
            bf16 = ", ".join(f"{u} ({', '.join(f'{k}={_fmt(v)}' for k, v in f['unit_metrics'][u].items())})"
                             for u in f["bf16_units"])
            rows.append(f"  fp8: {f['fp8_units']}/{f['units']} blocks' GEMMs in FP8 ({f['validation_forwards']} "
                        f"validation forwards); attention {f['attention']}"
                        + (f"; bf16 blocks: {bf16}" if bf16 else ""))
        if self.floor:
            rows.append("  floor (each rewrite timed without / with it; kept where not slower): " + ", ".join(
                f"{d['kind']} {d['ratio']:.2f}x {'kept' if d['kept'] else 'undone'}" for d in self.floor))
        rows += [f"  note: {n}" for n in self.notes]
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "opt_level": self.opt_level, "backend": self.backend,
                "precision": self.precision, "status": self.status, "seconds": self.seconds,
                "changes": [vars(c) for c in self.changes], "validation": self.validation, "notes": self.notes,
                "floor": self.floor, "fp8": self.fp8, "phases": self.phases}


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
