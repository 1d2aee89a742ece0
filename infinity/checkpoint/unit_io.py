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


def span_of(entries: list[ParamEntry], dtype: torch.dtype) -> tuple[int, int]:
    """[lo, hi) covering ``entries``, ``lo`` rounded down to a 4 KiB boundary."""
    per_block = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    lo = min(e.offset for e in entries)
    return lo - lo % per_block, max(e.offset + e.numel for e in entries)


def pieces(entries: list[ParamEntry], a: int, b: int) -> Iterator[tuple[ParamEntry, int, int]]:
    """(entry, x, y): the parts [x, y) of ``entries`` inside [a, b)."""
    for entry in entries:
        x, y = max(a, entry.offset), min(b, entry.offset + entry.numel)
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


def save_entries(source: Source, entries: list[ParamEntry], chunks: ChunkPool,
                 emit: Callable[[ParamEntry, torch.Tensor], None]) -> None:
    """Hand each entry's values in ``source`` to ``emit`` in pieces, entries in offset
    order (the order their tensors have in the file)."""
    if not entries:
        return
    ordered = sorted(entries, key=lambda e: e.offset)
    lo, hi = span_of(ordered, _dtype(source))
    for a, values in read_chunks(source, lo, hi, chunks):
        for entry, x, y in pieces(ordered, a, a + values.numel()):
            emit(entry, values[x - a:y - a])


# fill(entry, first element of the entry, host tensor to fill)
Fill = Callable[[ParamEntry, int, torch.Tensor], None]


def load_entries(target: Source, entries: list[ParamEntry], chunks: ChunkPool, fill: Fill,
                 both_extents: bool = False, merge: bool = False) -> None:
    """Write each entry's values, got from ``fill``, into ``target`` (with ``both_extents``
    also into a doubled store's shadow extent). The gaps between entries are zero; with
    ``merge`` (some of the unit's parameters keep their values) each NVMe chunk is read
    before it is filled."""
    if not entries:
        return
    ordered = sorted(entries, key=lambda e: e.offset)
    lo, hi = span_of(ordered, _dtype(target))
    if isinstance(target, torch.Tensor) or target.resident:
        tensor = target if isinstance(target, torch.Tensor) else target.tensor
        _load_in_memory(tensor, ordered, fill)
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
                for entry, x, y in pieces(ordered, a, a + count):
                    fill(entry, x - entry.offset, buf[x - a:y - a])
                shadows = (False, True) if both_extents and target.doubled else (False,)
                requests = [target.store_async(buf, a, count, shadow=s) for s in shadows]
            except BaseException:
                chunks.release(slot)
                raise
            in_flight.append((requests, slot))
    finally:
        wait_and_release(in_flight, manager.wait, chunks.release)


def _load_in_memory(tensor: torch.Tensor, entries: list[ParamEntry], fill: Fill) -> None:
    """Entries straight into a host tensor, or through host pieces into device memory."""
    with torch.no_grad():
        for entry in entries:
            view = tensor[entry.offset:entry.offset + entry.numel]
            if tensor.device.type == "cpu":
                fill(entry, 0, view)
                continue
            step = max(1, DEVICE_PIECE_BYTES // tensor.element_size())
            for a in range(0, entry.numel, step):
                part = torch.empty(min(step, entry.numel - a), dtype=tensor.dtype)
                fill(entry, a, part)
                view[a:a + part.numel()].copy_(part)
