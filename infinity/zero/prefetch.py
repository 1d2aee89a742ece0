"""Lookahead prefetch driven by the recorded execution order.

The first pass of each mode (training forward, backward, eval forward) records the order in
which units are fetched. Later passes walk that trace: when the unit at position i is needed,
the units at i+1, i+2, ... are fetched ahead of use, within the live-parameter and prefetch
budgets and the free host slots: an NVMe home is swapped in (and copied to the device once
its read is over, ``Unit.advance_fetch``), a host home copied to the device at once where
copies run beside compute (a GPU: ``Unit._copy_home``), so the copy overlaps the compute of
the units before it. When the order changes (a dynamic model), the trace is
re-learned from the point of divergence instead of prefetch being switched off; a wrong guess
only costs a slot, never a deadlock (a unit not prefetched is fetched synchronously).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from infinity.storage.tiers import Residency, Tier


@dataclass
class Trace:
    """The fetch order of one mode, and where the current pass is in it."""

    order: list[int] = field(default_factory=list)
    position: int = 0
    complete: bool = False
    relearns: int = 0

    def start_pass(self) -> None:
        if self.order:
            self.complete = True
        self.position = 0

    def observe(self, unit: int) -> bool:
        """Record that ``unit`` is being fetched now; True when it matches the trace."""
        if self.complete and self.position < len(self.order) and self.order[self.position] == unit:
            self.position += 1
            return True
        if self.complete:
            # Diverged: keep what matched and learn the rest of this pass again.
            del self.order[self.position:]
            self.complete = False
            self.relearns += 1
        self.order.append(unit)
        self.position = len(self.order)
        return False

    def upcoming(self) -> list[int]:
        """Units expected next, in order (empty while learning)."""
        return self.order[self.position:] if self.complete else []

    def after(self, unit: int) -> list[int]:
        """Units expected after ``unit``, in order, if ``unit`` is the last one fetched (empty
        while learning, or once another unit's fetch came since). The point after a unit's
        kernels (see [Note: gathers issued ahead] in zero/gather_ahead.py) gathers the unit
        right after it or none: a unit whose backward is done only after the next unit's
        pre-backward hook (frozen parameters: the gradient of its inputs comes after that
        hook) must not wait there for the read of the unit after that one, before the next
        unit computes."""
        last = self.order[self.position - 1] if 0 < self.position <= len(self.order) else None
        return self.upcoming() if last == unit else []


@dataclass
class PrefetchLimits:
    """Budgets bounding how far ahead to prefetch, in parameter elements."""

    bucket_numel: int          # stage3_prefetch_bucket_size: elements in flight ahead of use
    max_live_numel: int        # stage3_max_live_parameters: elements fetched or fetching
    max_reuse_numel: int = 0   # stage3_max_reuse_distance: keep a unit needed again this soon
    max_units_ahead: int = 4


def choose_prefetch(upcoming: list[int], numel_of, is_released, live_numel: int,
                    limits: PrefetchLimits, is_kept=lambda unit: False) -> list[int]:
    """Which of ``upcoming`` units to start swapping in now.

    ``numel_of(u)`` gives a unit's size, ``is_released(u)`` whether it needs a fetch at all,
    ``is_kept(u)`` whether a fetched unit is only kept for reuse. Units already fetched or in
    flight ahead of use count against the bucket (kept ones do not: nothing is in flight for
    them), so the hooks that call this for every unit do not push the frontier one unit further
    each time; the next unit always goes when nothing is ahead. Stops at the first unit that
    does not fit, so prefetch stays in execution order.
    """
    chosen: list[int] = []
    ahead = 0        # elements fetched or in flight ahead of use, and those chosen now
    started = 0      # elements chosen now (``live_numel`` counts the fetched ones already)
    seen: set[int] = set()
    for unit in upcoming:
        if len(chosen) >= limits.max_units_ahead or unit in seen:
            break
        seen.add(unit)
        size = numel_of(unit)
        if not is_released(unit):
            if not is_kept(unit):
                ahead += size
            continue
        if ahead and (ahead + size > limits.bucket_numel
                      or live_numel + started + size > limits.max_live_numel):
            break
        chosen.append(unit)
        ahead += size
        started += size
    return chosen


def reuse_distance(unit: int, upcoming: list[int], numel_of) -> int | None:
    """Elements of other units run before ``unit``'s next use in ``upcoming`` (None: not used)."""
    distance = 0
    for other in upcoming:
        if other == unit:
            return distance
        distance += numel_of(other)
    return None


def start_prefetches(units: list, upcoming: list[int], limits: PrefetchLimits, room, manager,
                     fetch_pool, noted: Callable[[int], None]) -> None:
    """The stage-3 coordinator's prefetch at a use: reads into host slots that are over go on
    to the device now, then the fetches of the ``upcoming`` units ``choose_prefetch`` picks
    are started (``Unit.start_fetch``: an NVMe home's read, a host home's copy to the device
    where copies overlap compute), within the same live and bucket limits (``room``: the
    coordinator's DeviceRoom, whose kept units are not live and are evicted for a read or
    copy into device memory; ``noted(uid)`` for each fetch started). Which units are
    prefetched is local to the rank: no collective depends on it."""
    if fetch_pool is not None:
        for unit in units:
            if unit.residency == Residency.FETCHING:
                unit.advance_fetch(manager, fetch_pool)
    if not upcoming:
        return
    # kept units never block a fetch (see [Note: keeping units for reuse]): not live here
    live = sum(u.numel for u in units if u.residency != Residency.RELEASED
               and not u.persistent and u.index not in room.kept)
    chosen = choose_prefetch(
        upcoming, lambda u: units[u].numel, lambda u: units[u].residency == Residency.RELEASED,
        live, limits, is_kept=room.kept.__contains__)
    for uid in chosen:
        # with a slot pool, keep one slot free for synchronous fetches and write-backs;
        # without one, prefetches read (or a host home is copied) into device memory while it
        # has room
        into_device = fetch_pool is None or units[uid].param_home is Tier.HOST
        if not into_device and fetch_pool.available <= 1:
            break
        if into_device:   # the read or copy goes into device memory: make room
            room.evict_kept(units[uid].nbytes, upcoming,
                            nearer_than=room.next_use_or_never(uid, upcoming))
        if not units[uid].start_fetch(manager, fetch_pool):
            break
        noted(uid)
