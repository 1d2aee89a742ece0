"""A pool of fixed-size, page-aligned host slots, allocated once from the host budget.

Swap-ins and the optimizer pipeline stage data in slots instead of allocating per request, so the
host memory used for staging is fixed at start-up (and counted), whatever the model size.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from infinity.base.sizes import format_bytes


@dataclass(eq=False)
class Slot:
    """One slot: ``buffer`` is a uint8 tensor of the pool's slot size."""

    index: int
    buffer: torch.Tensor

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the slot as ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > self.buffer.numel():
            raise ValueError(f"slot {self.index} holds {self.buffer.numel()} bytes, asked for "
                             f"{numel} x {dtype} = {numel * itemsize} bytes")
        return self.buffer[: numel * itemsize].view(dtype)


class SlotExhaustedError(RuntimeError):
    """All slots are in use (the caller asked for more concurrency than the pool was sized for)."""


class BufferPool:
    """``count`` slots of ``slot_bytes`` each."""

    def __init__(self, manager, slot_bytes: int, count: int, name: str) -> None:
        if count < 1 or slot_bytes < 1:
            raise ValueError(f"{name}: a buffer pool needs >= 1 slot of >= 1 byte, got "
                             f"{count} x {slot_bytes}")
        self.name = name
        self.slot_bytes = slot_bytes
        self._free = [Slot(i, manager.host_empty(slot_bytes, torch.uint8, what=f"{name} slot {i}"))
                      for i in range(count)]
        self.count = count
        self._cond = threading.Condition()
        # told of each release, so a copy still reading the slot is caught (storage/transfers.py)
        self._copies = getattr(manager, "copies", None)

    def acquire(self, timeout: float | None = None) -> Slot:
        """A free slot; waits up to ``timeout`` for one, then raises SlotExhaustedError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise SlotExhaustedError(
                    f"{self.name}: all {self.count} slots of {format_bytes(self.slot_bytes)} are "
                    "in use; raise the host budget or lower the prefetch depth")
            return self._free.pop()

    def try_acquire(self) -> Slot | None:
        """A free slot, or None when all are in use."""
        with self._cond:
            return self._free.pop() if self._free else None

    def release(self, slot: Slot) -> None:
        if self._copies is not None:
            self._copies.on_release(slot.buffer)
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    @property
    def available(self) -> int:
        return len(self._free)


def wait_and_release(in_flight: list | deque, wait: Callable[..., Any],
                     release: Callable[[Any], None]) -> None:
    """Wait for each ``(requests, slot)`` of ``in_flight`` and release its slot, every one even
    when an earlier wait raised (the first error is raised after all are done): stopping at the
    first failure left the later slots taken for good, one more per failed load or write.
    A slot goes back only once its own requests are over (I/O may still read it before)."""
    error: BaseException | None = None
    while in_flight:
        requests, slot = in_flight.pop(0) if isinstance(in_flight, list) else in_flight.popleft()
        for request in requests:
            try:
                wait(request)
            except BaseException as exc:   # noqa: BLE001 - raised below, once all are waited
                error = error or exc
        release(slot)
    if error is not None:
        raise error
