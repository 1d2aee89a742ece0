"""The pending background steps (optim/pending_steps.py) at unit level, with real StepJobs and
no step stream. A job's futures complete when the test
moves it through its phases; a job whose wait must block lands (or fails, or is interrupted)
from inside that wait, in the waiting thread, so nothing depends on timing."""
from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future

import pytest
import torch
from torch import nn

from infinity.optim.held_room import HeldRoom
from infinity.optim.pending_steps import PendingSteps
from infinity.optim.records import (
    CompleteGradient, JobPhase, OptimTimers, StepJob, UnitOptimState)
from infinity.zero.protocols import Wait
from infinity.zero.unit import Unit


class _OnWait(Future):
    """A future that, waited for before it is done, first runs ``on_wait`` (which completes it,
    or raises as an interrupted or failed wait would)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_wait = None
        self.waits = 0

    def result(self, timeout=None):
        if not self.done():
            self.waits += 1
            self.on_wait()
        return super().result(timeout)


def _state(index: int) -> UnitOptimState:
    unit = Unit(index, f"u{index}", nn.Module(), [("w", nn.Parameter(torch.zeros(4)), 0)],
                torch.float32, torch.device("cpu"))
    return UnitOptimState(unit, None, None, None, None)


class _Rig:
    def __init__(self) -> None:
        self.norms: list[float] = []
        self.timers = OptimTimers()
        self.steps = PendingSteps(self.timers, self.norms.append)
        self.room = HeldRoom(1000)
        self.log: list[str] = []

    def job(self, state: UnitOptimState, sq: float = 0.0, held: int = 0) -> StepJob:
        """A submitted job (READY) holding ``held`` bytes of the room through its gradient;
        it lands only when the test says so, or when it is waited for."""
        job = StepJob(state, deque(), left=1, early=True, sq_norm=sq)
        job.stepped_future, job.landed_future = _OnWait(), _OnWait()
        job.landed_future.on_wait = lambda: self.land(job)
        job.stepped_future.on_wait = lambda: self.step(job)
        if held:
            self.room.take(held, lambda: False)
            job.gradient = CompleteGradient({0: torch.zeros(held // 4)}, held_bytes=held,
                                            room=self.room)
        self.steps.add(job)
        return job

    def step(self, job: StepJob) -> None:
        self.log.append(f"stepped {job.state.unit.name}")
        job.stepped()

    def land(self, job: StepJob) -> None:
        if job.phase is JobPhase.READY:
            self.step(job)
        self.log.append(f"landed {job.state.unit.name}")
        job.landed()


def test_running_and_holds_follow_the_jobs_phases() -> None:
    """``running``: some job has not landed; ``holds``: a job of that state is pending
    (``stepping_only``: one whose kernels have not run)."""
    rig, a, b = _Rig(), _state(0), _state(1)
    assert not rig.steps.running() and not rig.steps.holds(a)
    job = rig.job(a)
    assert rig.steps.running()
    assert rig.steps.holds(a) and rig.steps.holds(a, stepping_only=True)
    assert not rig.steps.holds(b) and not rig.steps.holds(b, stepping_only=True)
    rig.step(job)
    assert rig.steps.running()
    assert rig.steps.holds(a) and not rig.steps.holds(a, stepping_only=True)
    rig.land(job)
    assert not rig.steps.running() and rig.steps.holds(a)
    assert rig.steps.reap() == [a.unit]
    assert not rig.steps.holds(a) and rig.steps.jobs == []


def test_reap_without_waiting_takes_the_landed_jobs_at_the_front_in_order() -> None:
    """Wait.NONE: the landed jobs up to the first that has not landed (a later landed one
    waits its turn); each reaped job's norm counted once, its gradient's bytes given back, its
    phase REAPED, and the time spent added to the optimizer's."""
    rig, a, b, c = _Rig(), _state(0), _state(1), _state(2)
    ja, jb, jc = rig.job(a, 1.5, held=40), rig.job(b, 2.5, held=8), rig.job(c, 4.0)
    rig.timers.optimizer_s = 5.0
    rig.land(ja)
    rig.land(jc)
    assert rig.steps.reap(Wait.NONE) == [a.unit]
    assert rig.norms == [1.5] and ja.sq_norm == 0.0
    assert ja.phase is JobPhase.REAPED and jc.phase is JobPhase.LANDED
    assert rig.room.held == 8 and ja.gradient.held_bytes == 0
    assert rig.steps.jobs == [jb, jc] and rig.timers.optimizer_s >= 5.0
    assert rig.steps.reap() == []                          # jb has not landed: nothing
    assert jb.landed_future.waits == 0
    rig.land(jb)
    assert rig.steps.reap() == [b.unit, c.unit]
    assert rig.norms == [1.5, 2.5, 4.0] and rig.room.held == 0 and rig.steps.jobs == []


def test_a_unit_is_handed_out_after_its_last_job() -> None:
    """Two steps of one unit pending: the first one reaped does not hand the unit out (the
    newer step still holds it)."""
    rig, a = _Rig(), _state(0)
    first, second = rig.job(a, 1.0), rig.job(a, 2.0)
    rig.land(first)
    assert rig.steps.reap() == []
    assert first.phase is JobPhase.REAPED and rig.steps.jobs == [second]
    rig.land(second)
    assert rig.steps.reap() == [a.unit] and rig.norms == [1.0, 2.0]


def test_wait_one_waits_until_a_unit_comes_back_and_wait_all_for_every_job() -> None:
    """Wait.ONE: jobs are waited for in order until one unit is finished (two jobs of the
    first unit, then stop); Wait.ALL: every job."""
    rig, a, b, c = _Rig(), _state(0), _state(1), _state(2)
    rig.job(a), rig.job(a), rig.job(b), rig.job(c)
    assert rig.steps.reap(Wait.ONE) == [a.unit]
    assert rig.log == ["stepped u0", "landed u0", "stepped u0", "landed u0"]
    assert len(rig.steps.jobs) == 2
    assert rig.steps.reap(Wait.ALL) == [b.unit, c.unit]
    assert rig.steps.jobs == [] and not rig.steps.running()
    assert rig.steps.reap(Wait.ALL) == [] and rig.steps.reap(Wait.ONE) == []


def test_wait_one_with_a_unit_already_finished_does_not_wait() -> None:
    """A unit left unclaimed by an earlier call counts as the one: Wait.ONE does not wait."""
    rig, a, b = _Rig(), _state(0), _state(1)
    rig.land(rig.job(a))
    assert rig.steps.reap(hand_out=False) == []
    jb = rig.job(b)
    assert rig.steps.reap(Wait.ONE) == [a.unit]
    assert jb.landed_future.waits == 0 and rig.steps.jobs == [jb]


def test_units_kept_by_hand_out_false_come_with_the_next_call() -> None:
    """``hand_out=False``: the jobs are reaped (norms, phases) but their units stay, in order,
    for the next call, which hands them out before its own."""
    rig, a, b, c = _Rig(), _state(0), _state(1), _state(2)
    ja, jb = rig.job(a, 1.0), rig.job(b, 2.0)
    assert rig.steps.reap(Wait.ALL, hand_out=False) == []
    assert rig.steps.unclaimed == [a.unit, b.unit] and rig.norms == [1.0, 2.0]
    assert ja.phase is JobPhase.REAPED and jb.phase is JobPhase.REAPED
    rig.land(rig.job(c))
    assert rig.steps.reap() == [a.unit, b.unit, c.unit]
    assert rig.steps.unclaimed == []


def test_a_failed_step_is_raised_once_and_recorded_its_unit_handed_out_next() -> None:
    """A job's failure: raised by reap, kept as ``failure`` (the first one only), the job
    dropped and its gradient's bytes given back; the units finished before it and its own unit
    (no newer job holds it) come with the next call; jobs behind it stay pending."""
    rig, a, b, c = _Rig(), _state(0), _state(1), _state(2)
    ja, jb, jc = rig.job(a, 1.0), rig.job(b, 2.0, held=12), rig.job(c, 3.0)
    rig.land(ja)
    jb.fail(OSError("disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        rig.steps.reap(Wait.NONE)
    assert rig.steps.failure is jb.error
    assert rig.steps.jobs == [jc] and rig.room.held == 0
    assert rig.steps.unclaimed == [a.unit, b.unit] and rig.norms == [1.0]
    jc.fail(ValueError("second"))
    with pytest.raises(ValueError, match="second"):
        rig.steps.reap(Wait.NONE)
    assert isinstance(rig.steps.failure, OSError)          # the first failure stays
    assert rig.steps.reap() == [a.unit, b.unit, c.unit]


def test_a_failed_job_whose_unit_has_a_newer_job_does_not_hand_it_out() -> None:
    rig, a = _Rig(), _state(0)
    first, second = rig.job(a), rig.job(a)
    first.fail(RuntimeError("kernel"))
    with pytest.raises(RuntimeError):
        rig.steps.reap()
    assert rig.steps.unclaimed == [] and rig.steps.jobs == [second]


def test_an_interrupted_wait_leaves_the_job_pending_and_the_finished_units_unclaimed() -> None:
    """Ctrl-C while waiting is not a failed step: the job stays pending, no failure is
    recorded, and the units already finished are handed out by the next call."""
    rig, a, b = _Rig(), _state(0), _state(1)
    rig.land(rig.job(a, 1.0))
    jb = rig.job(b, 2.0, held=16)

    def interrupt() -> None:
        raise KeyboardInterrupt

    jb.landed_future.on_wait = interrupt
    with pytest.raises(KeyboardInterrupt):
        rig.steps.reap(Wait.ALL)
    assert rig.steps.failure is None and rig.steps.jobs == [jb]
    assert rig.steps.unclaimed == [a.unit] and rig.room.held == 16
    jb.landed_future.on_wait = lambda: rig.land(jb)
    assert rig.steps.reap(Wait.ALL) == [a.unit, b.unit]
    assert rig.norms == [1.0, 2.0] and rig.room.held == 0


def test_wait_stepped_waits_for_the_kernels_of_one_unit_or_all() -> None:
    """``wait_stepped(unit)``: that unit's jobs' kernels, not the others', and nothing lands
    or is reaped; ``wait_stepped()``: every job's."""
    rig, a, b = _Rig(), _state(0), _state(1)
    ja1, jb, ja2 = rig.job(a), rig.job(b), rig.job(a)
    rig.steps.wait_stepped(a.unit)
    assert rig.log == ["stepped u0", "stepped u0"]
    assert ja1.phase is ja2.phase is JobPhase.STEPPED and jb.phase is JobPhase.READY
    assert len(rig.steps.jobs) == 3
    rig.steps.wait_stepped(a.unit)                          # already stepped: no wait
    assert ja1.stepped_future.waits == 1
    rig.steps.wait_stepped()
    assert jb.phase is JobPhase.STEPPED and len(rig.steps.jobs) == 3


def test_a_failed_kernel_seen_by_wait_stepped_is_raised_after_every_job_is_seen_through() -> None:
    """A job's kernel failed while ``wait_stepped`` waits: every pending job is reaped (the
    failure recorded, the other jobs seen through), nothing is handed out there, and the error
    is raised; the units come back with the next reap."""
    rig, a, b = _Rig(), _state(0), _state(1)
    ja, jb = rig.job(a, 1.0), rig.job(b, 2.0)
    ja.stepped_future.on_wait = lambda: ja.fail(RuntimeError("kernel failed"))
    with pytest.raises(RuntimeError, match="kernel failed"):
        rig.steps.wait_stepped(a.unit)
    assert rig.steps.failure is ja.error
    assert rig.steps.unclaimed == [a.unit] and rig.steps.jobs == [jb]
    rig.land(jb)
    assert rig.steps.reap() == [a.unit, b.unit]


def test_a_failed_kernel_behind_another_units_job_is_recorded_after_it() -> None:
    """The failed job behind a job of another unit that has not landed: ``wait_stepped``
    waits for that job first (its writes land, its unit comes back with the next reap), then
    the failure is recorded and raised; nothing stays pending."""
    rig, a, b = _Rig(), _state(0), _state(1)
    jb, ja = rig.job(b, 2.0), rig.job(a, 1.0)
    ja.stepped_future.on_wait = lambda: ja.fail(RuntimeError("kernel failed"))
    with pytest.raises(RuntimeError, match="kernel failed"):
        rig.steps.wait_stepped(a.unit)
    assert jb.phase is JobPhase.REAPED and rig.norms == [2.0]
    assert rig.steps.failure is ja.error and rig.steps.jobs == []
    assert rig.steps.reap() == [b.unit, a.unit]


def test_the_optimizer_time_counts_only_the_wait() -> None:
    """``optimizer_s`` grows by the seconds reap spent on the jobs, no more than the wall time
    of the call."""
    rig, a = _Rig(), _state(0)
    rig.job(a)
    rig.timers.optimizer_s = 5.0
    t0 = time.perf_counter()
    rig.steps.reap(Wait.ALL)
    wall = time.perf_counter() - t0
    assert 5.0 <= rig.timers.optimizer_s <= 5.0 + wall


def test_drain_sees_every_job_through_and_logs_failures(infinity_log) -> None:
    """At close: every job waited for, a failure only logged (with its error), and every unit
    handed back, the unclaimed ones too."""
    rig, a, b, c, d = _Rig(), _state(0), _state(1), _state(2), _state(3)
    rig.land(rig.job(a))
    assert rig.steps.reap(hand_out=False) == []
    jb = rig.job(b)
    rig.job(c)
    jd = rig.job(d)
    jb.fail(OSError("bad sector"))
    jd.fail(OSError("second"))
    with infinity_log.at_level(logging.WARNING, logger="infinity"):
        units = rig.steps.drain()
    assert units == [a.unit, b.unit, c.unit, d.unit]
    assert rig.steps.jobs == [] and rig.steps.unclaimed == []
    warnings = [r.getMessage() for r in infinity_log.records if r.levelno == logging.WARNING]
    assert warnings == ["a background step failed: bad sector",
                        "a background step failed: second"]
    assert rig.steps.drain() == []


def test_collect_norm_adds_a_jobs_squares_once() -> None:
    rig, a = _Rig(), _state(0)
    job = StepJob(a, deque(), left=0, early=False, sq_norm=3.0)
    rig.steps.collect_norm(job)
    rig.steps.collect_norm(job)
    assert rig.norms == [3.0, 0.0]
