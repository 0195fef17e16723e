"""opsadv.explain on DTensor arguments: the placements the sharding rule chose (filled in by install())."""
from __future__ import annotations


def install() -> None:
    pass
