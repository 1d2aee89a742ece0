"""The dry run's simulated clock: seconds on the training thread, and the lanes that serve
transfers on it.

The clock: one ``Lane`` per resource (the disk, which reads and writes share; the network; the
host <-> device copies of ``simulate.copies``, one lane a direction), each serving its transfers
in order at its rate; a request is done when the clock has passed its end, and waiting for it
moves the clock there (counted as I/O wait). What another thread of the engine does when an
event fires (a copy's source slot handed back) is an action the clock runs at the event's time
(``SimClock.at``).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["SimClock", "COMPUTE", "WAIT", "Lane"]


@dataclass
class SimClock:
    """Seconds since the dry run began, on the training thread."""

    now: float = 0.0
    io_wait_s: float = 0.0
    """Time the training thread spent waiting on requests."""
    spans: list[tuple[str, float, float, str]] | None = None
    """When a list: every busy interval of every resource, (resource, start, end, what) --
    the timeline commands/dry_run_trace.py writes (None: not recorded)."""
    _due: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list, repr=False)
    """Actions waiting for their time (``at``): a heap of (time, order, action)."""
    _seq: int = 0

    def record(self, resource: str, start: float, end: float, what: str) -> None:
        """``resource`` was busy with ``what`` from ``start`` to ``end`` (seconds)."""
        if self.spans is not None and end > start:
            self.spans.append((resource, start, end, what))

    def wait_until(self, t: float, what: str = "waits for I/O") -> None:
        if t > self.now:
            self.record(WAIT, self.now, t, what)
            self.io_wait_s += t - self.now
            self.now = t

    def compute(self, seconds: float, what: str) -> None:
        """The training thread computes for ``seconds``."""
        self.record(COMPUTE, self.now, self.now + seconds, what)
        self.now += seconds

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Do ``action`` once the clock has reached ``t`` (at once if it has): what another
        thread of the engine does when an event fires, e.g. a copy's source slot handed back
        (``simulate.copies``). Due actions run when someone looks (``run_due``)."""
        if t <= self.now:
            action()
            return
        self._seq += 1
        heapq.heappush(self._due, (t, self._seq, action))

    def run_due(self) -> None:
        """Run the actions whose time has come, earliest first."""
        while self._due and self._due[0][0] <= self.now:
            heapq.heappop(self._due)[2]()

    def next_due(self) -> float | None:
        """When the earliest action still to run is due (None: there is none)."""
        return self._due[0][0] if self._due else None


COMPUTE = "compute"
"""The training thread's forward and backward (the GPU's kernels, or the CPU's)."""
WAIT = "compute waits"
"""The training thread waiting for a transfer or a step it needs."""


@dataclass
class Lane:
    """One resource serving transfers in order: ``rate`` bytes (or units) a second."""

    clock: SimClock
    rate: float
    name: str = ""
    """The resource, as the timeline names its row."""
    free_at: float = 0.0
    busy_s: float = 0.0
    moved: float = 0.0
    _reserved: list[tuple[float, float]] = field(default_factory=list, repr=False)
    """Spans ``reserve`` placed ahead of ``free_at``, sorted: transfers go around them."""
    shares: "Lane | None" = field(default=None, repr=False)
    """Another row of the same resource (``share``): work on either starts after what was
    scheduled on both."""

    def share(self, other: "Lane") -> None:
        """This lane and ``other`` are one resource shown as two rows: the CPU Adam and the
        gradient adds both take every core and the host's memory bandwidth, and the native
        pool runs one job at a time."""
        self.shares, other.shares = other, self

    def schedule(self, amount: float, not_before: float | None = None, what: str = "") -> float:
        """When ``amount`` submitted now (or at ``not_before``) is through: after everything
        scheduled before it (on a shared lane too), in the first gap left by reserved spans."""
        seconds = self._seconds(amount)
        free = self.free_at if self.shares is None else max(self.free_at, self.shares.free_at)
        start = self._gap(max(self.clock.now if not_before is None else not_before, free),
                          seconds)
        self.free_at = start + seconds
        if self.shares is not None:
            self.shares.free_at = max(self.shares.free_at, self.free_at)
        self._reserved = [span for span in self._reserved if span[1] > self.free_at]
        return self._take(start, seconds, amount, what)

    def reserve(self, amount: float, at: float, what: str = "") -> float:
        """When ``amount`` submitted at the future time ``at`` by another thread is through:
        after what was scheduled until now, without delaying what the clock's thread schedules
        before ``at`` where it fits before it (a stream serves transfers in the order they are
        issued, and this one is issued later). Its end."""
        seconds = self._seconds(amount)
        start = self._gap(max(at, self.free_at), seconds)
        self._reserved.append((start, start + seconds))
        self._reserved.sort()
        return self._take(start, seconds, amount, what)

    def _seconds(self, amount: float) -> float:
        return amount / self.rate if self.rate > 0 and amount else 0.0

    def _gap(self, start: float, seconds: float) -> float:
        """The first start at or after ``start`` where ``seconds`` fit between reserved spans."""
        for lo, hi in self._reserved:
            if start + seconds <= lo:
                break
            start = max(start, hi)
        return start

    def _take(self, start: float, seconds: float, amount: float, what: str) -> float:
        self.busy_s += seconds
        self.moved += amount
        self.clock.record(self.name, start, start + seconds, what)
        return start + seconds
