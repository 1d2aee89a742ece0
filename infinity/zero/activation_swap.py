"""Activations saved for backward, swapped to NVMe during the forward and read back in backward.

Why: with parameters and optimizer states streamed from NVMe, what still grows with depth is the
activations autograd saves for backward: ~22 MB a Llama layer of width 2048 at 128 tokens, the
bulk of the peak-memory growth between a 7- and an 18-layer model (tools/bench/out_of_core.py).
On a CPU-only machine the device *is* host memory, so the only deeper tier is the disk. This is
what ZeRO-Infinity's activation checkpoint offload does for GPUs, applied to every saved tensor
through ``torch.autograd.graph.saved_tensors_hooks``: no model change, no recomputation. About
``window`` bytes of them are in memory at any time (the held tail, then the reads ahead).

[Note: what is swapped]
``pack`` keeps in memory what would not pay or must not move: tensors under ``min_bytes``, and
any tensor whose storage is a parameter's (a unit's flat buffer: released after the forward and
fetched again for the backward by the coordinator, so saving it again would double the I/O and
could read a released buffer), kept as zero/kept_saved.py keeps them. Everything else is
copied into a page-aligned staging chunk and written to an extent of the swap space; autograd
keeps only the small ``_Swapped`` handle. A tensor saved several times in one forward (the input
of q, k and v projections) is written once: handles are shared while the same tensor object,
unmodified (same ``_version``), is saved again.

[Note: the held tail]
The last tensors a forward saves are the first its backward needs, so writing them only to read
them back at once would put the disk on the critical path at the turn. ``pack`` therefore holds
each new tensor as it is (a reference, no copy) and writes out the oldest held ones once more
than ``window`` bytes are held: at the end of the forward the newest ``window`` bytes are still
in memory, and the backward starts on them while the reads of older ones begin. A held tensor
is checked against its ``_version`` when it is written or handed back: one modified in place
after it was saved raises at unpack, as autograd itself would.

[Note: reading back]
Backward unpacks roughly in the reverse order of packing, so each unpack also issues the reads of
the handles packed just before it, up to ``window`` bytes read and not yet handed out. A handle
read out of order is read on the spot: correct, just not overlapped. A read waits for the
handle's own writes first. Reads land in fresh aligned buffers handed to autograd as they are
(no copy; on a GPU they go on to the device, see [Note: activation copies]). A handle saved n
times keeps its buffer until its n-th unpack (the q, k and v projections read the same input);
the extent is freed when autograd drops the handle (after its node ran, or when the graph is
freed without a backward), so ``retain_graph=True`` reads it again from disk.

[Note: activation copies]
On a GPU a swapped tensor crosses PCIe twice, and both copies go through the copies' owner
(storage/transfers.py, [Note: copy events]) so that neither stalls compute:
- out (``_write_oldest_held``): each staging chunk is filled by ``copies.to_host`` on the
  device-to-host stream. The chunk is written to NVMe (or taken for another copy) only after
  ``host_waits`` of that copy: the swapper polls the oldest copies' events at each of its calls
  and writes those that landed (``_write_landed``), blocking only where a chunk, a read of the
  record, or close needs them. The saved tensor stays referenced until its copies landed, and
  its ``_version`` is checked then: one modified in place after the copy was issued raises at
  unpack (the copy may have read either value).
- back (``_lift``): a read that landed in its host buffer is copied to a fresh device tensor by
  ``copies.to_device`` as soon as the swapper sees it landed (read-ahead records at the next
  unpack, inside the read-ahead window: a record is host bytes or device bytes, counted once),
  so the copy overlaps the backward of the tensors unpacked before it; the unpack hands
  autograd the device tensor after ``compute_waits`` of its event, and the host buffer is
  given up only after the same event (``release_after``). A handle saved n times keeps the
  device tensor until its n-th unpack.
On a CPU device (``needs_device_copies`` false) there is no copy at all: the staging chunk is
filled by a host memcpy and the read buffer is the tensor autograd gets back.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from infinity.io.buffers import aligned_empty
from infinity.base.sizes import format_bytes
# the staging's size is counted in the host budget by the planner (one definition there)
from infinity.planner.engine_sizes import STAGING_CHUNK_BYTES, STAGING_CHUNKS
from infinity.storage.extents import round_up
from infinity.storage.manager import TierManager
from infinity.storage.transfers import CopyEvent
from infinity.zero.kept_saved import KeptSaved, keep_saved, kept_value


def needs_device_copies(device: torch.device) -> bool:
    """Whether a tensor saved on ``device`` reaches host memory, and comes back, only through
    the copies' owner (a GPU's; see [Note: activation copies]). On a CPU device the host bytes
    are the tensor itself. The tests force it on a CPU device to run a GPU's path under late
    copies (tests/integration/test_activation_swap_late_copies.py)."""
    return device.type != "cpu"


@dataclass(eq=False)
class _Record:
    """A swapped tensor's state, kept apart from the handle so the handle's finalizer can use it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    copied: bool = False                           # through the copies' owner (a GPU's)
    extent: object | None = None
    writes: list = field(default_factory=list)     # requests that must land before a read
    read: object | None = None                     # the read in flight into ``buffer``
    buffer: torch.Tensor | None = None             # read (ahead), kept until its last use
    lifted: torch.Tensor | None = None             # copied: the device tensor, until its last use
    arrival: CopyEvent | None = None               # ``lifted``'s copy to the device
    landing: int = 0                               # copies to the host not yet written
    held: torch.Tensor | None = None               # the saved tensor itself, not written yet
    version: int = 0                               # the held tensor's _version when saved
    stale: bool = False                            # modified in place after it was saved
    uses_left: int = 1                             # unpacks left (one per save) before buffer goes
    position: int = -1

    @property
    def padded(self) -> int:
        """Bytes on disk and in a read buffer (O_DIRECT: a multiple of 4 KiB)."""
        return round_up(self.nbytes)


@dataclass(eq=False)
class _Landing:
    """A device-to-host copy into a staging chunk, written to NVMe once its event fired."""

    event: CopyEvent
    chunk: int
    record: _Record
    offset: int
    count: int
    source: torch.Tensor     # the saved tensor, kept (and its version checked) until it landed


class _Swapped:
    """What autograd keeps for a swapped tensor."""

    __slots__ = ("record", "__weakref__")

    def __init__(self, record: _Record) -> None:
        self.record = record


@dataclass
class ActivationStats:
    """Saved tensors handled since the swapper was made (bytes are unpadded tensor bytes)."""

    swapped: int = 0           # saved tensors taken over (held, then written unless needed first)
    swapped_bytes: int = 0
    written: int = 0           # of those, written to NVMe
    written_bytes: int = 0
    shared: int = 0            # saves answered by a handle of the same tensor
    kept: int = 0              # small tensors and parameter storages left in memory
    kept_bytes: int = 0
    held_hits: int = 0         # unpacks of tensors still held (never written)
    read_ahead_hits: int = 0   # unpacks whose read had been issued before
    read_misses: int = 0
    to_host_copies: int = 0    # staging chunks filled by the copies' owner (a GPU's)
    to_device_copies: int = 0  # read buffers copied to the device
    lifted_ahead: int = 0      # of those, issued before their unpack


class ActivationSwapper:
    """Swaps saved activations to the manager's swap space (see the notes above)."""

    def __init__(self, manager: TierManager, *, min_bytes: int, window_bytes: int,
                 is_parameter_storage: Callable[[torch.Tensor], bool]) -> None:
        self.manager = manager
        self.min_bytes = min_bytes
        self.window_bytes = window_bytes
        self._is_parameter_storage = is_parameter_storage
        self._lock = threading.RLock()
        self._staging = [manager.host_empty(STAGING_CHUNK_BYTES, torch.uint8,
                                            what=f"activation staging chunk {i}")
                         for i in range(STAGING_CHUNKS)]
        self._free_chunks = list(range(STAGING_CHUNKS))
        self._writes: deque[tuple[object, int]] = deque()   # (request, staging chunk)
        self._landing: deque[_Landing] = deque()            # copies to the host, oldest first
        self._reading: list[_Record] = []                   # copied records with a read in flight
        self._held: dict[int, _Record] = {}                  # by id, oldest first
        self._held_bytes = 0
        self._order: list[weakref.ref] = []                  # records by pack position
        self._shared: dict[int, tuple[weakref.ref, int, _Swapped]] = {}
        self._ahead_low = 0            # lowest position considered for read-ahead this backward
        self._ahead_bytes = 0          # bytes read and not yet given up
        self._live = 0
        # records whose handle is gone, freed at the swapper's next call (see ``_forget``)
        self._forgotten: deque[_Record] = deque()
        self._raised: set = set()      # failed writes already raised (not raised twice)
        self.stats = ActivationStats()
        self.closed = False
        self._observe: Callable[[torch.Tensor], None] | None = None

    # -- the hooks -------------------------------------------------------------------------
    @property
    def pack_hook(self) -> Callable[[torch.Tensor], object]:
        """The pack hook ``hooks`` installs (zero/detached_reads.py tells its own from others)."""
        return self._pack

    def swaps_this_forward(self) -> bool:
        """Every training forward's activations go (``AutoActivationOffload`` chooses)."""
        return True

    @contextlib.contextmanager
    def hooks(self, observe: Callable[[torch.Tensor], None] | None = None) -> Iterator[None]:
        """Swap the tensors autograd saves inside the block (a training forward); ``observe``
        sees each first (zero/detached_reads.py)."""
        self._observe = observe
        with self._lock:
            self._drain_forgotten()
            if self._live == 0:
                self._order.clear()
            else:
                self._compact_order()
            self._shared.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
            with self._lock:
                self._write_landed()     # the copies to the host that landed meanwhile
        finally:
            self._observe = None
            with self._lock:
                self._shared.clear()   # a later forward's saves are new tensors
                self._ahead_low = len(self._order)   # the next backward reads from the top

    def _compact_order(self) -> None:
        """Drop the places of records gone, keeping the live ones' order (renumbered): with a
        saved tensor of an earlier forward kept alive (an output held with its graph across
        forwards), ``_live`` never reached 0 and the list grew by every saved tensor of every
        forward (8,400 entries after 300 steps), each backward's read-ahead walking them."""
        kept = []
        for ref in self._order:
            record = ref()
            if record is not None:
                record.position = len(kept)
                kept.append(ref)
        self._order = kept
        self._ahead_low = len(kept)

    def _pack(self, tensor: torch.Tensor):
        if self._observe is not None:
            self._observe(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or tensor.layout is not torch.strided or \
                self._is_parameter_storage(tensor):
            self.stats.kept += 1
            self.stats.kept_bytes += nbytes
            return keep_saved(tensor)       # detached, its in-place change checked
        with self._lock:
            if self.closed:
                raise RuntimeError("the activation swapper is closed (engine.close() was called); "
                                   "run the forward before closing the engine")
            self._drain_forgotten()
            seen = self._shared.get(id(tensor))
            if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
                self.stats.shared += 1
                seen[2].record.uses_left += 1
                return seen[2]
            handle = self._hold(tensor, nbytes)
            self._shared[id(tensor)] = (weakref.ref(tensor), tensor._version, handle)
            while self._held_bytes > self.window_bytes:
                self._write_oldest_held()
            self._write_landed()
            return handle

    def _unpack(self, packed):
        if isinstance(packed, KeptSaved):
            return kept_value(packed)
        record = packed.record
        held = lifted = arrival = buffer = request = None
        with self._lock:
            self._drain_forgotten()
            record.uses_left -= 1
            last = record.uses_left <= 0
            if record.held is not None:
                if record.held._version != record.version:
                    record.stale = True
                held = record.held
                self.stats.held_hits += 1
            else:
                if record.buffer is None and record.lifted is None:
                    self.stats.read_misses += 1
                    self._read(record)
                else:
                    self.stats.read_ahead_hits += 1
                buffer, request, record.read = record.buffer, record.read, None
                lifted, arrival = record.lifted, record.arrival
                if record in self._reading:  # its read not over: lifted below, after it
                    self._reading.remove(record)
                if last:     # its last use: the buffer (or device tensor) is autograd's now
                    record.buffer = record.lifted = record.arrival = None
                    self._ahead_bytes -= record.padded
            self._read_ahead(record.position)
            self._lift_landed()
        if record.stale:
            raise RuntimeError(
                f"a tensor of shape {tuple(record.shape)} saved for backward was modified in "
                "place after it was saved; autograd cannot compute this gradient (clone it "
                "before the in-place op)")
        if held is not None:
            return held
        copies = self.manager.copies
        if lifted is not None:           # see [Note: activation copies]
            copies.compute_waits(arrival)
            return lifted
        try:
            self.manager.wait(request)
        except BaseException:
            with self._lock:             # a later use reads it again rather than these bytes
                if buffer is not None and record.buffer is buffer:
                    record.buffer = None
                    self._ahead_bytes -= record.padded
            raise
        if not record.copied:
            return buffer.view(record.dtype)[: record.shape.numel()].view(record.shape)
        with self._lock:
            lifted, arrival = self._lift(record, buffer)
            if record.buffer is buffer:      # a later use takes the device tensor
                record.buffer, record.lifted, record.arrival = None, lifted, arrival
        copies.compute_waits(arrival)
        return lifted

    # -- writing ---------------------------------------------------------------------------
    def _hold(self, tensor: torch.Tensor, nbytes: int) -> _Swapped:
        # held detached: the tensor itself would point back at its grad_fn, which holds this
        # handle, a cycle the GC cannot see into (a graph dropped without a backward, or whose
        # backward raised, then kept up to the window's bytes alive); a detached alias shares
        # its storage and version counter
        record = _Record(tensor.shape, tensor.dtype, tensor.device, nbytes,
                         copied=needs_device_copies(tensor.device),
                         held=tensor.detach(), version=tensor._version)
        handle = _Swapped(record)
        self._live += 1
        weakref.finalize(handle, self._forgotten.append, record)
        record.position = len(self._order)
        self._order.append(weakref.ref(record))
        self._held[id(record)] = record
        self._held_bytes += nbytes
        self.stats.swapped += 1
        self.stats.swapped_bytes += nbytes
        return handle

    def _write_oldest_held(self) -> None:
        record = self._held.pop(next(iter(self._held)))
        tensor, record.held = record.held, None
        self._held_bytes -= record.nbytes
        if tensor._version != record.version:
            record.stale = True            # raised when backward unpacks it
            return
        nbytes, padded = record.nbytes, record.padded
        self.stats.written += 1
        self.stats.written_bytes += nbytes
        record.extent = self.manager.swap.allocate(padded, tag="activation")
        flat = tensor.detach().reshape(-1).view(torch.uint8) if tensor.is_contiguous() else \
            tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        for offset in range(0, nbytes, STAGING_CHUNK_BYTES):
            count = min(STAGING_CHUNK_BYTES, nbytes - offset)
            chunk = self._take_chunk()
            staging = self._staging[chunk]
            if not record.copied:
                staging[:count].copy_(flat[offset:offset + count])
                self._write_chunk(record, chunk, offset, count)
                continue
            # off the device: written once the copy landed (see [Note: activation copies])
            try:
                event = self.manager.copies.to_host(staging[:count], flat[offset:offset + count])
            except BaseException:
                self._free_chunks.append(chunk)
                raise
            self._landing.append(_Landing(event, chunk, record, offset, count, tensor))
            record.landing += 1
            self.stats.to_host_copies += 1

    def _write_chunk(self, record: _Record, chunk: int, offset: int, count: int) -> None:
        """Write staging ``chunk`` (``count`` bytes of ``record`` from ``offset``) to the
        record's extent; the chunk is free again once the write is over (``_retire_write``)."""
        span = round_up(count)
        try:
            request = self.manager.swap.write(record.extent, self._staging[chunk][:span],
                                              offset, span)
        except BaseException:
            self._free_chunks.append(chunk)
            raise
        self.manager.counters.nvme_write_bytes += span
        self._writes.append((request, chunk))
        record.writes.append(request)

    def _write_landed(self, *, until: _Record | None = None, block: bool = False) -> None:
        """Write the staging chunks whose copies to the host are over, oldest first: those that
        landed already, or (blocking on their events) every one with ``block``, or up to the
        last of ``until``'s (a read of it needs them). See [Note: activation copies]."""
        while self._landing and (block or (until is not None and until.landing > 0)
                                 or self._landing[0].event.done()):
            self._write_next_landed()

    def _write_next_landed(self) -> None:
        landing = self._landing.popleft()
        record = landing.record
        record.landing -= 1
        try:
            # the chunk holds the tensor's bytes only after this (see [Note: copy events])
            self.manager.copies.host_waits([landing.event])
        except BaseException:
            self._free_chunks.append(landing.chunk)
            raise
        if landing.source._version != record.version:
            record.stale = True     # modified in place while its copy was queued: raised at unpack
        self._write_chunk(record, landing.chunk, landing.offset, landing.count)

    def _take_chunk(self) -> int:
        while not self._free_chunks:
            self._write_landed()
            if self._writes:
                self._retire_write()
            else:
                self._write_next_landed()     # every chunk waits for its copy: the oldest
        return self._free_chunks.pop()

    def _retire_write(self) -> None:
        request, chunk = self._writes.popleft()
        try:
            self.manager.wait(request)
        except BaseException:
            if request not in self._raised:
                raise          # (one the backward that needed it raised already is not again)
        finally:
            self._raised.discard(request)
            # back for the next copy into it: the late copies check that none still writes it
            self.manager.copies.on_release(self._staging[chunk])
            self._free_chunks.append(chunk)

    # -- reading ---------------------------------------------------------------------------
    def _read(self, record: _Record) -> None:
        """Issue ``record``'s read into a fresh aligned buffer (its writes waited first)."""
        if record.extent is None:
            raise RuntimeError("a swapped activation was unpacked after the swapper closed")
        self._write_landed(until=record)
        try:
            self.manager.wait(*record.writes)
        except BaseException:
            self._raised.update(record.writes)   # raised here, at the backward that needs it
            raise
        record.writes.clear()
        padded = record.padded
        record.buffer = aligned_empty(padded, pin=record.copied)
        record.read = self.manager.swap.read(record.extent, record.buffer, 0, padded)
        self.manager.counters.nvme_read_bytes += padded
        self._ahead_bytes += padded
        if record.copied:
            self._reading.append(record)

    def _read_ahead(self, position: int) -> None:
        """Issue reads of the records packed before ``position`` while the window has room."""
        index = min(position, self._ahead_low) - 1
        while index >= 0 and self._ahead_bytes < self.window_bytes:
            record = self._order[index]()
            if record is not None and record.held is None and record.buffer is None and \
                    record.lifted is None and record.extent is not None:
                self._read(record)
            index -= 1
        self._ahead_low = index + 1

    def _lift_landed(self) -> None:
        """Copy to the device every copied record whose read is over (its bytes are on the
        host), ahead of its unpack; a failed read is left to its unpack, which raises it."""
        if not self._reading:
            return
        reading, self._reading = self._reading, []
        for record in reading:
            if not record.read.done():
                self._reading.append(record)
                continue
            try:
                self.manager.wait(record.read)
            except OSError:
                continue
            record.read = None
            buffer, record.buffer = record.buffer, None
            record.lifted, record.arrival = self._lift(record, buffer)
            self.stats.lifted_ahead += 1

    def _lift(self, record: _Record, buffer: torch.Tensor) -> tuple[torch.Tensor, CopyEvent]:
        """Copy ``record``'s bytes in host ``buffer`` to a fresh device tensor; ``buffer`` is
        given up after the copy's event (see [Note: activation copies])."""
        copies = self.manager.copies
        lifted = torch.empty(record.shape, dtype=record.dtype, device=record.device)
        event = copies.to_device(lifted,
                                 buffer.view(record.dtype)[: record.shape.numel()].view(record.shape))
        # the closure holds the buffer until the copy is over: a pinned buffer freed (unmapped)
        # under a copy in flight would be read after; the late copies check that none reads it
        copies.release_after(event, lambda: copies.on_release(buffer))
        self.stats.to_device_copies += 1
        return lifted, event

    # -- lifetime --------------------------------------------------------------------------
    def release_forgotten(self) -> None:
        """Free what the handles dropped since the swapper's last call held (the engine calls
        this after a backward)."""
        with self._lock:
            self._drain_forgotten()
            self._write_landed()

    def _drain_forgotten(self) -> None:
        while self._forgotten:
            self._forget(self._forgotten.popleft())

    def _forget(self, record: _Record) -> None:
        """The handle is gone: wait its I/O, free its extent. Called from the swapper's own
        calls, never from the handle's finalizer: the cyclic GC may run that finalizer inside any
        allocation, e.g. while the swap space holds its lock to hand out an extent, and freeing
        one there would wait on that lock forever; the finalizer only queues the record."""
        with self._lock:
            self._live -= 1
            if self._held.pop(id(record), None) is not None:
                self._held_bytes -= record.nbytes
            while record.landing:      # its copies to the host are written before it is freed
                with contextlib.suppress(BaseException):
                    self._write_landed(until=record)
            if record in self._reading:
                self._reading.remove(record)
            pending = [r for r in (*record.writes, record.read) if r is not None]
            for request in pending:
                with contextlib.suppress(BaseException):
                    request.wait()
            if record.buffer is not None or record.lifted is not None:
                self._ahead_bytes -= record.padded
            record.writes, record.read, record.buffer, record.held = [], None, None, None
            record.lifted = record.arrival = None
            if record.extent is not None and not self.closed:
                self.manager.swap.free(record.extent)
            record.extent = None

    def close(self) -> None:
        """Wait the copies and writes in flight; later unpacks raise (the swap space goes with
        the engine)."""
        with self._lock:
            self._drain_forgotten()
            while self._landing:
                with contextlib.suppress(BaseException):
                    self._write_next_landed()
            while self._writes:
                with contextlib.suppress(BaseException):
                    self._retire_write()
            self.closed = True

    def describe(self) -> str:
        s = self.stats
        copied = (f", copied to the host {s.to_host_copies}, to the device "
                  f"{s.to_device_copies} ({s.lifted_ahead} ahead)"
                  if s.to_host_copies or s.to_device_copies else "")
        return (f"{s.swapped} activations swapped ({format_bytes(s.swapped_bytes)}; "
                f"{s.written} written, {format_bytes(s.written_bytes)}), "
                f"{s.shared} shared, {s.kept} kept in memory ({format_bytes(s.kept_bytes)}), "
                f"held {s.held_hits}, read ahead {s.read_ahead_hits}, "
                f"read on demand {s.read_misses}{copied}")
