"""Seeing background optimizer steps through: their errors, the units they hold, the norms.

Why apart: both schedules submit each unit's step to the step stream (optim/step_stream.py)
and go on; these methods are the other end, where the engine learns that steps are over
(their writes landed, so their units may be released), collects the gradient norms their
kernels summed, and meets a step's failure. They are careful about one thing: a wait that is
interrupted (Ctrl-C) is not a failed step, and leaves every job pending and every finished unit
to be handed out by the next call.

A mixin of ``PartitionedOptimizer``, which owns ``_pending_steps`` ((state, job) in submission
order), ``_waiting``, ``_stream``, ``_sq_norm``, ``timers``, ``step_failure`` and
``_unclaimed``.
"""
from __future__ import annotations

import time

from infinity.base.log import get_logger
from infinity.optim.step_stream import StepJob
from infinity.zero.protocols import Wait
from infinity.zero.unit import Unit

log = get_logger("optim")


class StepReaping:
    """Completion of background steps (see the module docstring)."""

    def reap(self, wait: Wait = Wait.NONE) -> list[Unit]:
        """Units whose background steps have all finished, in order (see ``Wait``), and those
        finished by earlier calls that did not hand them out (an interrupted wait, a step or
        roll-back that reaped inside). Re-raises a background step's error here."""
        finished, self._unclaimed = self._unclaimed, []
        while self._pending_steps and (wait is Wait.ALL or (wait is Wait.ONE and not finished)
                                       or self._pending_steps[0][1].future.done()):
            state, job = self._pending_steps[0]
            start = time.perf_counter()
            try:
                job.future.result()
            except Exception as exc:
                self._pending_steps.pop(0)
                if self.step_failure is None:
                    self.step_failure = exc   # the states may be half-written from here on
                self._give_back_gradient(job)
                if not any(s is state for s, _ in self._pending_steps):
                    finished.append(state.unit)   # its writes are over too
                self._unclaimed = finished       # handed out by the next call (close)
                raise
            except BaseException:
                # the wait was interrupted (Ctrl-C), not the job: it stays pending, and the
                # units already finished are handed out by the next call
                self._unclaimed = finished
                raise
            finally:
                self.timers.optimizer_s += time.perf_counter() - start
            self._pending_steps.pop(0)
            self._collect_norm(job)
            self._give_back_gradient(job)
            if not any(s is state for s, _ in self._pending_steps):
                finished.append(state.unit)   # else a newer step of the unit still holds it
        return finished

    def _give_back_gradient(self, job: StepJob) -> None:
        # the job's gradient goes back (the stream did so unless the job failed before it was
        # handed over); the state's belongs to the backward in progress, which may already
        # collect the unit's next gradient
        if job.gradient is not None:
            self.release_gradient(job.gradient)

    def wait_stepped(self, unit: Unit | None = None) -> None:
        """Wait until the kernels of ``unit``'s steps in flight (None: every unit's) have run
        (its device copy holds the new parameters): a forward after a backward that raised, or
        after a ``step()`` that was interrupted, must not read a copy being stepped. A failed
        step is raised through ``reap``, which records it and sees the other steps through
        first."""
        for state, job in list(self._pending_steps):
            if (unit is None or state.unit is unit) and not job.stepped.done():
                try:
                    job.stepped.result()
                except Exception:  # noqa: BLE001 - raised by reap, which also drops the rest
                    self._unclaimed.extend(self.reap(Wait.ALL))
                    raise

    def drain(self) -> list[Unit]:
        """Wait for every background step (at close): errors were raised at ``reap`` already,
        so here they are only logged, and every unit comes back for release."""
        self.cancel_expected()
        for job in self._waiting.values():   # closing: nothing can read their results
            self._stream.cancel(job)
        self._waiting.clear()
        units = []
        while self._pending_steps or self._unclaimed:
            try:
                units.extend(self.reap(Wait.ALL))
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.warning("a background step failed: %s", exc)
        return units

    def _collect_norm(self, job: StepJob) -> None:
        """Add the squares the stream summed for ``job``'s gradient to the step's norm, once
        (its kernels have run)."""
        if not job.norm_collected:
            self._sq_norm += job.sq_norm
            job.norm_collected = True
