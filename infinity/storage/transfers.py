"""Host <-> device copies, ordered by events: one owner of the copy streams and their events.

Why one object (issue 36; FSDP2's ``FSDPCommContext`` is the model): on a GPU a copy between a
host slot and the device must not stall compute, so it runs on a stream of its own, and
everything that depends on it -- the compute that reads the unit, the reuse of the host slot
it came from, the host code that reads a gradient copied out -- waits on that copy's event,
never on the whole device. Keeping every stream and event here, each commented with what it
overlaps, means no other module orders device work.

[Note: copy events]
A copy returns a ``CopyEvent``. Four rules use it, all here:
- host -> device (``to_device``: a unit's parameters from their host slot or home, a saved
  activation read back for backward): compute that reads the destination waits for the event
  (``compute_waits``): on a GPU the compute stream waits on it (the CPU thread does not
  block); elsewhere the calling thread. The copy itself starts after the compute queued so far
  (it may still read the destination's memory). These copies run in the order issued (one
  stream), so a copy issued after another into the same memory lands after it.
- host -> device, a step's results (``write_device``: a stepped unit's new values into its
  device copy, whose readers all ran before its gradient landed; see [Note: the device copy
  written behind the step] in optim/device_copy.py): on a stream of their own, ordered after
  nothing but ``after``, the copy that filled that memory when it may still be in flight (a
  step started ahead of its unit's use writes behind the unit's prefetch). See [Note: the
  step's writes do not queue behind fetches].
- the source buffer goes back to its pool (or is freed) only after the event
  (``release_after``): a slot reused earlier could be overwritten by the next NVMe read while
  the copy still reads it; a pinned buffer freed earlier would be unmapped under the copy.
- device -> host (``to_host``: a gradient to its host buffer or home, copied or added; a saved
  activation into a staging chunk on its way to NVMe): the
  copy starts after the compute that wrote the source, and the source stays allocated until
  the event; the host code that reads the destination first waits for the events of every copy
  into it (``host_waits``: blocks the calling thread; an add is finished there, on the host,
  after its copy landed). The owner of the destination keeps the events (optim/gradients.py:
  per unit, waited before the unit's gradient is first read; zero/activation_swap.py: per
  staging chunk, waited before the chunk is written to NVMe, see [Note: activation copies]).
- a host destination goes back to its pool (or is zeroed, or written again from the host) only
  after ``host_waits`` of its copies: a copy still landing would write into the next user's
  bytes.

Three implementations:
- ``ImmediateCopies`` (a CPU device): a copy is over when it returns; no thread, no cost.
- ``CudaCopies``: a host-to-device stream and a device-to-host stream, events recorded on them;
  the compute stream waits on a host-to-device copy's event; a released source is handed back by
  a thread once its event has fired; a host reader synchronizes on a device-to-host copy's event,
  and an add is made by a thread of its own as its copy lands (storage/host_adds.py).
- ``LateCopies`` (tests): each copy happens on a helper thread after a seeded random delay; the
  destination of a copy (either way) reads NaN until then (an add lands in a staging buffer and
  is made at the host wait), and a buffer handed back to its pool while a copy still reads or
  writes it is NaN-filled (poisoned; the pools tell the copies of each release,
  ``on_release``): a missing wait or an early reuse gives NaN or wrong values instead of
  passing by luck; a step's write not ordered after a copy into the same memory that has not
  landed lands before it (``write_device``), so the copy leaves stale values.
  ``INFINITY_LATE_TRANSFERS=<seed>`` selects it for every engine of the process (how the parity
  tests run under it).

[Note: the step's writes do not queue behind fetches]
A fetch's copy waits for the compute queued when it is issued (its memory's previous users may
still read it), and prefetch issues it as far ahead as the training thread runs: in a backward
on a GPU the training thread queues kernels ~130 ms ahead of the device (the 0.49B model, 32 x
1024 tokens, the fourth H200 pass), so the copy stream holds copies that each wait for compute
that far ahead. The step's writes of a unit's device copy went on that same stream, behind
them: the first write of the last micro-batch's backward, issued 78 ms before the end of that
backward's compute, landed after it, and the step stream waited 65 ms for it
(``DeviceCopyWrites.settle``) instead of stepping the next units, which then ran after the
backward, beside an idle GPU. A write waits for no compute (every reader of the device copy is
over when it is issued), so it has a stream of its own (``CudaCopies.writes``), ordered only
after the copy that filled the same memory where that may still be in flight (``after``: the
unit's ``fill_event``; a step started ahead writes behind its unit's prefetch). Both streams
share the link; the dry run already scheduled these writes in the link's gaps
(simulate/stepper.py), not behind the fetches.
"""
from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from infinity.storage.host_adds import HostAdd, HostAdder, add_widened

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

    overlaps_compute: bool = False
    """A copy runs beside compute (a stream or a thread of its own), so one issued ahead of use
    is hidden behind the compute before it: prefetch then copies a host-homed unit to the
    device ahead (zero/unit.py ``_copy_home``). The immediate copies run on the calling thread,
    where a copy ahead would hide nothing and only hold device memory sooner."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        """Copy host ``src`` into device ``dst``, after the compute queued so far (which may
        still read ``dst``'s memory); the event says when it is over (see [Note: copy
        events])."""
        raise NotImplementedError

    def write_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                     after: CopyEvent | None = None) -> CopyEvent:
        """Write host ``src`` into device ``dst``, every reader of which is over (a step's
        results into a unit's device copy): ordered after ``after`` (the copy that filled
        ``dst``'s memory, where it may still be in flight) and nothing else; the event says
        when it is over (see [Note: the step's writes do not queue behind fetches])."""
        raise NotImplementedError

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, add: bool = False,
                deferred: bool = False) -> CopyEvent:
        """Copy device ``src`` into host ``dst`` of its shape (``add``: add it to what ``dst``
        holds, bit for bit ``dst.add_(src)``); whatever reads, reuses or writes ``dst`` from the
        host waits for the event first (``host_waits``; see [Note: copy events]).
        ``deferred``: an add no thread makes on its own: the first wait makes it, or a step
        claims it to fold into its kernel (``HostAdd.claim``; [Note: the last adds fold into the
        step] in optim/boundary_steps.py); the immediate copies make it at once, the late ones
        make every add at its wait."""
        raise NotImplementedError

    def compute_waits(self, event: CopyEvent) -> None:
        """Compute that reads what ``event``'s copy wrote runs after it (see [Note: copy
        events])."""
        event.wait()

    def host_waits(self, events: Iterable[CopyEvent]) -> None:
        """The calling thread reads the host destinations of these device-to-host copies only
        after: blocks until each is over, in order (an add is made on the host here, after its
        copy); see [Note: copy events]."""
        for event in events:
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

    def write_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                     after: CopyEvent | None = None) -> CopyEvent:
        return self.to_device(dst, src)      # ``after`` is over: every copy here is

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, add: bool = False,
                deferred: bool = False) -> CopyEvent:
        with torch.no_grad():
            if add:
                add_widened(dst, src)
            else:
                dst.copy_(src)
        return DONE


class CudaCopies(DeviceCopies):
    """A GPU: copies on their own streams, ordered by events."""

    overlaps_compute = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # host -> device: a unit's parameters from its pinned host slot or host home (issued
        # ahead of use by prefetch), and saved activations read back for backward; overlaps
        # the compute of the units (or the backward of the tensors) before it (the compute
        # stream waits on each copy's event only)
        self.h2d = torch.cuda.Stream(device=device)
        # device -> host: a unit's gradients to their host buffer (or home) as backward makes
        # them, and saved activations swapped out in forward; overlaps the compute after them
        # (and the host-to-device copies, on the other copy engine); the host reads a gradient,
        # or writes an activation's staging chunk to NVMe, only after its copy's event
        # (``host_waits``)
        self.d2h = torch.cuda.Stream(device=device)
        # host -> device, the step's results: a stepped unit's new values into its device copy,
        # on a stream of their own, not behind the fetches on ``h2d`` (each of which waits for
        # the compute queued when it was issued); ordered after the copy that filled the same
        # memory only (see [Note: the step's writes do not queue behind fetches])
        self.writes = torch.cuda.Stream(device=device)
        # sources handed back once their copy's event fired, on a thread of their own (a pool
        # whose slots all wait for copies must still get them back without another copy)
        self._releases: queue.Queue = queue.Queue()
        self._error: BaseException | None = None    # the first a wait or release raised
        self._releaser = threading.Thread(target=self._release_when_done,
                                          name="copy-releases", daemon=True)
        self._releaser.start()
        # device-to-host adds made on the host as their copies land, in the order issued, on
        # a thread of their own (storage/host_adds.py)
        self._adder = HostAdder()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        # the destination may have been read by compute that is still queued: start after it
        # (the copies issued before on this stream are ordered anyway)
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        return self._copy_up(self.h2d, dst, src)

    def write_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                     after: CopyEvent | None = None) -> CopyEvent:
        if isinstance(after, _CudaEvent):
            self.writes.wait_event(after.event)
        elif after is not None:
            after.wait()
        return self._copy_up(self.writes, dst, src)

    def _copy_up(self, stream: torch.cuda.Stream, dst: torch.Tensor,
                 src: torch.Tensor) -> CopyEvent:
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)   # a host wait sleeps, not spins
            event.record(stream)
        # the caching allocator must not give dst's memory to others before the copy is over
        dst.record_stream(stream)
        return _CudaEvent(event)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, add: bool = False,
                deferred: bool = False) -> CopyEvent:
        # the source was written by compute that may still be queued: start after it
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h), torch.no_grad():
            if add:
                # landed as it is (16-bit stays 16-bit over PCIe) in pinned staging memory, and
                # added on the host at the wait: what the immediate copies add, bit for bit
                staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                staging.copy_(src, non_blocking=True)
            else:
                # dst is pinned where it is a pool slot or a host home (``host_empty``)
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)   # a host wait sleeps, not spins
            event.record(self.d2h)
        # the caching allocator must not give src's memory to others before the copy is over
        src.record_stream(self.d2h)
        if not add:
            return _CudaEvent(event)
        made = HostAdd(_CudaEvent(event), dst, staging)
        return made if deferred else self._adder.add(made)

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
            # the names outlive the iteration: the last release (a closure over a pool slot)
            # and its event would keep that buffer referenced while the queue is empty
            del event, release, done

    def drain(self) -> None:
        done = threading.Event()
        self._releases.put((DONE, lambda: None, done))
        done.wait()
        self._adder.drain()
        # copies nobody waited for write no more: a device-to-host copy, and a host-to-device
        # copy from a host home (no ``release_after`` follows it, so the queue above did not
        # wait for it) whose destination or source may be freed once the engine closes
        self.h2d.synchronize()
        self.writes.synchronize()
        self.d2h.synchronize()
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

    overlaps_compute = True     # a GPU's path: host-homed units are copied ahead

    def __init__(self, seed: int, max_delay_s: float = 0.003) -> None:
        self._rng = random.Random(seed)
        self._max_delay = max_delay_s
        self._jobs: queue.Queue = queue.Queue()
        # id(event) -> the host byte range its copy still reads (to the device) or writes (to
        # the host: ``writes``)
        self._host_ranges: dict[int, tuple[int, int, bool]] = {}
        self._dropped: set[int] = set()    # id(event): its host destination went back first
        # id(event) -> the device byte range a host-to-device copy not yet run writes: a write
        # not ordered after it lands first (``write_device``)
        self._device_ranges: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="late-copies", daemon=True)
        self._thread.start()
        self.copies = 0             # both ways
        self.to_host_copies = 0     # device -> host (``to_host``), of ``copies``
        self.poisoned = 0
        self.lost = 0
        self.overtaking = 0         # writes that landed before a copy into their memory
        self.behind_fill = 0        # writes ordered after a copy into their memory in flight

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        # compute on a CPU device runs on the calling thread: it is over either way
        event = _LateEvent()
        self.copies += 1
        # until the copy runs the destination holds NaN: compute that did not wait reads it
        dst.view(torch.uint8).fill_(0xFF)
        lo = dst.data_ptr()
        with self._lock:
            self._device_ranges[id(event)] = (lo, lo + dst.numel() * dst.element_size())
        self._issue(dst, src, event, host=src, writes=False)
        return event

    def write_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                     after: CopyEvent | None = None) -> CopyEvent:
        # A GPU's writes have a stream of their own: ordered after ``after`` and nothing else.
        # Here the worst order: a write not ordered after a copy into the same memory that has
        # not run yet lands before it, at once (the copy then overwrites it with the values it
        # carries), so a missing ``after`` gives stale values, not a lucky pass; one ordered
        # after it queues behind it (one thread: in the order issued).
        lo = dst.data_ptr()
        hi = lo + dst.numel() * dst.element_size()
        with self._lock:      # one look: a copy landing meanwhile changes nothing decided
            pending = [key for key, (a, b) in self._device_ranges.items() if a < hi and lo < b]
        if after is not None and id(after) in pending:
            self.behind_fill += 1
            return self.to_device(dst, src)
        if pending:
            self.overtaking += 1
            self.copies += 1
            with torch.no_grad():
                dst.copy_(src)
            return DONE
        return self.to_device(dst, src)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, add: bool = False,
                deferred: bool = False) -> CopyEvent:
        event = _LateEvent()
        self.copies += 1
        self.to_host_copies += 1
        if add:
            # lands in staging; the add into dst is made at the host wait (a reader that does
            # not wait reads dst without it)
            staging = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            self._issue(staging, src, event, host=None, writes=True)
            return HostAdd(event, dst, staging)
        # until the copy runs the destination holds NaN: a reader that did not wait reads it
        dst.view(torch.uint8).fill_(0xFF)
        self._issue(dst, src, event, host=dst, writes=True)
        return event

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, event: _LateEvent,
               host: torch.Tensor | None, writes: bool) -> None:
        """Queue the copy, with ``host`` (a pool's buffer it reads, or ``writes``) watched for
        an early release."""
        if host is not None:
            start = host.data_ptr()
            with self._lock:
                self._host_ranges[id(event)] = (
                    start, start + host.numel() * host.element_size(), writes)
        self._jobs.put((self._rng.random() * self._max_delay, dst, src, event))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if callable(job):        # a release queued behind a copy
                job()
                continue
            delay, dst, src, event = job
            time.sleep(delay)
            try:
                with self._lock:
                    dropped = id(event) in self._dropped
                    self._dropped.discard(id(event))
                if dropped or not (_holds(dst) and _holds(src)):
                    raise RuntimeError("released before its copy")
                with torch.no_grad():
                    dst.copy_(src)
            except RuntimeError:
                # its destination was released (or its source freed) before or while the copy
                # ran: a missing wait; the copy is lost (what read the destination read NaN)
                self.lost += 1
            with self._lock:
                self._host_ranges.pop(id(event), None)
                self._device_ranges.pop(id(event), None)
                self._dropped.discard(id(event))     # a release while it ran
            event._over.set()

    def release_after(self, event: CopyEvent, release: Callable[[], None]) -> None:
        # like a GPU's: the caller goes on; the release follows the copy on the helper thread
        self._jobs.put(release)

    def on_release(self, buffer: torch.Tensor) -> None:
        lo = buffer.data_ptr()
        hi = lo + buffer.numel() * buffer.element_size()
        with self._lock:
            busy = [(key, writes) for key, (a, b, writes) in self._host_ranges.items()
                    if a < hi and lo < b]
            # a copy to the host that has not landed is lost: its bytes are the next user's
            self._dropped.update(key for key, writes in busy if writes)
        if busy:
            # handed back while a copy still reads or writes it: the copy (and whatever it
            # feeds) gets NaN, the next user finds NaN
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
