"""The dry run's host <-> device copies: ``storage.transfers.DeviceCopies`` on the simulated
clock, so that the step the dry run predicts pays for PCIe where the engine's does.

Why: on a GPU the engine copies a unit's parameters from its host slot (or home) to the device
on a stream of its own, and a unit's gradient back to the host on another
(``storage.transfers.CudaCopies``); [Note: copy events] in that module says what waits for
what. A copy takes PCIe time, overlaps the compute of other units, and only what reads its
destination waits for it. The dry run runs the engine's own ``Unit`` and ``Coordinator``,
which call the copies through that interface; this class keeps the same rules on two lanes of
the clock (``simulate.clock.Lane``), one per direction, each at the link's rate:

* ``to_device``: the copy is queued on the "H2D" lane when it is issued (a prefetch's copy as
  soon as its read is over and the device has room, ``Unit.advance_fetch``; a host-homed
  unit's when prefetch picks it and the device has room, ``Unit._copy_home``; otherwise at
  the fetch); its event fires at the copy's end on the clock;
* ``compute_waits``: the training thread's compute starts no earlier than that end (the wait
  is the "compute waits" row's, labelled with the unit);
* ``release_after``: the source slot goes back to its pool at that end (``SimClock.at``; the
  pool runs it when it is next asked for a slot, and one asked for with none free waits for it),
  as the engine's copies hand it back from their thread;
* ``to_host``: a gradient leaving the device, queued on the "D2H" lane (``simulate.stepper``
  issues it when a unit's backward -- and its reduce-scatter -- is over, and the CPU Adam of the
  unit, or the gradient's write to NVMe, starts after its end: ``host_waits`` on the step
  stream's side, which the stepper models as a start time, not as a wait of the training
  thread).

On a CPU device the engine's copies are immediate (``ImmediateCopies``: no thread, no cost):
there the rate is 0, every copy is over when it is issued, and the dry run is what it was
before the copies had lanes (the calibration bar on this machine).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from infinity.simulate.clock import Lane, SimClock
from infinity.storage.transfers import CopyEvent, DeviceCopies

__all__ = ["H2D", "D2H", "SimCopies", "SimCopyEvent"]

H2D = "H2D"
"""The host-to-device copies' row: a unit's parameters going up."""
D2H = "D2H"
"""The device-to-host copies' row: a unit's gradient coming down."""


class SimCopyEvent:
    """A copy that is over at ``end`` on ``clock``; waiting for it moves the training thread's
    clock there (a wait labelled ``what``)."""

    def __init__(self, clock: SimClock, end: float, what: str) -> None:
        self.clock, self.end, self.what = clock, end, what

    def done(self) -> bool:
        return self.clock.now >= self.end

    def wait(self) -> None:
        self.clock.wait_until(self.end, f"waits for {self.what}")


class SimCopies(DeviceCopies):
    """Copies on the clock (see the module docstring). ``link_Bps``: each direction's rate in
    bytes a second (0: free and immediate, a CPU device)."""

    def __init__(self, clock: SimClock, link_Bps: float) -> None:
        if link_Bps < 0:
            raise ValueError(f"a host <-> device link of {link_Bps} B/s: expected >= 0 "
                             "(0: the copies are free, a CPU device)")
        self.clock = clock
        # copies ahead of use only where they cost time (a CPU device's are immediate)
        self.overlaps_compute = link_Bps > 0
        # host -> device: a unit's parameters; overlaps the compute of the units before it
        # (compute waits on each copy's event only) and the other direction's copies
        self.h2d = Lane(clock, link_Bps, H2D)
        # device -> host: a unit's gradient; overlaps the backward of the units after it
        self.d2h = Lane(clock, link_Bps, D2H)
        self._unit = ""

    @contextlib.contextmanager
    def for_unit(self, name: str) -> Iterator[None]:
        """Copies issued inside are ``name``'s (the timeline labels them with it)."""
        outer, self._unit = self._unit, name
        try:
            yield
        finally:
            self._unit = outer

    def _copy(self, lane: Lane, src: torch.Tensor, kind: str) -> SimCopyEvent:
        nbytes = src.numel() * src.element_size()
        label = f"{kind} {self._unit}" if self._unit else kind
        end = lane.schedule(nbytes, what=f"{label} {nbytes / 2**20:.1f} MiB")
        return SimCopyEvent(self.clock, end, f"the {kind}" + (f" of {self._unit}"
                                                               if self._unit else ""))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        # the training thread's compute is over when it issues (the clock runs it in line)
        return self._copy(self.h2d, src, "copy")

    def write_device(self, dst: torch.Tensor, src: torch.Tensor, *,
                     after: CopyEvent | None = None) -> CopyEvent:
        # the dry run's stepper schedules its writes itself (simulate/stepper.py); one issued
        # here shares the link's lane, after ``after``
        nbytes = src.numel() * src.element_size()
        end = self.h2d.schedule(nbytes, not_before=None if after is None else
                                max(self.clock.now, _end(after, self.clock)),
                                what=f"write {self._unit} {nbytes / 2**20:.1f} MiB")
        return SimCopyEvent(self.clock, end, "the write" + (f" of {self._unit}"
                                                            if self._unit else ""))

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, add: bool = False,
                deferred: bool = False) -> CopyEvent:
        # an add crosses the link in the source's dtype and is made on the host at the wait:
        # the bytes that cross are the source's either way
        return self._copy(self.d2h, src, "gradient")

    def compute_waits(self, event: CopyEvent) -> None:
        event.wait()

    def host_waits(self, events: Iterable[CopyEvent]) -> None:
        for event in events:
            event.wait()

    def release_after(self, event: CopyEvent, release: Callable[[], None]) -> None:
        self.clock.at(_end(event, self.clock), release)

    def drain(self) -> None:
        while self.clock.next_due() is not None:
            self.clock.wait_until(self.clock.next_due(), "waits for the copies to drain")
            self.clock.run_due()


def _end(event: CopyEvent, clock: SimClock) -> float:
    """When ``event`` fires on the clock (an event of another kind: already over, as the
    immediate copies' are)."""
    if isinstance(event, SimCopyEvent):
        return event.end
    if not event.done():
        raise TypeError(f"{type(event).__name__}: the dry run's copies order only their own "
                        "events (SimCopyEvent) or ones already over")
    return clock.now
