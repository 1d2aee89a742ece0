"""Device memory for fetched units, kept for the next fetch instead of given back (CPU devices).

Why: a released unit's flat buffer must hold no memory, and on a CPU device torch hands a freed
buffer of a unit's size (hundreds of MiB) straight back to the kernel. The next fetch then
faults in fresh zeroed pages while it copies, which made fetch copies 4x slower than a copy into
memory already mapped (tools/bench/step_timeline.py: ~1.3 s of a 0.49B step). So a released
unit's memory moves into this cache, still counted in the device budget, and the next fetch of a
unit of the same size takes it back. CUDA's caching allocator already does this on GPUs, so there
the cache is off and buffers are resized as before.

[Note: moving memory between storages]
A unit's parameters are views of its flat buffer's storage (see zero/unit.py), so the storage
object must stay the same while its memory comes and goes. ``UntypedStorage._swap_data_ptr_``
exchanges the memory (pointer, size and deleter) of two storages in place: the unit's storage
takes a cached block's memory and the block takes the unit's empty pointer, and the reverse on
release. Views follow because they refer to the storage, not to the pointer.

[Note: one cache policy, two memories]
The dry run (simulate/storage.py) must hold, evict and refuse device memory exactly as the
engine does, or its peaks would not be the engine's (DESIGN.md "One plan, one assembly"). So
the policy -- blocks kept by exact size and counted in the budget, other sizes evicted first and
the largest of them first, ``fits``, hits and misses, the peak in use -- is this one class, and
only the memory operations differ, as a strategy: ``RealMemory`` (aligned blocks, memory moved
with ``_swap_data_ptr_``) for the engine, ``NoMemory`` (meta storages resized, a block only a
count) for the dry run; freeing a block is dropping it from its list, for both.
tests/unit/test_device_cache_variants.py feeds both the same sequence and compares every step.
"""
from __future__ import annotations

import threading

import torch

from infinity.base.budget import MemoryBudget
from infinity.io.buffers import aligned_empty


class RealMemory:
    """The engine's memory operations: real, page-aligned blocks, moved into and out of a
    unit's storage in place ([Note: moving memory between storages])."""

    warms = True        # a block can be populated ahead, on a loader's helper thread

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def keeps_released(self) -> bool:
        """Whether released memory is kept (``DeviceMemoryCache.supported``: a CPU device)."""
        return DeviceMemoryCache.supported(self.device)

    def new_block(self, nbytes: int) -> torch.UntypedStorage:
        """``nbytes`` of fresh memory: page-aligned (direct I/O can use it) and populated now,
        not at first touch."""
        return aligned_empty(nbytes, pin=False).untyped_storage()

    def give(self, storage: torch.UntypedStorage, block: torch.UntypedStorage,
             nbytes: int) -> None:
        """Move ``block``'s memory into the empty ``storage`` (the block keeps its pointer)."""
        storage._swap_data_ptr_(block)

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
        """Move ``storage``'s memory into a new block, leaving ``storage`` with 0 bytes."""
        block = torch.empty(0, dtype=torch.uint8, device=self.device).untyped_storage()
        block._swap_data_ptr_(storage)
        return block


class NoMemory:
    """The dry run's memory operations: no bytes. A block is a marker that a block of its size
    is kept; a unit's (meta) storage is resized to the bytes it would hold. ``keeps``: whether
    the simulated device keeps released memory (a CPU device, as ``RealMemory`` on one)."""

    warms = False       # nothing to populate; the dry run's attach takes the miss path

    def __init__(self, keeps: bool) -> None:
        self.keeps = keeps

    def keeps_released(self) -> bool:
        return self.keeps

    def new_block(self, nbytes: int) -> object:
        return _BLOCK

    def give(self, storage: torch.UntypedStorage, block: object, nbytes: int) -> None:
        storage.resize_(nbytes)

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> object:
        storage.resize_(0)
        return _BLOCK


_BLOCK = object()       # NoMemory's block: the count is the list's length


class DeviceMemoryCache:
    """Blocks of released device memory by exact size, counted in ``budget`` while cached.

    ``memory``: the operations on memory ([Note: one cache policy, two memories]); by default
    the real ones on ``device``."""

    def __init__(self, budget: MemoryBudget, device: torch.device,
                 memory: RealMemory | NoMemory | None = None) -> None:
        self.budget = budget
        self.device = device
        self.memory = RealMemory(device) if memory is None else memory
        self.enabled = self.memory.keeps_released()
        self._free: dict[int, list[object]] = {}
        self._lock = threading.Lock()
        self._warmed = threading.Condition(self._lock)
        self._warming: dict[int, int] = {}     # blocks being allocated by ``warm``, by size
        self.cached_bytes = 0
        self.hits = 0
        self.misses = 0
        self.peak_in_use = 0     # most bytes held by fetched tensors (the dry run reports it)

    @staticmethod
    def supported(device: torch.device) -> bool:
        """Whether released memory can be kept and moved between storages on ``device``."""
        return device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def in_use_bytes(self) -> int:
        """Device bytes held by fetched tensors (the budget's count less the cached blocks)."""
        return self.budget.held - self.cached_bytes

    def attach(self, storage: torch.UntypedStorage, nbytes: int, what: str) -> None:
        """Give the empty ``storage`` ``nbytes`` of device memory, reserved in the budget."""
        if storage.nbytes():
            raise RuntimeError(f"{what}: attaching memory to a storage that still holds "
                               f"{storage.nbytes()} bytes (release it first)")
        if not self.enabled:
            self.budget.reserve(nbytes, what)
            try:
                storage.resize_(nbytes)
            except BaseException:
                self.budget.release(nbytes)
                raise
            self._note_in_use()
            return
        with self._lock:
            while not self._free.get(nbytes) and self._warming.get(nbytes):
                self._warmed.wait()          # a block of this size is on its way (``warm``)
            blocks = self._free.get(nbytes)
            block = blocks.pop() if blocks else None
            if block is not None:
                self.cached_bytes -= nbytes   # its reservation passes to the caller
                self.hits += 1
            else:
                self._evict_for(nbytes)
                self.budget.reserve(nbytes, what)
                self.misses += 1
        if block is None:
            try:
                block = self.memory.new_block(nbytes)
            except BaseException:
                self.budget.release(nbytes)
                raise
        self.memory.give(storage, block, nbytes)
        self._note_in_use()

    def _note_in_use(self) -> None:
        """Raise ``peak_in_use`` to the bytes fetched tensors hold now."""
        with self._lock:
            self.peak_in_use = max(self.peak_in_use, self.budget.held - self.cached_bytes)

    def warm(self, nbytes: int, what: str) -> bool:
        """Allocate a block of ``nbytes`` now (its pages populated) and keep it for the next
        attach of that size, which waits for it meanwhile: a loader calls it on a helper
        thread for the units it will place next, so populating memory overlaps its reads.
        False, changing nothing, when the budget has no room without evicting, or when
        there is no memory to populate (off, or ``NoMemory``)."""
        if not self.enabled or not self.memory.warms:
            return False
        with self._lock:
            if self.budget.limit is not None and self.budget.held + nbytes > self.budget.limit:
                return False
            self.budget.reserve(nbytes, what)
            self.cached_bytes += nbytes
            self._warming[nbytes] = self._warming.get(nbytes, 0) + 1
        block = None
        try:
            block = self.memory.new_block(nbytes)
        finally:
            with self._lock:
                self._warming[nbytes] -= 1
                if block is not None:
                    self._free.setdefault(nbytes, []).append(block)
                else:
                    self.cached_bytes -= nbytes
                    self.budget.release(nbytes)
                self._warmed.notify_all()
        return True

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` can be attached now (a cached block of that size, or budget room
        after freeing cached blocks of other sizes)."""
        with self._lock:
            return bool(self._free.get(nbytes)) or self.budget.limit is None or \
                self.budget.held - self.cached_bytes + nbytes <= self.budget.limit

    def try_attach(self, storage: torch.UntypedStorage, nbytes: int, what: str) -> bool:
        """``attach`` if ``nbytes`` fit now (see ``fits``); False, changing nothing, when they
        do not."""
        if not self.fits(nbytes):
            return False
        self.attach(storage, nbytes, what)
        return True

    def detach(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory (it is left with 0 bytes) and keep it for a later attach."""
        nbytes = storage.nbytes()
        if not nbytes:
            return
        if not self.enabled:
            storage.resize_(0)
            self.budget.release(nbytes)
            return
        block = self.memory.take(storage, nbytes)
        with self._lock:
            self._free.setdefault(nbytes, []).append(block)
            self.cached_bytes += nbytes

    def _evict_for(self, nbytes: int) -> None:
        """Free cached blocks (other sizes first) until ``nbytes`` more fit the budget."""
        limit = self.budget.limit
        if limit is None:
            return
        for size in sorted(self._free, key=lambda s: (s == nbytes, -s)):
            blocks = self._free[size]
            while blocks and self.budget.held + nbytes > limit:
                blocks.pop()
                self.cached_bytes -= size
                self.budget.release(size)
        self._free = {s: b for s, b in self._free.items() if b}

    def clear(self) -> None:
        """Free every cached block."""
        with self._lock:
            for size, blocks in self._free.items():
                self.cached_bytes -= size * len(blocks)
                self.budget.release(size * len(blocks))
            self._free.clear()
