"""The storage side the units, the coordinator and the optimizer's pools use, as Protocols.

Why: the engine builds its parts over the tier manager (real bytes: host memory, swap files,
the device memory cache); ``infinity plan --dry-run`` builds the same parts through the same
assembly (engine/assembly.py) over a byte-free backend on a simulated clock
(simulate/storage.py). These Protocols are what both must provide, so the dry run is
the engine's own wiring over another backend rather than a copy of it; a test
(tests/unit/test_storage_protocols.py) checks that both implement every member with the same
parameters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch

from infinity.storage.tiers import Tier
from infinity.storage.transfers import DeviceCopies

if TYPE_CHECKING:
    from infinity.base.budget import MemoryBudget

__all__ = ["Store", "DeviceMemory", "SlotPool", "StorageBackend", "PROTOCOL_MEMBERS"]


class Store(Protocol):
    """A flat store of one state in its home tier (``manager.FlatStore``)."""

    name: str
    numel: int
    dtype: torch.dtype
    home: Tier
    padded: int
    itemsize: int
    nbytes: int

    @property
    def resident(self) -> bool: ...
    @property
    def tensor(self) -> torch.Tensor: ...
    def load_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                   shadow: bool = False) -> Any: ...
    def store_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                    shadow: bool = False) -> Any: ...
    def flip(self) -> None: ...
    def free(self) -> None: ...


class DeviceMemory(Protocol):
    """The device's memory for fetched units (``device_cache.DeviceMemoryCache``)."""

    def in_use_bytes(self) -> int: ...
    def attach(self, storage: torch.UntypedStorage, nbytes: int, what: str) -> None: ...
    def warm(self, nbytes: int, what: str) -> bool: ...
    def fits(self, nbytes: int) -> bool: ...
    def try_attach(self, storage: torch.UntypedStorage, nbytes: int, what: str) -> bool: ...
    def detach(self, storage: torch.UntypedStorage) -> None: ...
    def clear(self) -> None: ...


class SlotPool(Protocol):
    """Equal host slots taken and given back (``buffer_pool.BufferPool``)."""

    name: str
    slot_bytes: int
    count: int

    def acquire(self, timeout: float | None = None) -> Any: ...
    def try_acquire(self) -> Any: ...
    def release(self, slot: Any) -> None: ...
    @property
    def available(self) -> int: ...


class StorageBackend(Protocol):
    """The tier manager as the parts use it (``manager.TierManager``)."""

    host_budget: MemoryBudget
    device_budget: MemoryBudget
    device_cache: DeviceMemory
    counters: Any
    copies: DeviceCopies

    def host_empty(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor: ...
    def create(self, name: str, numel: int, dtype: torch.dtype, home: Tier,
               doubled: bool = False) -> Store: ...
    def waiting(self) -> ContextManager[None]: ...
    def wait(self, *requests: Any) -> None: ...
    def tier_bytes(self) -> dict[str, int]: ...


PROTOCOL_MEMBERS: dict[type, tuple[str, ...]] = {
    proto: tuple(name for name in (*proto.__annotations__, *vars(proto))
                 if not name.startswith("_"))
    for proto in (Store, DeviceMemory, SlotPool, StorageBackend)
}
"""Each Protocol's members (attributes and methods), for the conformance test."""
