"""Seeding a unit's separate fp32 master: where the compute copy is not the master (16-bit
compute, or a GPU's device copy), the optimizer keeps an fp32 master of the rank's range of
each unit, and it must start as the parameters' values before the first step.

Two sources: the unit's own parameters (fetched for the time it takes, its own shard only: the
range never reaches past it), or the values a pretrained checkpoint provides, read again in
fp32 (``UnitValues``), so a 16-bit compute copy loses nothing of an fp32 file. A master homed
off the host is written from a host buffer of its padded size, waited for before the unit is
released.
"""
from __future__ import annotations

import torch

from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import FlatStore, TierManager
from infinity.storage.tiers import Residency
from infinity.zero.protocols import SteppedUnit, UnitValues

__all__ = ["seed_master"]


def seed_master(unit: SteppedUnit, master: FlatStore, span: tuple[int, int],
                manager: TierManager, staging_pool: BufferPool | None,
                values: UnitValues | None = None) -> None:
    """Seed ``master`` with the unit's elements ``span`` = [lo, hi): from ``values`` when it
    provides every parameter the range touches, else from the unit's current parameters
    (fetched through ``staging_pool`` meanwhile if it was released)."""
    lo, hi = span
    if values is not None and all(values.provides(e.name) for e in unit.params
                                  if e.offset < hi and e.offset + e.numel > lo):
        _store(master, manager, lambda out: unit.fill_range(values, lo, hi, out), hi - lo)
        return
    was_released = unit.residency != Residency.FETCHED
    if was_released:   # the own shard is all the range needs
        unit.finish_fetch(manager, staging_pool, gather=False)
    current = unit.flat[lo:hi].float()
    _store(master, manager, lambda out: out.copy_(current), hi - lo)
    if was_released:
        unit.release(manager)


def _store(master: FlatStore, manager: TierManager, fill, numel: int) -> None:
    """``fill(out)`` writes the range's values into ``out``: the master's own tensor where it
    is resident, else a host buffer written to the master's home and waited for."""
    if master.resident:
        fill(master.tensor[:numel])
        return
    buf = manager.host_empty(master.padded, torch.float32, what="master init")
    fill(buf[:numel])
    manager.wait(master.store_async(buf))
