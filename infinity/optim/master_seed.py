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

from typing import Any

import torch

from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import FlatStore, TierManager
from infinity.storage.tiers import Residency
from infinity.zero.protocols import SteppedUnit, UnitValues

__all__ = ["merge_master", "seed_master"]


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


def merge_master(unit: SteppedUnit, master: FlatStore, span: tuple[int, int],
                 manager: TierManager, staging_pool: BufferPool | None,
                 exact: dict[Any, torch.Tensor] | None = None) -> None:
    """[Note: a change by hand reaches the master]
    The unit's fetched compute copy was changed by hand (``GatheredParameters`` with a
    ``modifier_rank``, ``model.load_state_dict``, a forward renormalising rows in place): the
    master of ``span`` takes the elements that changed. Seeded again from the whole copy, a
    16-bit one, every element of the unit lost what its master held below the compute
    dtype's precision (a read-only ``GatheredParameters(..., modifier_rank=0)`` moved a
    layer's bf16-trained weights by 2e-4 after three steps, each left bf16-exact). An element
    changed where its compute value is no longer the master rounded to the compute dtype (the
    step writes the copy as that rounding); the rest keep their master. ``exact`` (keys: the
    unit's entries, ``offset`` and ``numel``): full-precision values given to some entries (a
    state dict's; fp32 rebound into a 16-bit unit; at several ranks the source rank's,
    broadcast), which their master takes as they are, not as the copy rounded them, where the
    copy holds them rounded (NaN: none given there)."""
    lo, hi = span
    was_released = unit.residency != Residency.FETCHED
    if was_released:   # its own shard, through ``staging_pool``, as ``seed_master`` reads it
        unit.finish_fetch(manager, staging_pool, gather=False)
    try:
        current = unit.flat[lo:hi]
        if master.resident:
            _merge(master.tensor[:hi - lo], current, unit, lo, exact)
            return
        buf = manager.host_empty(master.padded, torch.float32, what="master merge")
        manager.wait(master.load_async(buf))
        _merge(buf[:hi - lo], current, unit, lo, exact)
        manager.wait(master.store_async(buf))
    finally:
        if was_released:
            unit.release(manager)


def _merge(master: torch.Tensor, current: torch.Tensor, unit: SteppedUnit, lo: int,
           exact: dict[Any, torch.Tensor] | None) -> None:
    """Elements of ``current`` (the compute copy from unit element ``lo``) that changed go to
    ``master`` (fp32, the same range); then the ``exact`` values of the entries given."""
    current = current.to(master.device)
    if current.dtype == torch.float32:
        master.copy_(current)
    else:
        changed = current != master.to(current.dtype)      # NaN != NaN: taken
        master[changed] = current[changed].float()
    hi = lo + master.numel()
    for entry, values in (exact or {}).items():
        a, b = max(lo, entry.offset), min(hi, entry.offset + entry.numel)
        if a < b:
            # only where the compute copy holds them rounded: at several ranks the copy is the
            # source rank's (broadcast), and this rank's own dict may hold other values
            src = values.reshape(-1)[a - entry.offset:b - entry.offset].to(master.device,
                                                                            torch.float32)
            here = current[a - lo:b - lo]
            master[a - lo:b - lo] = torch.where(src.to(here.dtype) == here, src,
                                                master[a - lo:b - lo])


def _store(master: FlatStore, manager: TierManager, fill, numel: int) -> None:
    """``fill(out)`` writes the range's values into ``out``: the master's own tensor where it
    is resident, else a host buffer written to the master's home and waited for."""
    if master.resident:
        fill(master.tensor[:numel])
        return
    buf = manager.host_empty(master.padded, torch.float32, what="master init")
    fill(buf[:numel])
    manager.wait(master.store_async(buf))
