"""Room in the device budget for the stage-3 coordinator: which fetched units to let go when a
fetch needs room (the one needed last first), and which released units to keep fetched for
reuse. The coordinator decides when a unit may go (its hooks, steps and passes); this decides
which, from the recorded order the coordinator hands it.

[Note: keeping units for reuse]
A unit whose next use, in the recorded order, comes within ``stage3_max_reuse_distance``
elements of other units is kept fetched instead of released: the last units of the forward are
the first of the backward, and (early step) the last units stepped are the first of the next
forward, whose device copies are already current. A kept unit never blocks a fetch: it is kept
only while one more unit of the largest size still fits the device budget, a fetch that needs
its room releases kept units first, the one needed last first, and a prefetch releases those
needed after the unit it reads (kept units do not count as live parameters for prefetch).
"""
from __future__ import annotations

from typing import Callable, Sequence

from infinity.storage.tiers import Residency
from infinity.zero.pass_state import UnitStatus
from infinity.zero.prefetch import PrefetchLimits, reuse_distance
from infinity.zero.unit import Unit

NEVER = 1 << 62   # the distance of a unit the recorded order does not use again
UNLIMITED = 1 << 62   # the free bytes of a device budget without a limit


class DeviceRoom:
    """The kept units (by index) and the choice of which units to drop for room."""

    def __init__(self, units: list[Unit], manager, limits: PrefetchLimits,
                 upcoming: Callable[[], list[int]], drop_kept: Callable[[int], None]) -> None:
        self.units = units
        self.manager = manager
        self.limits = limits
        self._upcoming = upcoming   # the recorded order from now on (the coordinator's phase)
        self._drop_kept = drop_kept   # lets a kept unit go (released unless something holds it)
        self.kept: set[int] = set()   # released by their hooks but kept fetched for reuse
        self.largest = max((u.nbytes for u in units if not u.persistent), default=0)

    def free_bytes(self) -> int:
        """Bytes the device budget has free now (unlimited: a very large number)."""
        limit = self.manager.device_budget.limit
        if limit is None:
            return UNLIMITED
        return limit - self.manager.device_cache.in_use_bytes()

    def next_use(self, uid: int, upcoming: list[int]) -> int | None:
        """Elements of other units run before ``uid``'s next use in ``upcoming`` (None: not
        used again)."""
        return reuse_distance(uid, upcoming, lambda u: self.units[u].numel)

    def next_use_or_never(self, uid: int, upcoming: list[int]) -> int:
        distance = self.next_use(uid, upcoming)
        return NEVER if distance is None else distance

    def keep(self, uid: int, upcoming: list[int]) -> bool:
        """Keep ``uid`` fetched when its next use is near enough and one more unit of the
        largest size still fits after dropping the kept units needed later than it; whether
        it is kept."""
        distance = self.next_use(uid, upcoming)
        if distance is None or distance >= self.limits.max_reuse_numel:   # 0: never keep
            self.kept.discard(uid)
            return False
        self.evict_kept(self.largest, upcoming, nearer_than=distance)
        if self.free_bytes() < self.largest:
            self.kept.discard(uid)
            return False
        self.kept.add(uid)
        return True

    def evict_kept(self, nbytes: int, upcoming: list[int] | None = None,
                   nearer_than: int | None = None) -> None:
        """Drop kept units, the one needed last first, until ``nbytes`` fit the device budget
        (with ``nearer_than``: only units needed later than that distance)."""
        if self.kept:
            self.free(nbytes, list(self.kept), self._drop_kept, upcoming, nearer_than)

    def free(self, nbytes: int, candidates: list[int], drop: Callable[[int], None],
             upcoming: list[int] | None = None, nearer_than: int | None = None) -> None:
        """``drop`` candidates, the one needed last first, until ``nbytes`` fit the device
        budget; with ``nearer_than``, stop at the first one needed within that distance."""
        if self.free_bytes() >= nbytes:
            return
        upcoming = self._upcoming() if upcoming is None else upcoming
        for uid in sorted(candidates, key=lambda u: -self.next_use_or_never(u, upcoming)):
            if self.free_bytes() >= nbytes:
                return
            if nearer_than is not None and self.next_use_or_never(uid, upcoming) <= nearer_than:
                return
            drop(uid)

    def cancel_prefetches(self, nbytes: int, slot_pool: bool, statuses: Sequence[UnitStatus],
                          cancel: Callable[[int], None]) -> None:
        """A unit that was not prefetched is needed now: if prefetches into device memory hold
        the room it needs, ``cancel`` them, the one needed last first (the order changed).
        Those holding device memory: every one without a slot pool (``slot_pool`` False), and
        with one those already copied to the device (``Unit.advance_fetch``); never one a step
        started ahead writes (see [Note: the deferred step runs ahead of the forward] in
        zero/steps_ahead.py)."""
        fetching = [u.index for u in self.units if u.residency == Residency.FETCHING
                    and (not slot_pool or u.copy_event is not None)
                    and not statuses[u.index].stepping]
        if fetching:
            self.free(nbytes, fetching, cancel)
