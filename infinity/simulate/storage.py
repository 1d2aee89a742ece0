"""A byte-free backend for ``infinity plan --dry-run``: the tier manager, its stores, the device
memory cache, the slot pools and the collectives as the engine's units and coordinator use them,
holding no bytes (tensors live on the meta device) and moving none, on a simulated clock.

Why: the dry run runs the engine's own ``Unit`` and ``Coordinator`` (fetch, prefetch, keep,
release; the device budget's checks) over a model built on the meta device, so its schedule is
the engine's, not a model of it. Only what would touch bytes is replaced, each by a class with
the interface the engine calls:

* ``SimManager`` for ``storage.manager.TierManager``: the same ``MemoryBudget`` objects (their
  peaks are the tier peaks reported), counters, ``create`` -> ``SimStore``, ``wait`` advancing
  the clock to the requests' ends;
* ``SimStore`` for ``FlatStore``: an NVMe store's reads and writes are requests on the
  simulated disk; a HOST store reserves its bytes in the host budget, as the real one does;
* the device memory cache is the engine's own ``storage.device_cache.DeviceMemoryCache`` (one
  policy: released blocks kept by size and counted in the device budget, other sizes evicted
  first) over ``NoMemory``, meta storages resized instead of memory moved
  (storage/device_cache.py [Note: one cache policy, two memories]); disabled as on a GPU when
  the device is not the CPU;
* ``SimPool`` for ``storage.buffer_pool.BufferPool``: slots of meta memory, reserved in the host
  budget;
* the collectives (``comm.collectives.Collectives``) are ``simulate.collectives.SimCollectives``,
  on the network lane of this clock.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from infinity.base.budget import MemoryBudget
from infinity.simulate.clock import Lane, SimClock
from infinity.storage.buffer_pool import Slot
from infinity.storage.device_cache import DeviceMemoryCache, NoMemory
from infinity.storage.manager import TierCounters, padded_numel
from infinity.storage.tiers import Tier
from infinity.storage.transfers import DeviceCopies, ImmediateCopies

__all__ = ["SimRequest", "SimManager", "SimStore", "SimPool", "META"]

META = torch.device("meta")


class SimRequest:
    """An I/O request that is over at ``end`` on ``clock``."""

    def __init__(self, clock: SimClock, end: float) -> None:
        self.clock, self.end = clock, end

    def done(self) -> bool:
        return self.clock.now >= self.end

    def wait(self, timeout: float | None = None) -> int:
        self.clock.wait_until(self.end)
        return 0


@dataclass
class SimDisk:
    """The swap path: reads and writes share one lane, each at its own rate."""

    clock: SimClock
    read_Bps: float
    write_Bps: float
    lane: Lane = field(init=False)

    def __post_init__(self) -> None:
        self.lane = Lane(self.clock, 1.0, "NVMe")     # amounts in seconds

    def read(self, nbytes: int, not_before: float | None = None) -> SimRequest:
        return SimRequest(self.clock, self.lane.schedule(
            nbytes / self.read_Bps if self.read_Bps > 0 else 0.0, not_before,
            f"read {nbytes / 2**20:.1f} MiB"))

    def write(self, nbytes: int, not_before: float | None = None) -> SimRequest:
        return SimRequest(self.clock, self.lane.schedule(
            nbytes / self.write_Bps if self.write_Bps > 0 else 0.0, not_before,
            f"write {nbytes / 2**20:.1f} MiB"))


class SimStore:
    """A ``FlatStore`` without bytes: NVMe transfers go to the simulated disk."""

    def __init__(self, manager: "SimManager", name: str, numel: int, dtype: torch.dtype,
                 home: Tier, doubled: bool = False) -> None:
        self.manager, self.name, self.numel, self.dtype, self.home = manager, name, numel, dtype, home
        self.padded = padded_numel(numel, dtype)
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = self.padded * self.itemsize
        self.doubled = doubled and home is Tier.NVME
        self._tensor = None
        if home is Tier.HOST:
            manager.host_budget.reserve(self.nbytes, name)
            self._tensor = torch.empty(self.padded, dtype=dtype, device=META)
        elif home is Tier.DEVICE:
            manager.device_budget.reserve(self.nbytes, name)
            self._tensor = torch.empty(self.padded, dtype=dtype, device=META)
        else:
            manager.nvme_bytes += self.nbytes * (2 if self.doubled else 1)

    @property
    def resident(self) -> bool:
        return self._tensor is not None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError(f"{self.name} lives on NVME; it has no resident tensor")
        return self._tensor

    def _span(self, start: int, count: int | None) -> int:
        """Bytes a transfer of [start, start+count) moves (FlatStore's: whole 4 KiB blocks)."""
        count = self.padded - start if count is None else count
        return padded_numel(count, self.dtype) * self.itemsize

    def load_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                   shadow: bool = False):
        if self.resident:
            return SimRequest(self.manager.clock, self.manager.clock.now)
        return self.read_bytes(self._span(start, count))

    def store_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                    shadow: bool = False):
        if self.resident:
            return SimRequest(self.manager.clock, self.manager.clock.now)
        return self.write_bytes(self._span(start, count))

    def write_bytes(self, nbytes: int, not_before: float | None = None) -> SimRequest:
        self.manager.counters.nvme_write_bytes += nbytes
        return self.manager.disk.write(nbytes, not_before)

    def read_bytes(self, nbytes: int, not_before: float | None = None) -> SimRequest:
        self.manager.counters.nvme_read_bytes += nbytes
        return self.manager.disk.read(nbytes, not_before)

    def flip(self) -> None:
        pass

    def free(self) -> None:
        if self._tensor is not None:
            budget = self.manager.host_budget if self.home is Tier.HOST else \
                self.manager.device_budget
            budget.release(self.nbytes)
            self._tensor = None


class SimManager:
    """The tier manager's interface over the simulated disk, without bytes."""

    def __init__(self, host_budget: int | None, device_budget: int | None, *, clock: SimClock,
                 read_Bps: float, write_Bps: float, device_is_cpu: bool,
                 copies: DeviceCopies | None = None) -> None:
        self.host_budget = MemoryBudget("host", host_budget)
        self.device_budget = MemoryBudget("device", device_budget)
        self.device_cache = DeviceMemoryCache(self.device_budget, META,
                                              memory=NoMemory(keeps=device_is_cpu))
        self.counters = TierCounters()
        self.clock = clock
        self.disk = SimDisk(clock, read_Bps, write_Bps)
        self.device = META
        self.nvme_bytes = 0
        # host <-> device copies: on the clock (simulate.copies.SimCopies, which the dry run
        # passes), or immediate (meta tensors: a copy moves nothing)
        self.copies = copies if copies is not None else ImmediateCopies()

    def host_empty(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """Reserved in the host budget like the real one; callers give it back with
        ``release_host`` (the real memory goes back with its tensor)."""
        self.host_budget.reserve(numel * torch.empty((), dtype=dtype).element_size(), what)
        return torch.empty(numel, dtype=dtype, device=META)

    def device_empty(self, numel: int, dtype: torch.dtype, device: torch.device,
                     what: str) -> torch.Tensor:
        """Reserved in the device budget like the real one (caller releases); ``device`` is
        the engine's, the tensor is on the meta device whatever it says."""
        self.device_budget.reserve(numel * torch.empty((), dtype=dtype).element_size(), what)
        return torch.empty(numel, dtype=dtype, device=META)

    def release_host(self, tensor: torch.Tensor) -> None:
        self.host_budget.release(tensor.numel() * tensor.element_size())

    def create(self, name: str, numel: int, dtype: torch.dtype, home: Tier,
               doubled: bool = False) -> SimStore:
        return SimStore(self, name, numel, dtype, home, doubled)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        yield

    def wait(self, *requests) -> None:
        for request in requests:
            if request is not None:
                request.wait()

    def tier_bytes(self) -> dict[str, int]:
        return {"device": self.device_budget.held, "host": self.host_budget.held,
                "nvme": self.nvme_bytes}


class SimPool:
    """``BufferPool``'s interface: ``count`` slots of ``slot_bytes`` meta bytes, reserved in the
    host budget (the real slots are allocated from it at start). A slot a copy still reads
    comes back at the copy's end on the clock (``SimClock.at``, from ``release_after``), as the
    engine's copies hand it back from their thread; an ``acquire`` with none free waits for
    the first to come back, as the engine's blocks."""

    def __init__(self, manager: SimManager, slot_bytes: int, count: int, name: str) -> None:
        self.name, self.slot_bytes, self.count = name, slot_bytes, count
        self.clock = manager.clock
        manager.host_budget.reserve(slot_bytes * count, f"{name} slots")
        self._free = [Slot(i, torch.empty(slot_bytes, dtype=torch.uint8, device=META))
                      for i in range(count)]
        self.low = count

    def acquire(self, timeout: float | None = None) -> Slot:
        self.clock.run_due()
        while not self._free and self.clock.next_due() is not None:
            self.clock.wait_until(self.clock.next_due(), f"waits for a {self.name} slot")
            self.clock.run_due()
        if not self._free:
            raise RuntimeError(f"{self.name}: all {self.count} slots are in use (the dry run "
                               "has no other thread to give one back)")
        slot = self._free.pop()
        self.low = min(self.low, len(self._free))
        return slot

    def try_acquire(self) -> Slot | None:
        self.clock.run_due()
        return self.acquire() if self._free else None

    def release(self, slot: Slot) -> None:
        self._free.append(slot)

    @property
    def available(self) -> int:
        self.clock.run_due()
        return len(self._free)
