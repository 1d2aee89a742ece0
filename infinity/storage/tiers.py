"""Tiers and residency: where a tensor lives, and the checked transitions between places.

Every large tensor has a home tier (DEVICE, HOST or NVME). A fetched unit's device copy moves
through RELEASED -> FETCHING -> FETCHED -> RELEASED; a swapped tensor through its home tier and
IN_FLIGHT. An illegal transition is a bug in the engine, and raises (it is never ignored), so a
missed release or a double fetch shows up at the first step instead of as a silent leak.
"""
from __future__ import annotations

import enum


class Tier(enum.Enum):
    """A place a model state can live."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @classmethod
    def from_offload_device(cls, device: str) -> "Tier":
        """Map a DeepSpeed ``offload_*.device`` value (none/cpu/nvme) to a tier."""
        mapping = {"none": cls.DEVICE, "cpu": cls.HOST, "nvme": cls.NVME}
        if device not in mapping:
            raise ValueError(f"offload device must be one of {sorted(mapping)}, got {device!r}")
        return mapping[device]

    @property
    def depth(self) -> int:
        """0 for DEVICE, 1 for HOST, 2 for NVME: larger is further from compute."""
        return {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}[self]


def deeper(a: Tier, b: Tier) -> Tier:
    """The tier further from compute of ``a`` and ``b``."""
    return a if a.depth >= b.depth else b


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
