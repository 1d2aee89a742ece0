"""The background steps submitted and not yet reaped: where the engine learns that steps are over.

Why apart: both schedules submit each unit's step to the step stream (optim/step_stream.py)
and go on; this is the other end, where the steps' kernels are waited for (``wait_stepped``),
their writes seen landed so their units may be released (``reap``), the gradient norms their
kernels summed collected, and a step's failure met (see [Note: the life of a step job] in
optim/records.py). It is careful about one thing: a wait that is interrupted (Ctrl-C) is not a
failed step, and leaves every job pending and every finished unit to be handed out by the next
call.
"""
from __future__ import annotations

import time
from typing import Callable

from infinity.base.log import get_logger
from infinity.optim.records import OptimTimers, StepJob, UnitOptimState
from infinity.zero.protocols import SteppedUnit, Wait

log = get_logger("optim")


class PendingSteps:
    """Jobs in submission order; ``add_norm`` takes the squares their kernels summed."""

    def __init__(self, timers: OptimTimers, add_norm: Callable[[float], None]) -> None:
        self.jobs: list[StepJob] = []
        self.timers = timers
        self._add_norm = add_norm
        # units whose steps are over, not yet handed out (reaped by a call that kept them, or
        # by a wait that was interrupted)
        self._unclaimed: list[SteppedUnit] = []
        self.failure: BaseException | None = None   # the first background step that failed

    def add(self, job: StepJob) -> None:
        self.jobs.append(job)

    def running(self) -> bool:
        """Some job has not landed yet (it will give room, slots or the device back)."""
        return any(not job.landed_future.done() for job in self.jobs)

    def holds(self, state: UnitOptimState, stepping_only: bool = False) -> bool:
        """A job of the unit is pending (``stepping_only``: one whose kernels have not run)."""
        return any(job.state is state and not (stepping_only and job.stepped_future.done())
                   for job in self.jobs)

    @property
    def unclaimed(self) -> list[SteppedUnit]:
        return self._unclaimed

    def reap(self, wait: Wait = Wait.NONE, hand_out: bool = True) -> list[SteppedUnit]:
        """Units whose background steps have all finished, in order (see ``Wait``), and those
        finished by earlier calls that did not hand them out; with ``hand_out`` False they stay
        for the next call (a step or roll-back that must see its jobs through, whose caller
        releases nothing). Re-raises a background step's error here."""
        finished, self._unclaimed = self._unclaimed, []
        try:
            while self.jobs and (wait is Wait.ALL or (wait is Wait.ONE and not finished)
                                 or self.jobs[0].landed_future.done()):
                job = self.jobs[0]
                start = time.perf_counter()
                try:
                    job.landed_future.result()
                except Exception as exc:
                    self.jobs.pop(0)
                    if self.failure is None:
                        self.failure = exc   # the states may be half-written from here on
                    _give_back_gradient(job)
                    if not self.holds(job.state):
                        finished.append(job.state.unit)   # its writes are over too
                    raise
                finally:
                    self.timers.optimizer_s += time.perf_counter() - start
                self.jobs.pop(0)
                self.collect_norm(job)
                _give_back_gradient(job)
                job.reaped()
                if not self.holds(job.state):
                    finished.append(job.state.unit)   # else a newer step of the unit holds it
        except BaseException:
            # a failure, or the wait was interrupted (Ctrl-C), not the job: it stays pending,
            # and the units already finished are handed out by the next call
            self._unclaimed = finished
            raise
        if hand_out:
            return finished
        self._unclaimed = finished
        return []

    def wait_stepped(self, unit: SteppedUnit | None = None) -> None:
        """Wait until the kernels of ``unit``'s jobs (None: every job's) have run: its device
        copy holds the new parameters. A failed job is raised through ``reap``, which records
        it and sees the other jobs through first."""
        for job in list(self.jobs):
            if (unit is None or job.state.unit is unit) and not job.stepped_future.done():
                try:
                    job.stepped_future.result()
                except Exception:  # noqa: BLE001 - raised by reap, which also drops the rest
                    self.reap(Wait.ALL, hand_out=False)
                    raise

    def drain(self) -> list[SteppedUnit]:
        """Wait for every job (at close): errors were raised at ``reap`` already, so here they
        are only logged, and every unit comes back for release."""
        units = []
        while self.jobs or self._unclaimed:
            try:
                units.extend(self.reap(Wait.ALL))
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.warning("a background step failed: %s", exc)
        return units

    def collect_norm(self, job: StepJob) -> None:
        """Add the squares the stream summed for ``job``'s gradient to the step's norm, once
        (its kernels have run)."""
        self._add_norm(job.take_sq_norm())


def _give_back_gradient(job: StepJob) -> None:
    # the job's gradient goes back (the stream did so unless the job failed before it was
    # handed over); the state's belongs to the backward in progress, which may already
    # collect the unit's next gradient
    if job.gradient is not None:
        job.gradient.give_back()
