"""Tiers and residency: where a tensor lives, and the checked transitions between places.

Every large tensor has a home tier (DEVICE, HOST or NVME: ``Tier``, defined once in
``infinity.planner.tiers``, the lowest layer that speaks of tiers, and re-used here). A fetched
unit's device copy moves through RELEASED -> FETCHING -> FETCHED -> RELEASED (``Residency``);
a swapped tensor's bytes in flight are its I/O request's, until it is waited on (see [Note:
request lifetime] in io/aio.py). An illegal transition is a bug in the engine, and raises (it is
never ignored), so a missed release or a double fetch shows up at the first step instead of as
a silent leak.
"""
from __future__ import annotations

import enum

from infinity.planner.tiers import Tier, deeper

__all__ = ["Tier", "deeper", "Residency", "ResidencyError", "ResidencyState"]


class Residency(enum.Enum):
    """Where a unit's device copy is now."""

    RELEASED = "released"   # no device storage (0 elements)
    FETCHING = "fetching"   # swap-in or copy in flight
    FETCHED = "fetched"     # full parameters on the device


_ALLOWED = {
    Residency.RELEASED: {Residency.FETCHING, Residency.FETCHED},
    Residency.FETCHING: {Residency.FETCHED, Residency.RELEASED},  # released = cancelled prefetch
    Residency.FETCHED: {Residency.RELEASED},
}


class ResidencyError(RuntimeError):
    """An illegal residency transition (an engine bug, reported with the unit's name)."""


class ResidencyState:
    """A residency with checked transitions."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.value = Residency.RELEASED

    def to(self, new: Residency) -> None:
        if new not in _ALLOWED[self.value]:
            raise ResidencyError(f"{self.owner}: illegal residency transition "
                                 f"{self.value.name} -> {new.name}")
        self.value = new

    def __eq__(self, other: object) -> bool:
        return self.value == other if isinstance(other, Residency) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.value)
