"""A resolution: the impl chosen for one call's bucket and the context it runs in (dispatch makes
them, tuning's autotune replaces the choice by the measured winner)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .kernel import KernelImpl, ResolveContext


@dataclass(frozen=True)
class Resolved:
    impl: KernelImpl
    ctx: ResolveContext
    run: Callable[..., Any]         # impl.fn or impl.backward
    infer: Callable[..., Any] | None = None   # call(..., inference=True): impl.inference where run is impl.fn
    # why this impl where the resolution's explanation no longer says it (autotune replaced its choice)
    why: str = ""

    def __post_init__(self):
        if self.infer is None:
            inf = self.impl.inference
            object.__setattr__(self, "infer", inf if inf is not None and self.run is self.impl.fn else self.run)
