"""Host <-> device copies, ordered by events: one owner of the copy streams and their events.

Why one object (issue 36; FSDP2's ``FSDPCommContext`` is the model): on a GPU a copy between a
host slot and the device must not stall compute, so it runs on a stream of its own, and
everything that depends on it -- the compute that reads the unit, the reuse of the host slot
it came from -- waits on that copy's event, never on the whole device. Keeping every stream and
event here, each commented with what it overlaps, means no other module orders device work.

[Note: copy events]
A copy returns a ``CopyEvent``. Two rules use it, both here:
- compute that reads the destination waits for the event (``compute_waits``): on a GPU the
  compute stream waits on it (the CPU thread does not block); elsewhere the calling thread.
- the source buffer goes back to its pool only after the event (``release_after``): a slot
  reused earlier could be overwritten by the next NVMe read while the copy still reads it.

Three implementations:
- ``ImmediateCopies`` (a CPU device): a copy is over when it returns; no thread, no cost.
- ``CudaCopies``: a host-to-device stream, events recorded on it; the compute stream waits on
  a copy's event; a released source is handed back by a thread once its event has fired.
- ``LateCopies`` (tests): each copy happens on a helper thread after a seeded random delay, and
  a buffer handed back to its pool while a copy still reads it is NaN-filled (poisoned; the
  pools tell the copies of each release, ``on_release``): a missing wait or an early reuse
  gives NaN or wrong values instead of passing by luck.
  ``INFINITY_LATE_TRANSFERS=<seed>`` selects it for every engine of the process (how the parity
  tests run under it).
"""
from __future__ import annotations

import os
import queue
import random
import threading
import time
from typing import Callable, Protocol

import torch

__all__ = ["CopyEvent", "DeviceCopies", "ImmediateCopies", "CudaCopies", "LateCopies",
           "device_copies", "LATE_ENV"]

LATE_ENV = "INFINITY_LATE_TRANSFERS"
"""Set to an integer seed: every engine's copies complete late, on a helper thread (tests)."""


class CopyEvent(Protocol):
    def done(self) -> bool:
        """The copy is over (its destination holds the bytes; its source may be reused)."""

    def wait(self) -> None:
        """Block the calling thread until the copy is over."""


class _Done:
    """An event that has fired."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = _Done()


class DeviceCopies:
    """The copies' owner (see the module docstring); the base is the immediate one."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        """Copy host ``src`` into device ``dst``; the event says when it is over."""
        raise NotImplementedError

    def compute_waits(self, event: CopyEvent) -> None:
        """Compute that reads what ``event``'s copy wrote runs after it (see [Note: copy
        events])."""
        event.wait()

    def release_after(self, event: CopyEvent, release: Callable[[], None]) -> None:
        """Call ``release`` (give the copy's source buffer back) once ``event`` has fired."""
        event.wait()
        release()

    def on_release(self, buffer: torch.Tensor) -> None:
        """A pool takes ``buffer`` back (``storage.buffer_pool``): nothing to do unless a copy
        still reads it, which only the late copies check."""

    def drain(self) -> None:
        """Every copy over and every release made (before the pools or the engine close)."""


class ImmediateCopies(DeviceCopies):
    """A CPU device: a copy is over when ``to_device`` returns."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        with torch.no_grad():
            dst.copy_(src)
        return DONE


class CudaCopies(DeviceCopies):
    """A GPU: copies on their own streams, ordered by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # host -> device: a unit's parameters from its pinned host slot; overlaps the compute
        # of the units before it (the compute stream waits on each copy's event only)
        self.h2d = torch.cuda.Stream(device=device)
        # sources handed back once their copy's event fired, on a thread of their own (a pool
        # whose slots all wait for copies must still get them back without another copy)
        self._releases: queue.Queue = queue.Queue()
        self._error: BaseException | None = None    # the first a wait or release raised
        self._releaser = threading.Thread(target=self._release_when_done,
                                          name="copy-releases", daemon=True)
        self._releaser.start()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        # the destination may have been read by compute that is still queued: start after it
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d), torch.no_grad():
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        # the caching allocator must not give dst's memory to others before the copy is over
        dst.record_stream(self.h2d)
        return _CudaEvent(event)

    def compute_waits(self, event: CopyEvent) -> None:
        if isinstance(event, _CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.event)
        else:
            event.wait()

    def release_after(self, event: CopyEvent, release: Callable[[], None]) -> None:
        if self._error is not None:
            raise RuntimeError(f"a host-to-device copy failed earlier: {self._error}") \
                from self._error
        self._releases.put((event, release, None))

    def _release_when_done(self) -> None:
        while True:
            event, release, done = self._releases.get()
            try:
                event.wait()
                release()
            except BaseException as exc:  # noqa: BLE001 - kept for the training thread
                # a CUDA error (a device-side assert, say): the thread goes on, so that close
                # does not hang, and the next release or drain raises it
                if self._error is None:
                    self._error = exc
            if done is not None:
                done.set()

    def drain(self) -> None:
        done = threading.Event()
        self._releases.put((DONE, lambda: None, done))
        done.wait()
        if self._error is not None:
            raise RuntimeError(f"a host-to-device copy failed: {self._error}") from self._error


class _CudaEvent:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class _LateEvent:
    def __init__(self) -> None:
        self._over = threading.Event()

    def done(self) -> bool:
        return self._over.is_set()

    def wait(self) -> None:
        self._over.wait()


class LateCopies(DeviceCopies):
    """Tests: copies complete late and out of the caller's sight (see the module docstring).
    ``max_delay_s`` bounds each copy's random delay; ``seed`` makes the delays reproducible."""

    def __init__(self, seed: int, max_delay_s: float = 0.003) -> None:
        self._rng = random.Random(seed)
        self._max_delay = max_delay_s
        self._jobs: queue.Queue = queue.Queue()
        self._reading: dict[int, tuple[int, int]] = {}   # id(event) -> source's byte range
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="late-copies", daemon=True)
        self._thread.start()
        self.copies = 0
        self.poisoned = 0
        self.lost = 0

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        event = _LateEvent()
        self.copies += 1
        # until the copy runs the destination holds NaN: compute that did not wait reads it
        dst.view(torch.uint8).fill_(0xFF)
        start = src.data_ptr()
        with self._lock:
            self._reading[id(event)] = (start, start + src.numel() * src.element_size())
        self._jobs.put((self._rng.random() * self._max_delay, dst, src, event))
        return event

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if callable(job):        # a release queued behind a copy
                job()
                continue
            delay, dst, src, event = job
            time.sleep(delay)
            try:
                if not (_holds(dst) and _holds(src)):
                    raise RuntimeError("released before its copy")
                with torch.no_grad():
                    dst.copy_(src)
            except RuntimeError:
                # its destination was released (or its source freed) before or while the copy
                # ran: a missing wait; the copy is lost (what read the destination read NaN)
                self.lost += 1
            with self._lock:
                self._reading.pop(id(event), None)
            event._over.set()

    def release_after(self, event: CopyEvent, release: Callable[[], None]) -> None:
        # like a GPU's: the caller goes on; the release follows the copy on the helper thread
        self._jobs.put(release)

    def on_release(self, buffer: torch.Tensor) -> None:
        lo = buffer.data_ptr()
        hi = lo + buffer.numel() * buffer.element_size()
        with self._lock:
            read = any(a < hi and lo < b for a, b in self._reading.values())
        if read:
            # handed back while a copy still reads it: the copy (and whatever it feeds) gets NaN
            buffer.view(torch.uint8).fill_(0xFF)
            self.poisoned += 1

    def drain(self) -> None:
        done = _LateEvent()
        self._jobs.put((0.0, torch.empty(0), torch.empty(0), done))
        done.wait()


def _holds(t: torch.Tensor) -> bool:
    """``t``'s storage still has the memory ``t`` spans (a released unit's has none)."""
    need = (t.storage_offset() + t.numel()) * t.element_size()
    return t.untyped_storage().nbytes() >= need


def device_copies(device: torch.device) -> DeviceCopies:
    """The copies for ``device``: late ones when ``INFINITY_LATE_TRANSFERS`` is set (tests),
    else on CUDA streams for a GPU, else immediate."""
    seed = os.environ.get(LATE_ENV, "").strip()
    if seed:
        if not seed.lstrip("-").isdigit():
            raise ValueError(f"{LATE_ENV}={seed!r}: expected an integer seed (or unset it)")
        return LateCopies(int(seed))
    if device.type == "cuda":
        return CudaCopies(device)
    return ImmediateCopies()
