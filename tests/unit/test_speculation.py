"""The speculative step (optim/speculation.py) at unit level: a real gradient collector, Adam
kernel (hyperparameters and step counts), pending steps and step jobs, with doubled flat
stores on a pretend disk (fakes.py) and a submit that plays the step stream. The rebuilt
gradient is checked bit for bit against the float64 formula of [Note: the gradient of a
speculated step] and against the gradient it came from."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import pytest
import torch
from fakes import MemoryStore, WaitingManager
from torch import nn

from infinity.optim.gradients import GradientCollector
from infinity.optim.held_room import HeldRoom
from infinity.optim.kernel import AdamKernel
from infinity.optim.pending_steps import PendingSteps
from infinity.optim.records import JobPhase, OptimTimers, StepJob, UnitOptimState
from infinity.optim.speculation import (
    BLOCK_NUMEL,
    SPECULATION_MODES,
    VOIDED,
    Speculator,
    _gradient_term,
    _l2,
    _pieces,
)
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import FlatStore
from infinity.storage.tiers import Tier
from infinity.zero.unit import Unit

F32 = torch.float32
SMALL = (((3, 5), 0), ((7,), 1))            # p0 [0, 15) group 0, p1 [16, 23) group 1
LARGE = (((2500,), 0), ((1000,), 1))        # p0 [0, 2500) group 0, p1 [2512, 3512) group 1


def _unit(index: int, params=SMALL) -> Unit:
    named = [(f"p{i}", nn.Parameter(torch.zeros(shape)), group)
             for i, (shape, group) in enumerate(params)]
    return Unit(index, f"u{index}", nn.Module(), named, F32, torch.device("cpu"))


class _Interrupted(Future):
    """A future whose wait is interrupted (Ctrl-C) until ``interrupt`` is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupt = True

    def result(self, timeout=None):
        if self.interrupt:
            raise KeyboardInterrupt
        return None


class _Rig:
    """A speculator over units of ``params`` as the optimizer builds it: every store doubled
    on the pretend disk, the gradient home ``home`` ("disk" or "host"), held gradients, a
    gradient pool of one slot of ``slot_bytes`` (None: no pool). ``submit`` queues a job as the
    step stream would and, with ``run_now``, runs it (counts the step, stepped, landed)."""

    def __init__(self, mode: str = "on", *, units=(SMALL,), home: str = "disk",
                 master: bool = True, slot_bytes: int | None = 4 * 4096,
                 l2_group: int | None = None) -> None:
        self.groups = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
                       dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.0)]
        if l2_group is not None:
            self.groups[l2_group].update(adamw_mode=False, weight_decay=0.1)
        self.kernel = AdamKernel(lambda: self.groups, adamw_mode=True, threads=1)
        self.manager = WaitingManager()
        self.timers = OptimTimers()
        self.norms: list[float] = []
        self.steps = PendingSteps(self.timers, self.norms.append)
        self.states = []
        for index, params in enumerate(units):
            unit = _unit(index, params)
            n = unit.trainable_numel
            unit.param_store = MemoryStore(n, doubled=True, name=f"{unit.name}.param")
            grad_store = (MemoryStore(n, name=f"{unit.name}.grad") if home == "disk"
                          else FlatStore(WaitingManager(), f"{unit.name}.grad", n, F32, Tier.HOST))
            self.states.append(UnitOptimState(
                unit, MemoryStore(n, doubled=True, name="exp_avg"),
                MemoryStore(n, doubled=True, name="exp_avg_sq"),
                MemoryStore(n, doubled=True, name="master") if master else None, grad_store))
        self.pool = (BufferPool(self.manager, slot_bytes, 1, "gradient")
                     if slot_bytes is not None else None)
        self.gradients = GradientCollector(
            self.states, self.manager, early_step=False, holds_grads=True, grad_pool=self.pool,
            held_room=HeldRoom(1 << 30), timers=self.timers,
            max_trainable=max(s.unit.trainable_numel for s in self.states),
            steps_running=self.steps.running,
            speculates=lambda state: self.spec.can_speculate(state))
        self.spec = Speculator(mode, self.manager, self.gradients, self.kernel, self.steps,
                               self.pool)
        self.submitted: list[dict] = []
        self.run_now = True

    def submit(self, state, gradient, params, **settings) -> StepJob:
        self.submitted.append(settings)
        job = StepJob(state, deque(), left=1, early=True, hyper=self.kernel.hyperparameters(),
                      gradient=gradient, params=params, **settings)
        self.steps.add(job)
        if self.run_now:
            self.run(job)
        return job

    def run(self, job: StepJob, sq: float = 0.0) -> None:
        job.runs = self.kernel.step_runs(job.state, job.params)
        job.sq_norm = sq
        job.stepped()
        job.landed()

    def backward(self, *states: UnitOptimState, clip: float = 0.0, scale: float = 1.0,
                 grads=None) -> list[StepJob]:
        """A boundary backward that speculates every unit of ``states`` (each parameter gets
        ``grads``' gradient, by index, else ones)."""
        self.spec.begin_backward(True)
        self.gradients.begin_backward(True)
        jobs = []
        for state in states:
            for i, entry in enumerate(state.unit.trainable_entries()):
                g = torch.ones(entry.shape) if grads is None else grads[i]
                self.gradients.on_grad(state.unit, entry, g)
            assert self.spec.can_speculate(state)
            jobs.append(self.spec.speculate(state, clip, scale, self.submit))
        return jobs


def _stores(state: UnitOptimState) -> list[MemoryStore]:
    return [state.unit.param_store, state.exp_avg, state.exp_avg_sq, state.master]


# -- deciding --------------------------------------------------------------------------------
def test_an_unknown_mode_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError) as info:
        _Rig("maybe")
    assert str(info.value) == ("speculative step mode 'maybe': expected one of "
                               "('off', 'auto', 'on')")
    assert SPECULATION_MODES == ("off", "auto", "on")


def test_a_new_speculator_has_nothing_pending_and_pays() -> None:
    spec = _Rig("auto").spec
    assert spec.mode == "auto" and spec.pays is True and spec.speculating is False
    assert spec.jobs == [] and not spec.pending and spec.rolled_back == []
    assert spec.stats == {"committed": 0, "rolled_back": 0, "voided": 0}


def test_plans_follows_the_mode_and_in_auto_whether_it_paid() -> None:
    for mode, pays, want in [("off", True, False), ("on", False, True), ("on", True, True),
                             ("auto", True, True), ("auto", False, False)]:
        spec = _Rig(mode).spec
        spec.pays = pays
        assert spec.plans() is want, (mode, pays)


def test_a_backward_speculates_at_the_boundary_when_planned_and_nothing_is_pending() -> None:
    rig = _Rig("auto")
    spec = rig.spec
    spec.begin_backward(False)
    assert spec.speculating is False
    spec.begin_backward(True)
    assert spec.speculating is True
    spec.pays = False
    spec.begin_backward(True)
    assert spec.speculating is False
    spec.pays = True
    rig.backward(rig.states[0])
    spec.begin_backward(True)        # a voided speculation is still pending: no second one
    assert spec.speculating is False


def test_a_unit_speculates_only_when_every_store_it_writes_is_doubled() -> None:
    rig = _Rig(units=(SMALL, SMALL))
    spec, (a, b) = rig.spec, rig.states
    assert not spec.can_speculate(a)             # not speculating yet
    spec.begin_backward(True)
    assert spec.can_speculate(a)
    for attr in ("exp_avg", "exp_avg_sq", "master"):
        kept = getattr(a, attr)
        setattr(a, attr, MemoryStore(a.unit.trainable_numel))
        assert not spec.can_speculate(a), attr
        setattr(a, attr, kept)
    a.master = None                      # the parameter is the master: nothing to double
    assert spec.can_speculate(a)
    kept = a.unit.param_store
    a.unit.param_store = MemoryStore(a.unit.trainable_numel)
    assert not spec.can_speculate(a)
    a.unit.param_store = None            # persistent: no param store
    assert not spec.can_speculate(a)
    a.unit.param_store = kept
    rig.gradients.on_grad(a.unit, a.unit.trainable_entries()[0], torch.ones(3, 5))
    spec.speculate(a, 0.0, 1.0, rig.submit)
    assert not spec.can_speculate(a) and spec.can_speculate(b)      # one job per unit
    assert spec.pending


# -- running ---------------------------------------------------------------------------------
def test_speculating_held_gradients_hands_them_to_a_shadow_step() -> None:
    rig = _Rig()
    rig.run_now = False
    state = rig.states[0]
    rig.spec.begin_backward(True)
    rig.gradients.begin_backward(True)
    g0 = torch.randn(3, 5)
    rig.gradients.on_grad(state.unit, state.unit.trainable_entries()[0], g0)
    parts = state.grad.parts
    assert parts is not None
    job = rig.spec.speculate(state, 0.0, 8.0, rig.submit)
    assert rig.spec.jobs == [job]
    assert rig.submitted == [dict(speculative=True, grad_scale=8.0, gradient_home=False)]
    assert job.gradient.values is parts and job.params == frozenset({0})
    assert state.grad.parts is None and state.arrived == set()
    assert state.has_grads and state.norm_counted      # its norm joins at step()
    assert rig.gradients.sq_norm == 0.0                # normed by the stream, not here


def test_speculating_a_flat_buffer_norms_it_here() -> None:
    rig = _Rig(units=(SMALL, SMALL))
    a, b = rig.states
    b.keep_gradient()                       # accumulated: collected in a buffer
    rig.spec.begin_backward(True)
    rig.gradients.begin_backward(True)
    g1 = torch.randn(7)
    rig.gradients.on_grad(b.unit, b.unit.trainable_entries()[1], g1)
    assert b.grad.parts is None and b.grad.buffer is not None
    job = rig.spec.speculate(b, 0.0, 1.0, rig.submit)
    want = torch.zeros(1024)
    want[16:23] = g1
    assert torch.equal(job.gradient.values, want)          # gaps zeroed, home added (zeros)
    assert rig.gradients.sq_norm == pytest.approx(float((g1.double() ** 2).sum()), rel=1e-12)
    assert b.norm_counted and b.has_grads and job.params == frozenset({16})
    assert rig.submitted[-1]["gradient_home"] is False
    assert job.gradient.slot is not None and rig.pool.available == 0   # the step holds it
    rig.gradients.land_writes()
    assert float(b.grad_store.data.abs().sum()) == 0.0     # not sent home


def test_the_gradient_goes_home_with_clipping_or_an_l2_group_else_not() -> None:
    rig = _Rig()
    rig.backward(rig.states[0], clip=1.0)
    assert rig.submitted[-1]["gradient_home"] is True
    for l2_group, home in ((0, True), (1, True), (None, False)):
        rig = _Rig(l2_group=l2_group)
        rig.backward(rig.states[0], clip=0.0)
        assert rig.submitted[-1]["gradient_home"] is home, l2_group
    rig = _Rig(home="host")          # accumulated in its resident home: nothing to send
    b = rig.states[0]
    b.keep_gradient()
    rig.spec.begin_backward(True)
    rig.gradients.on_grad(b.unit, b.unit.trainable_entries()[0], torch.ones(3, 5))
    job = rig.spec.speculate(b, 1.0, 1.0, rig.submit)
    assert rig.submitted[-1]["gradient_home"] is False
    # the step reads the gradient where it accumulated: the home itself
    assert job.gradient.values.data_ptr() == b.grad_store.tensor.data_ptr()
    assert job.gradient.values.numel() == 1024 and job.gradient.origin == 0


def test_l2_is_adam_mode_with_weight_decay() -> None:
    assert _l2({"adamw_mode": False, "weight_decay": 0.1})
    assert not _l2({"adamw_mode": False, "weight_decay": 0.0})
    assert not _l2({"adamw_mode": True, "weight_decay": 0.1})


def test_collect_norms_adds_each_jobs_squares_once() -> None:
    rig = _Rig(units=(SMALL, SMALL))
    rig.run_now = False
    ja, jb = rig.backward(*rig.states)
    rig.run(ja, sq=1.5)
    rig.run(jb, sq=2.0)
    rig.spec.collect_norms()
    rig.spec.collect_norms()
    assert sum(rig.norms) == 3.5 and sorted(n for n in rig.norms if n) == [1.5, 2.0]


# -- keeping ---------------------------------------------------------------------------------
def test_a_kept_speculation_flips_every_store_and_starts_the_next_cycle_clean() -> None:
    rig = _Rig(units=(SMALL, SMALL), home="host")
    a, b = rig.states
    b.master = None
    rig.backward(a, b)
    a.grad_store.tensor.fill_(3.0)
    rig.spec.resolve(keep=True)
    assert [s.flips for s in _stores(a)] == [1, 1, 1, 1]
    assert [s.flips for s in _stores(b)[:3]] == [1, 1, 1]
    for s in (a, b):
        assert not s.has_grads and not s.norm_counted and s.step == 1
    assert float(a.grad_store.tensor.abs().sum()) == 0.0      # accumulates from zero
    assert rig.spec.stats == {"committed": 1, "rolled_back": 0, "voided": 0}
    assert not rig.spec.pending and rig.spec.pays is True
    assert rig.spec.take_rolled_back() == []


def test_resolve_without_speculation_only_records_whether_it_would_have_paid() -> None:
    rig = _Rig("auto")
    rig.spec.resolve(keep=False)
    assert rig.spec.pays is False and rig.spec.stats["rolled_back"] == 0
    rig.spec.resolve(keep=True)
    assert rig.spec.pays is True and rig.spec.stats["committed"] == 0


def test_an_interrupted_wait_before_the_flip_leaves_the_speculation_whole() -> None:
    rig = _Rig()
    [job] = rig.backward(rig.states[0])
    job.stepped_future = _Interrupted()
    with pytest.raises(KeyboardInterrupt):
        rig.spec.resolve(keep=True)
    assert rig.spec.jobs == [job] and [s.flips for s in _stores(rig.states[0])] == [0] * 4
    job.stepped_future.interrupt = False
    rig.spec.resolve(keep=True)
    assert [s.flips for s in _stores(rig.states[0])] == [1] * 4


def test_a_changed_learning_rate_rolls_a_kept_speculation_back() -> None:
    rig = _Rig()
    state = rig.states[0]
    rig.backward(state)
    m, m_new = _speculated_moments(rig, state, torch.ones(1024), 1.0)
    rig.groups[1]["lr"] = 2e-3
    rig.spec.resolve(keep=True)
    assert rig.spec.stats == {"committed": 0, "rolled_back": 1, "voided": 0}
    assert rig.spec.pays is True and [s.flips for s in _stores(state)] == [0] * 4
    assert rig.spec.take_rolled_back() == [state.unit] and state.step == 0
    # the gradient was not home: rebuilt there for the deferred step
    assert torch.equal(state.grad_store.data, _formula(rig, state, m, m_new, 1.0))
    assert torch.allclose(state.grad_store.data[16:23], torch.ones(7), rtol=0, atol=1e-5)


# -- rolling back ----------------------------------------------------------------------------
def test_a_roll_back_gives_the_step_counts_back_and_lists_the_units() -> None:
    rig = _Rig(units=(SMALL, SMALL), home="disk")
    a, b = rig.states
    rig.backward(a, clip=1.0)
    ja = rig.spec.jobs[0]
    assert (a.step, a.param_steps) == (1, {0: 1, 16: 1})
    rig.spec.resolve(keep=False)
    assert rig.spec.stats == {"committed": 0, "rolled_back": 1, "voided": 0}
    assert rig.spec.pays is False and not rig.spec.pending
    assert (a.step, a.param_steps) == (0, {0: 0, 16: 0})
    assert ja.phase is JobPhase.ROLLED_BACK and not ja.counted
    assert a.arrived == {0, 16}           # the deferred step takes them from home
    assert [s.flips for s in _stores(a)] == [0] * 4
    assert rig.spec.take_rolled_back() == [a.unit] and rig.spec.take_rolled_back() == []
    assert float(a.grad_store.data.abs().sum()) == 0.0     # with clipping: the stream's write
    assert rig.steps.jobs == [] and rig.steps.reap() == [a.unit]   # handed out next


def test_a_job_that_stepped_every_parameter_gives_them_all_back() -> None:
    rig = _Rig()
    rig.run_now = False
    state = rig.states[0]
    rig.spec.begin_backward(True)
    rig.gradients.on_grad(state.unit, state.unit.trainable_entries()[1], torch.ones(7))
    job = rig.spec.speculate(state, 1.0, 1.0, rig.submit)
    job.params = None                       # every parameter
    rig.run(job)
    assert state.param_steps == {0: 1, 16: 1}
    rig.spec.roll_back("clipping")
    assert state.param_steps == {0: 0, 16: 0} and state.arrived == {0, 16}


def test_an_overflow_rolls_back_without_rebuilding() -> None:
    rig = _Rig()
    state = rig.states[0]
    rig.backward(state)
    state.exp_avg.shadow.fill_(1.0)
    rig.spec.resolve(keep=False, overflow=True)
    assert rig.spec.stats["rolled_back"] == 1 and rig.spec.take_rolled_back() == [state.unit]
    assert float(state.grad_store.data.abs().sum()) == 0.0
    assert rig.manager.waits == []


def test_void_rolls_back_as_voided_only_what_is_pending() -> None:
    rig = _Rig()
    rig.spec.void()
    assert rig.spec.stats["voided"] == 0 and rig.spec.take_rolled_back() == []
    rig.backward(rig.states[0])
    rig.spec.void()
    assert rig.spec.stats == {"committed": 0, "rolled_back": 0, "voided": 1}
    assert rig.spec.take_rolled_back() == [rig.states[0].unit]
    assert VOIDED == "the model was read before step()"


def test_an_interrupt_while_collecting_norms_leaves_the_speculation_whole() -> None:
    rig = _Rig()
    [job] = rig.backward(rig.states[0])
    job.stepped_future = _Interrupted()
    with pytest.raises(KeyboardInterrupt):
        rig.spec.roll_back("clipping")
    assert rig.spec.jobs == [job] and rig.spec.stats["rolled_back"] == 0
    assert rig.states[0].step == 1
    job.stepped_future.interrupt = False
    rig.spec.roll_back("clipping")
    assert rig.spec.stats["rolled_back"] == 1 and rig.states[0].step == 0


def test_a_failed_step_is_raised_after_the_bookkeeping() -> None:
    """a failed (counted), b landed but not reaped when the failure cut the wait short: both
    counts go back, both units are listed, nothing is rebuilt, the error comes out."""
    rig = _Rig(units=(SMALL, SMALL))
    rig.run_now = False
    a, b = rig.states
    ja, jb = rig.backward(a, b)
    ja.runs = rig.kernel.step_runs(a, ja.params)
    ja.fail(OSError("disk gone"))
    rig.run(jb)
    with pytest.raises(OSError, match="disk gone"):
        rig.spec.roll_back("clipping")
    assert (a.step, b.step) == (0, 0) and a.param_steps == {0: 0, 16: 0}
    assert ja.phase is JobPhase.ROLLED_BACK and jb.phase is JobPhase.LANDED and jb.runs is None
    assert rig.spec.take_rolled_back() == [a.unit, b.unit] and not rig.spec.pending
    assert a.arrived == {0, 16} and b.arrived == {0, 16}
    assert rig.manager.waits == []           # no rebuild
    assert rig.spec.stats["rolled_back"] == 1


def test_a_job_that_failed_before_counting_gives_nothing_back() -> None:
    rig = _Rig()
    rig.run_now = False
    state = rig.states[0]
    [job] = rig.backward(state)
    job.fail(OSError("read failed"))
    with pytest.raises(OSError):
        rig.spec.roll_back("clipping")
    assert state.step == 0 and state.param_steps == {}
    assert job.phase is JobPhase.ROLLED_BACK


# -- rebuilding the gradient -----------------------------------------------------------------
def _speculated_moments(rig: _Rig, state: UnitOptimState, g: torch.Tensor, scale: float,
                        seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """m (current extent) and m' (shadow) as the step wrote them for gradient ``g`` (inside
    the runs; noise elsewhere, which the rebuild must not read)."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(state.unit.trainable_numel, generator=gen)
    m_new = torch.randn(state.unit.trainable_numel, generator=gen)
    for entry in state.unit.trainable_entries():
        beta1 = rig.groups[entry.group_index]["betas"][0]
        sl = slice(entry.offset, entry.offset + entry.numel)
        m_new[sl] = m[sl] * beta1 + (1 - beta1) * (g[sl] / scale)      # float32, as the kernel
    state.exp_avg.data.copy_(m)
    state.exp_avg.shadow.copy_(m_new)
    return m, m_new


def _formula(rig: _Rig, state: UnitOptimState, m: torch.Tensor, m_new: torch.Tensor,
             scale: float) -> torch.Tensor:
    """The note's rebuild, written out: s * (m' - beta1 * m) / (1 - beta1) in float64 with
    beta1 * m and 1 - beta1 rounded to float32, on each run of the job, zero elsewhere."""
    out = torch.zeros(state.unit.trainable_numel, dtype=torch.float64)
    for entry in state.unit.trainable_entries():
        beta1 = rig.groups[entry.group_index]["betas"][0]
        sl = slice(entry.offset, entry.offset + entry.numel)
        one_minus = float(torch.tensor(1 - beta1, dtype=F32))
        out[sl] = (m_new[sl] - m[sl] * beta1).double() / one_minus * scale
    return out.float()


@pytest.mark.parametrize("home", ["disk", "host"])
def test_a_roll_back_rebuilds_the_gradient_home_chunk_by_chunk(home) -> None:
    """4096 elements through a slot of 3 x 1024: four chunks, both runs (groups of beta1 0.9
    and 0.8) cut across them; zero in the gap between the runs and after the last."""
    rig = _Rig(units=(LARGE,), home=home, slot_bytes=4 * (3 * 1024 + 100))
    state = rig.states[0]
    n = state.unit.trainable_numel
    assert n == 4096
    gen = torch.Generator().manual_seed(9)
    g = torch.randn(n, generator=gen) * 3
    g[100:200] = 0.0                      # a row no token used: exactly 0 again
    scale = 4.0
    grads = [g[0:2500], g[2512:3512]]
    rig.backward(state, scale=scale, grads=grads)
    m, m_new = _speculated_moments(rig, state, g, scale)
    rig.spec.resolve(keep=False)
    rebuilt = state.grad_store.data if home == "disk" else state.grad_store.tensor[:n]
    assert torch.equal(rebuilt, _formula(rig, state, m, m_new, scale))
    want = torch.zeros(n)
    want[0:2500], want[2512:3512] = g[0:2500], g[2512:3512]
    assert torch.allclose(rebuilt, want, rtol=0, atol=2e-4)
    assert (rebuilt[100:200] == 0).all() and (rebuilt[2500:2512] == 0).all()
    assert (rebuilt[3512:] == 0).all()
    loads = [w for w in rig.manager.waits if len(w) == 2]
    assert len(loads) == 4                # m and m' of each chunk, waited together
    # through the free slot (3172 floats: pieces of 1024), no other buffer; the slot went back
    assert [c[2] for c in rig.manager.calls] == ["gradient slot 0"]
    assert rig.pool.available == 1 and rig.pool.try_acquire() is not None


def test_a_rebuild_without_a_free_slot_goes_through_the_accumulation_chunk() -> None:
    rig = _Rig(units=(LARGE,), slot_bytes=None)
    state = rig.states[0]
    g = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    rig.backward(state, grads=[g[0:2500], g[2512:3512]])
    m, m_new = _speculated_moments(rig, state, g, 1.0)
    rig.spec.resolve(keep=False)
    assert torch.equal(state.grad_store.data, _formula(rig, state, m, m_new, 1.0))
    assert [c[2] for c in rig.manager.calls] == ["gradient accumulation chunk"]
    assert len([w for w in rig.manager.waits if len(w) == 2]) == 4     # 4096 // 3 -> 1024


def test_a_rebuild_of_small_units_takes_a_small_buffer_of_its_own() -> None:
    rig = _Rig(units=(SMALL, SMALL), slot_bytes=4 * 1024)
    a, b = rig.states
    taken = rig.pool.acquire()            # the slot is busy: the chunk, 1024: too small too
    g = torch.randn(1024, generator=torch.Generator().manual_seed(4))
    grads = [g[0:15].reshape(3, 5), g[16:23]]
    rig.backward(a, b, grads=grads)
    moments = [_speculated_moments(rig, s, g, 1.0, seed=i) for i, s in enumerate((a, b))]
    rig.spec.resolve(keep=False)
    assert rig.manager.calls[-1] == (3 * BLOCK_NUMEL, F32, "gradient rebuild")
    assert "gradient accumulation chunk" in [c[2] for c in rig.manager.calls]
    for s, (m, m_new) in zip((a, b), moments):
        assert torch.equal(s.grad_store.data, _formula(rig, s, m, m_new, 1.0))
    rig.pool.release(taken)


def test_only_units_whose_gradient_is_not_home_are_rebuilt() -> None:
    """u0's params are in an L2 group (its gradient went home with the step), u1's not."""
    rig = _Rig(units=((((7,), 1),), (((7,), 0),)), l2_group=1)
    a, b = rig.states
    rig.backward(a, b)
    assert [s["gradient_home"] for s in rig.submitted] == [True, False]
    for s in (a, b):
        s.exp_avg.shadow.fill_(1.0)
    rig.spec.resolve(keep=False)
    assert float(a.grad_store.data.abs().sum()) == 0.0
    assert float(b.grad_store.data[:7].abs().min()) > 0.0
    # the next roll-back rebuilds nothing of the earlier speculation
    b.grad_store.data.zero_()
    rig.spec.pays = True
    rig.backward(a, clip=1.0)
    rig.spec.resolve(keep=False)
    assert float(b.grad_store.data.abs().sum()) == 0.0


def test_a_kept_speculation_forgets_the_gradients_not_home() -> None:
    rig = _Rig(units=(SMALL, SMALL))
    a, b = rig.states
    rig.backward(a)
    rig.spec.resolve(keep=True)
    a.exp_avg.shadow.fill_(1.0)
    rig.backward(b, clip=1.0)
    rig.spec.resolve(keep=False)
    assert float(a.grad_store.data.abs().sum()) == 0.0


def test_gradient_term_rounds_as_the_kernel_and_keeps_exact_zeros() -> None:
    m = torch.tensor([1.0, -3.0, 0.1], dtype=F32)
    beta1 = 0.9
    m_new = m * beta1
    assert torch.equal(_gradient_term(m, m_new, beta1), torch.zeros(3, dtype=torch.float64))
    m_new = m * beta1 + torch.tensor([0.1, 0.2, -0.3])
    got = _gradient_term(m, m_new, beta1)
    assert got.dtype == torch.float64
    one_minus = float(torch.tensor(1 - beta1, dtype=F32))
    assert one_minus != 1 - beta1
    assert torch.equal(got, (m_new - m * beta1).double() / one_minus)


def test_pieces_are_equal_multiples_of_4_kib_or_none() -> None:
    buffer = torch.arange(7 * 1024 + 5, dtype=F32)
    pieces = _pieces(buffer, 3)
    assert [p.numel() for p in pieces] == [2048, 2048, 2048]
    assert [int(p[0]) for p in pieces] == [0, 2048, 4096]
    assert _pieces(torch.zeros(3 * 1024 - 1), 3) is None
    assert [p.numel() for p in _pieces(torch.zeros(3 * 1024), 3)] == [1024] * 3
    assert [p.numel() for p in _pieces(torch.zeros(4096), 2)] == [2048, 2048]


class _LandsWhenWaited(Future):
    """The landed future of a job that has stepped and lands when it is waited for."""

    def __init__(self, job: StepJob) -> None:
        super().__init__()
        self.job = job

    def result(self, timeout=None):
        if not self.done():
            self.job.landed_future = Future()
            self.job.landed()
            self.set_result(None)
        return super().result(timeout)


def test_a_roll_back_waits_for_every_job_to_land() -> None:
    rig = _Rig(units=(SMALL, SMALL))
    rig.run_now = False
    a, b = rig.states
    jobs = rig.backward(a, b)
    for job in jobs:
        job.runs = rig.kernel.step_runs(job.state, job.params)
        job.stepped()
        job.landed_future = _LandsWhenWaited(job)
    rig.spec.roll_back("clipping")
    assert [j.phase for j in jobs] == [JobPhase.ROLLED_BACK] * 2
    assert rig.steps.jobs == [] and a.step == 0 and b.step == 0
    assert rig.steps.reap() == [a.unit, b.unit]


def test_a_roll_back_gives_back_only_the_parameters_that_stepped() -> None:
    rig = _Rig()
    state = rig.states[0]
    rig.spec.begin_backward(True)
    rig.gradients.on_grad(state.unit, state.unit.trainable_entries()[1], torch.ones(7))
    rig.spec.speculate(state, 1.0, 1.0, rig.submit)
    assert state.param_steps == {16: 1}
    rig.spec.roll_back("clipping")
    assert state.param_steps == {16: 0} and state.step == 0 and state.arrived == {16}


def test_the_counts_add_up_over_steps() -> None:
    rig = _Rig()
    state = rig.states[0]
    for _ in range(2):
        rig.backward(state)
        rig.spec.resolve(keep=True)
    for _ in range(2):
        rig.backward(state, clip=1.0)
        rig.spec.resolve(keep=False)
    for _ in range(2):
        rig.backward(state)
        rig.spec.void()
    assert rig.spec.stats == {"committed": 2, "rolled_back": 2, "voided": 2}


def test_each_roll_back_logs_how_many_units_and_why() -> None:
    import logging

    from infinity.optim import speculation

    records: list[str] = []

    class _List(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())
    handler = _List(level=logging.DEBUG)
    level = speculation.log.level
    speculation.log.setLevel(logging.DEBUG)
    speculation.log.addHandler(handler)
    try:
        rig = _Rig(units=(SMALL, SMALL))
        rig.backward(*rig.states, clip=1.0)
        rig.spec.resolve(keep=False)
        rig.backward(rig.states[0])
        rig.spec.resolve(keep=False, overflow=True)
        rig.backward(rig.states[0])
        rig.groups[0]["lr"] = 5e-4
        rig.spec.resolve(keep=True)
        rig.backward(rig.states[1])
        rig.spec.void()
    finally:
        speculation.log.removeHandler(handler)
        speculation.log.setLevel(level)
    assert records == [
        "speculative step of 2 unit(s) rolled back (clipping)",
        "speculative step of 1 unit(s) rolled back (an overflow)",
        "speculative step of 1 unit(s) rolled back (the hyperparameters changed after the "
        "backward)",
        "speculative step of 1 unit(s) rolled back (the model was read before step())",
    ]


def test_a_rebuild_in_pieces_of_3072_reads_a_short_last_chunk() -> None:
    """Pieces of 3072 elements over 4096: a full chunk and one of 1024, never past the end."""
    rig = _Rig(units=(LARGE,), slot_bytes=4 * (3 * 3072 + 50))
    state = rig.states[0]
    g = torch.randn(4096, generator=torch.Generator().manual_seed(6))
    rig.backward(state, grads=[g[0:2500], g[2512:3512]])
    m, m_new = _speculated_moments(rig, state, g, 1.0)
    rig.spec.resolve(keep=False)
    assert torch.equal(state.grad_store.data, _formula(rig, state, m, m_new, 1.0))
    assert len([w for w in rig.manager.waits if len(w) == 2]) == 2


def test_gradient_term_rounds_one_minus_beta1_to_float32_whatever_the_default_dtype() -> None:
    m = torch.tensor([1.0, -3.0], dtype=F32)
    m_new = m * 0.9 + torch.tensor([0.1, 0.2])
    one_minus = float(torch.tensor(1 - 0.9, dtype=F32))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = _gradient_term(m, m_new, 0.9)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(got, (m_new - m * 0.9).double() / one_minus)
