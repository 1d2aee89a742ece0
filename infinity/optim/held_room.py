"""The room held gradients may take, in bytes (see [Note: held gradients] in optim/gradients.py).

[Note: room in bytes, freed as the step goes]
Held gradients used to be counted in whole units: two tickets, one taken at a unit's first
gradient and given back when its step had run. Peak memory then depended on how far the step
stream fell behind the backward: at 0.49B it kept up and one unit's gradient was held at a time,
at 1.04B (where the disk is as busy as the cores) two were held more often, and the peak rose by
a Llama layer's gradient (~200 MB) with the model's depth. Counting bytes, each part as autograd
hands it over, and giving bytes back as the step frees the parts it has stepped, lets the
backward go on as soon as the step ahead of it has made room, without holding more than the
room at any depth.

A part that does not fit waits only while some background step is still running (it will give
room back); otherwise it is taken anyway (a unit larger than the room, or gradients held for a
tied weight's last use), so the backward never waits on itself. A unit's first part is taken
without waiting: with a room of one unit, the next unit's first gradient always arrives while
the step ahead holds the whole room, so every unit waited for that step's first kernels even
where the stream keeps up; taken freely, the step was 3-6% faster at 0.49B and 1.04B (the
out-of-core bench, interleaved rounds). So the room holds at most its capacity and one part
(the host budget keeps two units' worth).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

WAIT_LIMIT_S = 600.0   # a background step that frees nothing for this long is stuck
_POLL_S = 0.05         # re-check whether any step is still running (one that failed frees nothing)


class HeldRoom:
    """Bytes of held gradients, against a capacity; thread-safe (the training thread takes,
    the step stream gives back)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"held-gradient room must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.held = 0
        self.peak = 0       # most bytes held at once (tests, reports)
        self._changed = threading.Condition()

    def take(self, nbytes: int, steps_running: Callable[[], bool]) -> float:
        """Count ``nbytes`` more, first waiting while they do not fit and ``steps_running()``
        says a background step may still give room back; returns the seconds waited."""
        waited = 0.0
        with self._changed:
            if self.held + nbytes > self.capacity and steps_running():
                start = time.perf_counter()
                while self.held + nbytes > self.capacity and steps_running():
                    if time.perf_counter() - start > WAIT_LIMIT_S:
                        raise RuntimeError(
                            f"held gradients took {self.held} bytes of a {self.capacity}-byte room "
                            f"and no background step gave any back for {WAIT_LIMIT_S:.0f} s: "
                            "the step stream is stuck (see the log for its error)")
                    self._changed.wait(_POLL_S)
                waited = time.perf_counter() - start
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        return waited

    def give(self, nbytes: int) -> None:
        """Give ``nbytes`` back (parts freed, a step done, gradients dropped)."""
        if nbytes <= 0:
            return
        with self._changed:
            if nbytes > self.held:
                raise RuntimeError(f"giving back {nbytes} held-gradient bytes, only {self.held} "
                                   "are held: a gradient was given back twice")
            self.held -= nbytes
            self._changed.notify_all()
