"""Extent allocator: hands out 4096-aligned byte ranges of a set of swap files, and takes them back.

Why its own module: the placement policy (best fit, coalescing of freed neighbours, growth only
when nothing fits) is what keeps swap files from fragmenting under the alloc/free churn of a
training run, and it is easiest to property-test with no files or I/O involved. The allocator only
does arithmetic; ``SwapSpace`` owns the files.

Policy:

* every extent starts at a multiple of ``alignment`` and covers a multiple of it
  (``padded_nbytes``), so O_DIRECT can move it whole;
* **best fit**: a request takes the smallest free range that holds it (ties: lowest file, lowest
  offset), so exact-size holes left by a freed tensor are reused first and large ranges stay whole;
* **coalescing**: a freed extent merges with a free neighbour on either side at once, so the free
  ranges of a file are never adjacent, and freeing everything leaves one free range per file;
* **growth only when needed**: ``allocate`` returns ``None`` when no free range holds the request,
  and the caller adds a file (``add_file``); it never grows while a fitting hole exists.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from infinity.base.sizes import ALIGN_BYTES, format_bytes

ALIGNMENT = ALIGN_BYTES


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class Extent:
    """An aligned byte range of one swap file: ``nbytes`` of payload in ``padded_nbytes`` of file."""

    file_index: int
    """Which swap file (index into the swap space's file list)."""
    offset: int
    """Byte offset in that file; a multiple of the alignment."""
    nbytes: int
    """Payload bytes the caller asked for."""
    padded_nbytes: int
    """Bytes of file reserved: ``nbytes`` rounded up to the alignment."""


class ExtentAllocator:
    """Best-fit allocator of aligned extents over files of known sizes; thread-safe."""

    def __init__(self, alignment: int = ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self._lock = threading.Lock()
        self._file_sizes: list[int] = []
        # Free ranges, two views kept in step:
        #   _by_size: sorted (length, file_index, offset) -> best fit by bisect
        #   _starts[f]: sorted offsets of file f's free ranges, _lengths[f][offset] = length -> neighbours
        self._by_size: list[tuple[int, int, int]] = []
        self._starts: list[list[int]] = []
        self._lengths: list[dict[int, int]] = []
        # Live extents by (file_index, offset) -> padded length, to refuse double or foreign frees.
        self._live: dict[tuple[int, int], int] = {}
        self._allocated = 0

    # -- growth --------------------------------------------------------------------------------
    def add_file(self, size: int) -> int:
        """Register a new file of ``size`` bytes (a multiple of the alignment); returns its index."""
        if size <= 0 or size % self.alignment:
            raise ValueError(f"file size must be a positive multiple of {self.alignment} bytes, "
                             f"got {size}")
        with self._lock:
            index = len(self._file_sizes)
            self._file_sizes.append(size)
            self._starts.append([])
            self._lengths.append({})
            self._insert_free(index, 0, size)
            return index

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Extent | None:
        """An extent for ``nbytes`` (> 0) of payload, or ``None`` when no free range holds it."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"extent size must be a positive number of bytes, got {nbytes!r}")
        padded = round_up(nbytes, self.alignment)
        with self._lock:
            at = bisect.bisect_left(self._by_size, (padded, -1, -1))
            if at == len(self._by_size):
                return None
            length, file_index, offset = self._by_size[at]
            self._remove_free(file_index, offset)
            if length > padded:
                self._insert_free(file_index, offset + padded, length - padded)
            self._live[(file_index, offset)] = padded
            self._allocated += padded
            return Extent(file_index, offset, nbytes, padded)

    def free(self, extent: Extent) -> None:
        """Return ``extent`` (from ``allocate``) and merge it with free neighbours."""
        key = (extent.file_index, extent.offset)
        with self._lock:
            padded = self._live.get(key)
            if padded is None or padded != extent.padded_nbytes:
                raise ValueError(f"freeing {extent} which is not allocated here (double free, or an "
                                 "extent of another swap space)")
            del self._live[key]
            self._allocated -= padded
            offset, length = extent.offset, padded
            starts, lengths = self._starts[extent.file_index], self._lengths[extent.file_index]
            at = bisect.bisect_left(starts, offset)
            if at > 0:  # merge with the free range just before
                prev = starts[at - 1]
                if prev + lengths[prev] == offset:
                    length += lengths[prev]
                    self._remove_free(extent.file_index, prev)
                    offset = prev
            nxt = offset + length
            if nxt in lengths:  # merge with the free range just after
                length += lengths[nxt]
                self._remove_free(extent.file_index, nxt)
            self._insert_free(extent.file_index, offset, length)

    # -- accounting ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Bytes of all files together."""
        return sum(self._file_sizes)

    @property
    def allocated(self) -> int:
        """Bytes held by live extents (padded)."""
        return self._allocated

    @property
    def free_bytes(self) -> int:
        """Bytes in free ranges."""
        return self.capacity - self._allocated

    @property
    def largest_free(self) -> int:
        """The longest free range (0 when none)."""
        with self._lock:
            return self._by_size[-1][0] if self._by_size else 0

    @property
    def file_sizes(self) -> list[int]:
        """Size of each file, by index."""
        return list(self._file_sizes)

    @property
    def live_count(self) -> int:
        """Number of live extents."""
        return len(self._live)

    def padded_of(self, file_index: int, offset: int) -> int:
        """The padded length of the live extent at ``(file_index, offset)`` (KeyError if none)."""
        with self._lock:
            return self._live[(file_index, offset)]

    def free_ranges(self, file_index: int | None = None) -> list[tuple[int, int, int]]:
        """Free ranges as sorted ``(file_index, offset, length)`` (all files, or one)."""
        with self._lock:
            files = range(len(self._file_sizes)) if file_index is None else [file_index]
            return [(f, o, self._lengths[f][o]) for f in files for o in self._starts[f]]

    def fragmentation(self) -> float:
        """``1 - largest_free / free_bytes``: 0 when the free space is one range, near 1 when shredded."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def __repr__(self) -> str:
        return (f"ExtentAllocator({len(self._file_sizes)} files, {format_bytes(self.capacity)}, "
                f"{format_bytes(self._allocated)} allocated in {len(self._live)} extents, "
                f"{len(self._by_size)} free ranges)")

    # -- internals (caller holds the lock) ----------------------------------------------------
    def _insert_free(self, file_index: int, offset: int, length: int) -> None:
        bisect.insort(self._starts[file_index], offset)
        self._lengths[file_index][offset] = length
        bisect.insort(self._by_size, (length, file_index, offset))

    def _remove_free(self, file_index: int, offset: int) -> None:
        length = self._lengths[file_index].pop(offset)
        starts = self._starts[file_index]
        del starts[bisect.bisect_left(starts, offset)]
        key = (length, file_index, offset)
        del self._by_size[bisect.bisect_left(self._by_size, key)]
