"""The tier vocabulary: DEVICE, HOST, NVME, defined once for every layer.

The planner is the lowest layer that speaks of tiers, so ``Tier`` lives here; storage
(``infinity.storage.tiers``) re-uses it and adds residency. A ``StrEnum``: a member is equal to
its value ("host"), so the plan's tables and JSON keep their plain tier names.
"""
from __future__ import annotations

import enum

__all__ = ["Tier", "TIERS", "deeper"]


class Tier(enum.StrEnum):
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
        return _DEPTH[self]


_DEPTH = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}
TIERS: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.NVME)
"""Every tier, nearest to compute first."""


def deeper(a: Tier, b: Tier) -> Tier:
    """The tier further from compute of ``a`` and ``b`` (``a`` when they are equally deep)."""
    return a if a.depth >= b.depth else b
