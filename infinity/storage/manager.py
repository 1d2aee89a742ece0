"""The tier manager: the only way a model state moves between tiers.

It owns the per-tier byte budgets, the swap space on NVMe (created on first use) and the I/O
engine (the slot pools are made by their users, the engine and the optimizer, against its host
budget), and it counts bytes held and moved per tier and the time spent waiting
on I/O. Model states are ``FlatStore`` objects: a flat tensor of fixed size and dtype whose home is
HOST (a persistent aligned host tensor) or NVME (an extent of a swap file).

[Note: store buffer lifetimes]
A HOST store's tensor is its home: ``load`` returns it without a copy and ``store`` of that same
tensor is a no-op. An NVME store never owns memory: ``load_async`` fills a caller's buffer (a slot
or a device staging tensor) and ``store_async`` writes from one; the caller keeps the buffer alive
and unmodified until the returned request has been waited on.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from infinity.base.budget import MemoryBudget
from infinity.base.log import get_logger
from infinity.base.sizes import ALIGN_BYTES, format_bytes
from infinity.config.aio import AioConfig
from infinity.planner import alignment
from infinity.storage.integrity import CheckMode
from infinity.storage.tiers import Tier
from infinity.storage.transfers import device_copies

log = get_logger("storage")


def padded_numel(numel: int, dtype: torch.dtype) -> int:
    """``numel`` rounded up so that the byte size is a multiple of 4 KiB (O_DIRECT extents;
    ``infinity.planner.alignment.padded_numel`` for this dtype)."""
    return alignment.padded_numel(numel, dtype.itemsize)


@dataclass
class TierCounters:
    """Bytes moved between tiers and time spent waiting for I/O, since the last reset."""

    nvme_read_bytes: int = 0
    nvme_write_bytes: int = 0
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    io_wait_s: float = 0.0

    def reset(self) -> None:
        self.nvme_read_bytes = self.nvme_write_bytes = 0
        self.host_to_device_bytes = self.device_to_host_bytes = 0
        self.io_wait_s = 0.0


class _DoneRequest:
    """A request that completed at submission (HOST-tier no-ops)."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> int:
        return 0


DONE = _DoneRequest()


class FlatStore:
    """One flat model state (e.g. a unit's exp_avg) in its home tier.

    An NVME store created ``doubled`` has a second extent, the shadow: a speculative step writes
    its results there, and ``flip`` makes them current (commit) or they are simply never read
    (roll back; see [Note: speculative step] in optim/speculation.py).
    """

    def __init__(self, manager: "TierManager", name: str, numel: int, dtype: torch.dtype,
                 home: Tier, doubled: bool = False) -> None:
        self.manager = manager
        self.name = name
        self.numel = numel
        self.dtype = dtype
        self.home = home
        self.padded = padded_numel(numel, dtype)
        self.nbytes = self.padded * torch.empty((), dtype=dtype).element_size()
        self._host: torch.Tensor | None = None
        self._extent = None
        self._shadow = None
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self._device_reserved = 0
        if home is Tier.HOST:
            self._host = manager.host_empty(self.padded, dtype, what=name)
            self._host.zero_()
        elif home is Tier.DEVICE:
            self._host = manager.device_empty(self.padded, dtype, manager.device, what=name)
            self._host.zero_()
            self._device_reserved = self.nbytes
        else:
            self._extent = manager.swap.allocate(self.nbytes, tag=name)
            if doubled:
                self._shadow = manager.swap.allocate(self.nbytes, tag=f"{name}.shadow")

    @property
    def doubled(self) -> bool:
        """True when the store has a shadow extent for speculative writes."""
        return self._shadow is not None

    def flip(self) -> None:
        """The shadow becomes the current extent (its writes must have been issued already:
        a request is bound to its extent when it is issued)."""
        if self._shadow is None:
            raise RuntimeError(f"{self.name} has no shadow extent to flip to")
        self._extent, self._shadow = self._shadow, self._extent

    @property
    def resident(self) -> bool:
        """True when the data lives in memory (DEVICE or HOST home), False on NVMe."""
        return self._host is not None

    @property
    def tensor(self) -> torch.Tensor:
        """The home tensor of a DEVICE/HOST store (the first ``numel`` elements are the data)."""
        if self._host is None:
            raise RuntimeError(f"{self.name} lives on {self.home.name}; it has no resident tensor")
        return self._host

    def _check_range(self, start: int, count: int) -> int:
        per_block = ALIGN_BYTES // self.itemsize
        if start % per_block or start < 0 or start + count > self.padded:
            raise ValueError(f"{self.name}: range [{start}, {start + count}) must start on a "
                             f"{ALIGN_BYTES}-byte boundary and lie within {self.padded} elements")
        return padded_numel(count, self.dtype)

    def load_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                   shadow: bool = False):
        """Fill ``buf`` with elements [start, start+count) of the store (with ``shadow``, of
        its shadow extent). Returns a request.

        ``buf`` must be an aligned host buffer of at least ``count`` rounded up to 4 KiB.
        """
        count = self.padded - start if count is None else count
        span = self._check_range(start, count)
        if shadow and self._shadow is None:
            raise RuntimeError(f"{self.name}: no shadow extent to read (not a doubled NVMe store)")
        if self._host is not None:
            buf[:count].copy_(self._host[start:start + count])
            return DONE
        nbytes = span * self.itemsize
        self.manager.counters.nvme_read_bytes += nbytes
        return self.manager.swap.read(self._shadow if shadow else self._extent,
                                      buf.view(torch.uint8)[:nbytes], offset=start * self.itemsize)

    def store_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                    shadow: bool = False):
        """Write ``buf`` to elements [start, start+count) of the store (with ``shadow``, of its
        shadow extent). Returns a request."""
        count = self.padded - start if count is None else count
        span = self._check_range(start, count)
        if shadow and self._shadow is None:
            raise RuntimeError(f"{self.name}: a speculative write needs a doubled NVMe store")
        if self._host is not None:
            if buf.data_ptr() != self._host[start:].data_ptr():
                self._host[start:start + count].copy_(buf[:count])
            return DONE
        return self.write_extent(self._shadow if shadow else self._extent, buf, start, span)

    def write_extent(self, extent, buf: torch.Tensor, start: int, span: int):
        """Write ``span`` elements of ``buf`` at element ``start`` of one of the store's NVMe
        extents (the request is bound to that extent, whatever ``flip`` does later)."""
        nbytes = span * self.itemsize
        self.manager.counters.nvme_write_bytes += nbytes
        return self.manager.swap.write(extent, buf.view(torch.uint8)[:nbytes],
                                       offset=start * self.itemsize)

    @property
    def allocated(self) -> bool:
        """The store still holds its memory or extent (``free`` not called yet)."""
        return self._host is not None or self._extent is not None

    def free(self) -> None:
        """Give the store's memory or extent back."""
        if self._host is not None:
            self._host = None
            if self._device_reserved:
                self.manager.device_budget.release(self._device_reserved)
                self._device_reserved = 0
        elif self._extent is not None:
            self.manager.swap.free(self._extent)
            self._extent = None
            if self._shadow is not None:
                self.manager.swap.free(self._shadow)
                self._shadow = None


class _NamedBudget:
    """Reserves from ``budget`` under the name of what is being allocated (for clear errors)."""

    def __init__(self, budget: MemoryBudget, what: str) -> None:
        self._budget, self._what = budget, what

    def reserve(self, nbytes: int, what: str) -> None:
        self._budget.reserve(nbytes, self._what)

    def release(self, nbytes: int) -> None:
        self._budget.release(nbytes)


@dataclass
class TierManager:
    """Budgets, slots, swap space and counters for one rank."""

    host_budget: MemoryBudget
    device_budget: MemoryBudget
    nvme_path: str | None = None
    aio_config: AioConfig | None = None  # the config's "aio" section
    swap_check: CheckMode = "sampled"    # the config's infinity.swap_check
    rank: int = 0
    device: torch.device = torch.device("cpu")
    counters: TierCounters = field(default_factory=TierCounters)

    def __post_init__(self) -> None:
        from infinity.storage.device_cache import DeviceMemoryCache

        self.device_cache = DeviceMemoryCache(self.device_budget, self.device)
        # host <-> device copies and their events (storage/transfers.py)
        self.copies = device_copies(self.device)
        self._swap = None
        self._aio = None
        self.nvme_reserve_bytes = 0

    # -- memory ---------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A page-aligned host tensor counted in the host budget (released when freed)."""
        from infinity.io import aligned_empty

        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not nbytes:
            return torch.empty(0, dtype=dtype)
        budget = _NamedBudget(self.host_budget, what)
        log.debug("host allocation: %s, %s (held %s)", what, format_bytes(nbytes),
                  format_bytes(self.host_budget.held))
        return aligned_empty(nbytes, budget=budget, pin=True).view(dtype)[:numel]

    def device_empty(self, numel: int, dtype: torch.dtype, device: torch.device,
                     what: str) -> torch.Tensor:
        """A device tensor whose bytes are reserved in the device budget (caller releases)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.device_budget.reserve(nbytes, what)
        return torch.empty(numel, dtype=dtype, device=device)

    # -- NVMe -----------------------------------------------------------------------------
    @property
    def aio(self):
        if self._aio is None:
            from infinity.io import AioEngine

            self._aio = AioEngine(self.aio_config)   # None: the defaults
        return self._aio

    @property
    def swap(self):
        if self._swap is None:
            if getattr(self, "_closed", False):
                # a graph recorded before the engine's close() reaching its hooks: a new swap
                # directory made now would hold none of the run's states
                raise RuntimeError("the swap space was closed with the engine (engine.close()): "
                                   "its states and swap files are gone; a backward of a graph "
                                   "recorded before the close cannot run, build a new engine")
            if self.nvme_path is None:
                raise ValueError("a state was placed on NVMe but no nvme_path is configured; set "
                                 "zero_optimization.offload_*.nvme_path")
            from infinity.storage.swap import SwapSpace

            self._swap = SwapSpace(self.nvme_path, rank=self.rank, aio=self.aio,
                                   reserve_bytes=self.nvme_reserve_bytes,
                                   check_mode=self.swap_check)
        return self._swap

    def create(self, name: str, numel: int, dtype: torch.dtype, home: Tier,
               doubled: bool = False) -> FlatStore:
        """A new zero-filled (HOST) or allocated (NVME) flat state (``doubled``: with a shadow
        extent on NVMe, see ``FlatStore``)."""
        return FlatStore(self, name, numel, dtype, home, doubled=doubled and home is Tier.NVME)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent in the block counts as I/O wait."""
        start = time.perf_counter()
        try:
            yield
        finally:
            # only the training thread's waits stall compute; a background step's are overlapped
            if threading.current_thread() is threading.main_thread():
                self.counters.io_wait_s += time.perf_counter() - start

    def wait(self, *requests) -> None:
        """Wait for requests (timed as I/O wait); raises the first I/O error with its context."""
        pending = [r for r in requests if r is not None and r is not DONE]
        if not pending:
            return
        with self.waiting():
            errors = []
            for req in pending:
                try:
                    req.wait()
                except OSError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held now per tier."""
        nvme = self._swap.bytes_allocated if self._swap is not None else 0
        return {"device": self.device_budget.held, "host": self.host_budget.held, "nvme": nvme}

    def describe(self) -> str:
        b = self.tier_bytes()
        return (f"device {format_bytes(b['device'])}, host {format_bytes(b['host'])}, "
                f"nvme {format_bytes(b['nvme'])}")

    def close(self) -> None:
        """Remove this run's swap files and stop the I/O engine."""
        self._closed = True
        self.copies.drain()
        self.device_cache.clear()
        if self._swap is not None:
            self._swap.close()
            self._swap = None
        if self._aio is not None:
            self._aio.close()
            self._aio = None
