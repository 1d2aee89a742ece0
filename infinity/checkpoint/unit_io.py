"""Moving a unit's flat states between their homes and checkpoint files, a chunk at a time.

A unit's states (parameters, fp32 master, exp_avg, exp_avg_sq) are flat stores in their home
tier, with each parameter at its offset (see [Note: flat layout] in zero/unit.py); a
checkpoint keeps each parameter as a tensor of its own, so that it loads into another stage,
tier or unit layout. Resident stores (HOST, DEVICE) are read and written through views; NVMe
stores through the host slots of a buffer pool, two chunks in flight, so a checkpoint of a
model larger than memory needs no more host memory than the training does.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, Sequence, Union

import torch

from infinity.storage.buffer_pool import BufferPool, Slot, wait_and_release
from infinity.storage.manager import ALIGN_BYTES, FlatStore, TierManager
from infinity.zero.unit import ParamEntry

# a unit's flat state: a store in its home tier, or the device copy of a persistent unit
Source = Union[FlatStore, torch.Tensor]
OWN_SLOT_BYTES = 8 << 20       # the pool made when the engine has none to lend
DEVICE_PIECE_BYTES = 64 << 20  # host copies of device memory are made this much at a time
SLOT_TIMEOUT_S = 120.0


class ChunkPool:
    """Host slots for chunks of NVMe stores: the optimizer's or the fetch pool's (idle while
    no step or fetch runs), else a small pool of its own, counted in the host budget."""

    def __init__(self, manager: TierManager, lendable: Sequence[BufferPool | None]) -> None:
        self.manager = manager
        self._pool = next((p for p in lendable if p is not None and p.slot_bytes >= ALIGN_BYTES),
                          None)

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            self._pool = BufferPool(self.manager, OWN_SLOT_BYTES, 2, "checkpoint")
        return self._pool

    @property
    def depth(self) -> int:
        return min(2, self.pool.count)

    def elements(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` per chunk: a slot, rounded down to whole 4 KiB blocks."""
        item = torch.empty((), dtype=dtype).element_size()
        return self.pool.slot_bytes // ALIGN_BYTES * ALIGN_BYTES // item

    def acquire(self) -> Slot:
        return self.pool.acquire(timeout=SLOT_TIMEOUT_S)

    def release(self, slot: Slot) -> None:
        self.pool.release(slot)


def _dtype(source: Source) -> torch.dtype:
    return source.dtype


# (entry, x, y): elements [x, y) of the unit's flat buffer that belong to ``entry``
Part = tuple[ParamEntry, int, int]
EVERYTHING = (0, 1 << 62)


def parts_of(entries: Sequence[ParamEntry], window: tuple[int, int] = EVERYTHING) -> list[Part]:
    """The parts of ``entries`` inside ``window`` (unit coordinates), in offset order: whole
    entries with one rank, a rank's slices of them with several (see [Note: shards] in
    zero/unit.py)."""
    a, b = window
    found = []
    for entry in sorted(entries, key=lambda e: e.offset):
        x, y = max(a, entry.offset), min(b, entry.offset + entry.numel)
        if x < y or (entry.numel == 0 and a <= entry.offset <= b):   # an empty one: kept whole
            found.append((entry, x, max(x, y)))
    return found


def span_of(parts: list[Part], dtype: torch.dtype, origin: int) -> tuple[int, int]:
    """[lo, hi) of a store whose element 0 is the unit's ``origin``, covering ``parts``,
    ``lo`` rounded down to a 4 KiB boundary."""
    per_block = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    lo = min(x for _, x, _ in parts) - origin
    return lo - lo % per_block, max(y for _, _, y in parts) - origin


def pieces(parts: list[Part], a: int, b: int) -> Iterator[Part]:
    """The pieces [x, y) of ``parts`` inside [a, b)."""
    for entry, x0, y0 in parts:
        x, y = max(a, x0), min(b, y0)
        if x < y:
            yield entry, x, y


def read_chunks(source: Source, lo: int, hi: int, chunks: ChunkPool
                ) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, values) covering [lo, hi) of ``source`` in order; values are host tensors
    valid until the next item."""
    if isinstance(source, torch.Tensor) or source.resident:
        tensor = source if isinstance(source, torch.Tensor) else source.tensor
        step = max(1, hi - lo) if tensor.device.type == "cpu" else \
            max(1, DEVICE_PIECE_BYTES // tensor.element_size())
        for a in range(lo, hi, step):
            yield a, tensor[a:min(hi, a + step)].cpu()
        return
    n = chunks.elements(source.dtype)
    starts = deque(range(lo, hi, n))
    in_flight: deque = deque()
    manager = chunks.manager
    try:
        while starts or in_flight:
            while starts and len(in_flight) < chunks.depth:
                a = starts.popleft()
                count = min(n, hi - a)
                slot = chunks.acquire()
                try:
                    request = source.load_async(slot.view(source.dtype, n), a, count)
                except BaseException:
                    chunks.release(slot)
                    raise
                in_flight.append((a, count, slot, request))
            a, count, slot, request = in_flight.popleft()
            try:
                manager.wait(request)
                yield a, slot.view(source.dtype, count)
            finally:
                chunks.release(slot)
    finally:
        for _, _, slot, request in in_flight:
            try:
                manager.wait(request)
            finally:
                chunks.release(slot)


# emit(part, values of elements [x, y) of the unit, a piece of the part)
Emit = Callable[[Part, torch.Tensor], None]


def save_entries(source: Source, parts: list[Part], chunks: ChunkPool, emit: Emit,
                 origin: int = 0) -> None:
    """Hand the values of ``parts`` (``parts_of``) in ``source``, whose element 0 is the
    unit's element ``origin``, to ``emit`` in pieces, in offset order (the order their tensors
    have in the file)."""
    if not parts:
        return
    lo, hi = span_of(parts, _dtype(source), origin)
    for a, values in read_chunks(source, lo, hi, chunks):
        start = a + origin
        for part in parts:
            entry, x0, y0 = part
            x, y = max(start, x0), min(start + values.numel(), y0)
            if x < y:
                emit(part, values[x - start:y - start])


# fill(entry, first element of the entry, host tensor to fill)
Fill = Callable[[ParamEntry, int, torch.Tensor], None]


def load_entries(target: Source, parts: list[Part], chunks: ChunkPool, fill: Fill,
                 both_extents: bool = False, merge: bool = False, origin: int = 0) -> None:
    """Write the values of ``parts`` (``parts_of`` the target's range), got from ``fill``,
    into ``target``, whose element 0 is the unit's element ``origin`` (with ``both_extents``
    also into a doubled store's shadow extent). The gaps between entries are zero; with
    ``merge`` (some of the unit's parameters keep their values) each NVMe chunk is read
    before it is filled."""
    if not parts:
        return
    lo, hi = span_of(parts, _dtype(target), origin)
    if isinstance(target, torch.Tensor) or target.resident:
        tensor = target if isinstance(target, torch.Tensor) else target.tensor
        _load_in_memory(tensor, parts, fill, origin)
        return
    n = chunks.elements(target.dtype)
    manager = chunks.manager
    in_flight: deque = deque()
    try:
        for a in range(lo, hi, n):
            count = min(n, hi - a)
            if len(in_flight) == chunks.depth:
                wait_and_release(deque([in_flight.popleft()]), manager.wait, chunks.release)
            slot = chunks.acquire()
            try:
                buf = slot.view(target.dtype, n)
                if merge:
                    manager.wait(target.load_async(buf, a, count))
                else:
                    buf.zero_()
                for entry, x, y in pieces(parts, a + origin, a + origin + count):
                    fill(entry, x - entry.offset, buf[x - origin - a:y - origin - a])
                shadows = (False, True) if both_extents and target.doubled else (False,)
                requests = [target.store_async(buf, a, count, shadow=s) for s in shadows]
            except BaseException:
                chunks.release(slot)
                raise
            in_flight.append((requests, slot))
    finally:
        wait_and_release(in_flight, manager.wait, chunks.release)


def _load_in_memory(tensor: torch.Tensor, parts: list[Part], fill: Fill, origin: int) -> None:
    """Parts straight into a host tensor, or through host pieces into device memory."""
    with torch.no_grad():
        for entry, x, y in parts:
            view = tensor[x - origin:y - origin]
            first = x - entry.offset
            if tensor.device.type == "cpu":
                fill(entry, first, view)
                continue
            step = max(1, DEVICE_PIECE_BYTES // tensor.element_size())
            for a in range(0, y - x, step):
                piece = torch.empty(min(step, y - x - a), dtype=tensor.dtype)
                fill(entry, first + a, piece)
                view[a:a + piece.numel()].copy_(piece)
