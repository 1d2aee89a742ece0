"""The partitioned optimizer: Adam states of every unit in their home tier, stepped by the CPU Adam.

Each trainable unit owns flat stores for exp_avg and exp_avg_sq in its state format (fp32, or
bf16 / int8: optim/state_formats.py), and a separate fp32 master when the compute copy is not
fp32-on-CPU and the master is not the bf16 parameter itself, laid out like the unit's flat parameters (see
[Note: flat layout] in zero/unit.py). Gradients arrive parameter by parameter from the
coordinator and accumulate in fp32, either straight into a HOST gradient store or in a
transient host buffer that is then written to NVMe.

Two schedules:
- early step: when a unit's gradients are complete, it is stepped at once, overlapped with the
  rest of backward; its gradients never need a home. Exact only without clipping, loss scaling
  or accumulation, so the engine enables it only then.
- deferred: gradients are kept in their home; ``step()`` queues every unit's step, which runs
  when the next forward fetches the unit (see [Note: the deferred step lands at the next fetch]
  in optim/step_stream.py).
Both run on the step stream, sub-group (aligned chunk of a unit's trainable range) by
sub-group, reading ahead and writing behind (optim/step_stream.py).

[Note: parameters without a gradient]
torch's optimizers skip a parameter whose ``.grad`` is None (an expert no token was routed to,
a head this batch did not use): no decay, no momentum, and its step count does not advance, so
its bias correction differs from its neighbours' from then on. Units step flat ranges, so each
unit records which parameters received a gradient since its last step (``arrived``) and how
many steps each parameter has taken (``param_steps``); a job steps only the parameters that got
one, in runs of neighbours with the same param group and step count (``step_runs``: with every
parameter used every time, one run per param group).

The fp32 master on a CPU-only machine with fp32 compute is the parameter itself (DESIGN.md
"fp32 on CPU"): it is stepped in place in its home (device copy, host store or NVMe extent), so
parameters are stored once, not twice.

The optimizer is composed of its parts, each an object it owns: the gradient collector
(optim/gradients.py), the Adam kernel (optim/kernel.py), the step stream (optim/step_stream.py),
the pending steps (optim/pending_steps.py) and the speculator (optim/speculation.py); their
records live in optim/records.py. It implements the coordinator's ``UnitStepper``
(zero/protocols.py).
"""
from __future__ import annotations

import math
import sys
import time

import torch

from infinity.base.log import get_logger
from infinity.comm.collectives import NO_COMM, Collectives
from infinity.optim.boundary_steps import LATE_GRADIENT, BoundarySteps
from infinity.optim.grad_norm import say_not_finite, sum_of_squares
from infinity.optim.gradients import GradientCollector
from infinity.optim.held_room import HeldRoom
from infinity.optim.kernel import AdamKernel
from infinity.optim.loss_scaler import ReportsLossScale
from infinity.optim.master_seed import merge_master, seed_master
from infinity.optim.pending_steps import PendingSteps
from infinity.optim.pools import host_pool, plan_pools
from infinity.optim.protocols import OptimizerOwner
from infinity.optim.records import (
    CompleteGradient,
    OptimTimers,
    StepJob,
    UnitOptimState,
    stepped_range,
)
from infinity.optim.speculation import Speculator
from infinity.optim.state_formats import build_state, group_format, log_formats
from infinity.optim.step_stream import StepStream
from infinity.optim.torch_api import RefusesTorchStateDict
from infinity.planner.run_plan import OptimizerPools
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import FlatStore, TierManager
from infinity.storage.tiers import Tier
from infinity.zero.protocols import SteppedUnit, UnitValues, Wait
from infinity.zero.unit import ParamEntry

log = get_logger("optim")


class PartitionedOptimizer(RefusesTorchStateDict, ReportsLossScale, torch.optim.Optimizer):
    """Adam/AdamW over offloaded, flat, per-unit states (a torch Optimizer for LR schedulers)."""

    def __init__(self, units: list[SteppedUnit], param_groups: list[dict], manager: TierManager, *,
                 optimizer_tier: Tier, grad_tier: Tier, early_step: bool, sub_group_numel: int,
                 master_separate: bool, staging_pool: BufferPool | None,
                 adamw_mode: bool = True, threads: int | None = None,
                 speculation: str = "off", defaults: dict | None = None,
                 comm: Collectives = NO_COMM, shard_states: bool = False,
                 values: UnitValues | None = None,
                 grad_dtype: torch.dtype = torch.float32,
                 pools: OptimizerPools | None = None, clip_norm: float = 0.0,
                 owner: OptimizerOwner | None = None, boundary_steps: bool = False) -> None:
        """``pools``: the run plan's (``RunPlan.optimizer``); None plans them here from the
        units, by the same rule (``planner.run_plan.optimizer_pools``). ``clip_norm``: the
        global gradient norm clipped to (0: none). ``owner``: the engine (see
        optim/protocols.py); None for an optimizer used alone. ``boundary_steps``: the
        deferred schedule steps each unit in the last micro-batch's backward (see [Note: the
        last micro-batch steps early] in optim/boundary_steps.py)."""
        super().__init__(param_groups, defaults=dict(defaults or {}))
        if grad_dtype != torch.float32 and (grad_tier != Tier.HOST or comm.active):
            raise ValueError(f"a {grad_dtype} gradient home needs grad_tier HOST and one rank, got "
                             f"{grad_tier} with {comm.world_size} ranks "
                             "(see [Note: the gradient home in the compute dtype])")
        self._groups_fixed = True    # see add_param_group
        speculation = "off" if early_step else speculation   # see [Note: speculative step]
        # several ranks: each steps its shard of every unit (``shard_states``, stages 1-3) or
        # all of it (stage 0), from gradients averaged over the ranks (see [Note: gradients
        # over ranks] in optim/gradients.py); no speculation (a redo would need the others')
        self.comm = comm
        shard_states = shard_states and comm.active
        if comm.active:
            speculation = "off"
        if speculation != "off" and any(not group_format(g).is_default
                                        for g in self.param_groups):
            # a param group's own state format (the plan saw only the config's): the redo of a
            # speculated step reads fp32 states (see [Note: speculative step])
            log.info("speculative step off: a param group stores its Adam states in a format")
            speculation = "off"
        doubled = speculation != "off"
        self.manager = manager
        self.staging_pool = staging_pool
        self._stream: StepStream | None = None
        self._expected: dict[int, StepJob] = {}   # unit index -> early step read ahead
        # unit index -> deferred step waiting for its unit to be fetched (see [Note: the
        # deferred step lands at the next fetch] in step_stream.py)
        self._waiting: dict[int, StepJob] = {}
        self.owner = owner
        self._owner_stepping = False    # the owner's own step is running (``owner_step``)
        self._in_backward = False
        self._stepped_in_backward: set[int] = set()   # its steps started: ``LATE_GRADIENT``
        self.early_step = early_step
        self.timers = OptimTimers()
        self.clip_norm = clip_norm
        self.last_grad_norm: float | None = None
        self.grad_scale = 1.0        # the fp16 loss scale of this cycle's gradients (begin_backward)
        self.overflow = False        # the last step was skipped: its gradients were not finite
        self.states: list[UnitOptimState] = []
        trainable_units = [u for u in units if u.has_trainable]
        max_trainable = max((u.trainable_numel for u in trainable_units), default=0)
        if pools is None:
            pools = plan_pools(units, manager, sub_group_numel=sub_group_numel,
                               optimizer_tier=optimizer_tier, grad_tier=grad_tier,
                               early_step=early_step, master_separate=master_separate,
                               speculative=doubled, comm=comm, shard_states=shard_states)
        self.pools = pools
        self.sub_group_numel = pools.sub_group_numel
        asked = [group_format(g) for g in self.param_groups]
        for unit in trainable_units:
            lo, hi = stepped_range(unit, shard_states)
            state = build_state(manager, unit, (lo, hi), asked, self.sub_group_numel,
                                optimizer_tier=optimizer_tier, grad_tier=grad_tier,
                                grad_dtype=grad_dtype, early_step=early_step,
                                master_separate=master_separate, doubled=doubled,
                                sharded=shard_states)
            master = state.master
            self.states.append(state)
            if master is not None:
                self._init_master(unit, master, (lo, hi), values)
        log_formats(self.states, asked)
        self._by_unit = {s.unit.index: s for s in self.states}
        # see [Note: held gradients]: a room of HELD_ROOM_UNITS (optim/held_room.py)
        self.holds_grads = pools.holds_grads
        self.held_room = HeldRoom(pools.held_room_bytes)
        self.grad_pool = host_pool(manager, pools.gradient)
        self.step_pool = host_pool(manager, pools.step)
        # the parts (see the module docstring)
        self.kernel = AdamKernel(lambda: self.param_groups, adamw_mode, threads)
        self.steps = PendingSteps(self.timers, self._add_norm)
        self.gradients = GradientCollector(
            self.states, manager, early_step=early_step, holds_grads=self.holds_grads,
            grad_pool=self.grad_pool, held_room=self.held_room, timers=self.timers,
            max_trainable=max_trainable, steps_running=self.steps.running,
            speculates=lambda state: self.speculator.can_speculate(state), comm=comm,
            scatter=shard_states, device_buffers=pools.device_grad_buffers, device_dtype=pools.device_grad_dtype,
            folds=lambda state: self.boundary.takes(state))
        self.speculator = Speculator(speculation, manager, self.gradients, self.kernel,
                                     self.steps, self.grad_pool)
        self.boundary = BoundarySteps(boundary_steps and not early_step and speculation == "off"
                                      and clip_norm == 0)
        # both schedules step through one stream (optim/step_stream.py)
        self._stream = StepStream(self.kernel, manager, self.step_pool, self.sub_group_numel,
                                  self.timers)

    def _global_sq_norm(self, local: float) -> float:
        """The squares of the whole model's gradient from this rank's: with sharded states
        each rank normed its shards and the global norm sums them; at stage 0 each rank holds
        the whole averaged gradient. Either way every rank calls the sum (so an overflow seen
        anywhere is seen by all: every rank skips the step and keeps one loss scale)."""
        total = self.comm.sum_float(local)
        return total if self.gradients.scatter else total / max(1, self.comm.world_size)

    def _add_norm(self, squares: float) -> None:
        self.gradients.sq_norm += squares

    # -- what the engine and checkpoints read ----------------------------------------------
    @property
    def speculation(self) -> str:
        """The speculative step's mode: "off", "auto" or "on"."""
        return self.speculator.mode

    @property
    def speculation_pays(self) -> bool:
        """Whether the last step would have kept its speculation (checkpoints keep it)."""
        return self.speculator.pays

    @speculation_pays.setter
    def speculation_pays(self, value: bool) -> None:
        self.speculator.pays = value

    @property
    def speculation_stats(self) -> dict[str, int]:
        return self.speculator.stats

    @property
    def speculation_pending(self) -> bool:
        """Speculated steps wait for ``step()`` to keep or drop them."""
        return self.speculator.pending

    @property
    def step_failure(self) -> BaseException | None:
        """The first background step that failed (the states may be half-written)."""
        return self.steps.failure

    def hyperparameters(self) -> list[dict]:
        """Each param group's Adam hyperparameters now, checked (``AdamKernel``)."""
        return self.kernel.checked_hyperparameters()

    def stream_stats(self) -> dict[str, int]:
        """Counters of the step stream's expected steps (see [Note: expected steps])."""
        return dict(self._stream.stats)

    # -- set-up ----------------------------------------------------------------------------
    def _init_master(self, unit: SteppedUnit, master: FlatStore,
                     span: tuple[int, int] | None = None,
                     values: UnitValues | None = None) -> None:
        """Seed the fp32 master of the unit's range ``span`` (by default the state's): see
        optim/master_seed.py."""
        if span is None:
            state = self._by_unit[unit.index]
            span = state.lo, state.hi
        seed_master(unit, master, span, self.manager, self.staging_pool, values)

    def reload_master(self, unit: SteppedUnit, exact: dict | None = None) -> None:
        """The unit's parameters were changed by hand: the fp32 master takes the changes
        (``merge_master``; ``exact``: entry -> the fp32 values it was loaded with)."""
        if (state := self._by_unit.get(unit.index)) is not None and state.master is not None:
            merge_master(unit, state.master, (state.lo, state.hi), self.manager,
                         self.staging_pool, exact)

    # -- the coordinator's UnitStepper (zero/protocols.py) ---------------------------------
    def on_grad(self, unit: SteppedUnit, entry: ParamEntry, grad: torch.Tensor) -> None:
        if unit.index in self._stepped_in_backward:
            raise RuntimeError(LATE_GRADIENT.format(unit=unit.name))
        self.gradients.on_grad(unit, entry, grad)

    def on_unit_backward_done(self, unit: SteppedUnit) -> bool:
        """All of ``unit``'s gradients for this backward have arrived.

        Returns True when the unit may be released now; False when an early step of it is
        running in the background (see [Note: background early step]); ``reap`` then says when.
        """
        start = time.perf_counter()
        state = self._by_unit[unit.index]
        if self.speculator.can_speculate(state):
            # a speculated step read the gradient as it stands too: a late part would be
            # missing from it, kept or redone (weights 0.06-0.08 off torch, silently)
            self._stepped_in_backward.add(unit.index)
            try:
                self.speculator.speculate(state, self.clip_norm, self.grad_scale,
                                          self._submit_ready)
            finally:
                self.timers.grad_s += time.perf_counter() - start
            return False
        self.gradients.zero_unwritten(state)
        comm_before = self.comm.counters.comm_s
        self.gradients.reduce(state)    # over the ranks (see [Note: gradients over ranks])
        start += self.comm.counters.comm_s - comm_before   # counted in comm_s, not here
        if self.early_step:
            self._stepped_in_backward.add(unit.index)
            self._submit_ready(state, self.gradients.take(state),
                               self.gradients.take_arrived(state))
            self.timers.grad_s += time.perf_counter() - start
            return False
        steps_now = self.boundary.takes(state)   # see [Note: the last micro-batch steps early]
        try:
            self.gradients.finish(state, norm=not steps_now)    # its kernels sum its norm
        finally:
            self.gradients.drop_buffer(state, forget=True)
            self.timers.grad_s += time.perf_counter() - start
        if steps_now:
            self._stepped_in_backward.add(unit.index)
            self.boundary.started(self._submit_ready(state, self.gradients.take_home(state),
                                                     self.gradients.take_arrived(state)))
            state.clear_gradient()
            return False
        return True

    def _submit_ready(self, state: UnitOptimState, gradient: CompleteGradient,
                      params: frozenset[int], **settings) -> StepJob:
        """Queue the unit's step with its gradient complete (its expected job made ready, or
        a new one) and count it pending."""
        job = self._expected.pop(state.unit.index, None)
        if job is not None:
            self._stream.make_ready(job, gradient, params=params, **settings)
        else:
            job = self._stream.submit(state, early=True, gradient=gradient, params=params,
                                      **settings)
        self.steps.add(job)
        return job

    def expect_backward(self, unit: SteppedUnit) -> None:
        """``unit``'s gradients are coming (early step, or a backward that speculates): its
        Adam states may be read ahead while the stream has slots to spare (see [Note: expected
        steps])."""
        state = self._by_unit.get(unit.index)
        steps_now = (self.speculator.speculating or (state is not None and
                                                     self.boundary.takes(state))) \
            if self._in_backward else self.speculator.plans()
        # (not while a deferred step of the unit waits: its reads would overtake that step)
        if not (self.early_step or steps_now) or state is None or unit.index in self._expected or \
                unit.index in self._waiting or self.steps.holds(state, stepping_only=True):
            return
        self._expected[unit.index] = self._stream.expect(state)

    def step_fetched(self, unit: SteppedUnit) -> bool:
        """``unit`` was just fetched: run its waiting deferred step on the device copy, after the
        fetch's copy, and wait for its kernels; True when it did (held until ``reap``)."""
        job = self._waiting.pop(unit.index, None)
        if job is None:
            return False
        unit.wait_fetched()       # the step writes the buffer the fetch's copy writes
        start = time.perf_counter()
        self._stream.make_ready(job)
        self.steps.add(job)
        try:
            self.steps.wait_stepped(unit)
        finally:
            self.timers.optimizer_s += time.perf_counter() - start
        return True

    def step_ahead(self, unit: SteppedUnit) -> bool:
        """Start ``unit``'s waiting deferred step before its use, its device copy's fetch
        issued on copies that overlap compute (see [Note: the deferred step runs ahead of the
        forward] in zero/steps_ahead.py): only with a separate master, which the kernel reads
        instead of the device copy. True when it started (held until ``reap``)."""
        job = self._waiting.get(unit.index)
        if job is None or job.state.master is None:
            return False
        del self._waiting[unit.index]
        self._stream.make_ready(job)
        self.steps.add(job)
        return True

    def wait_stepped(self, unit: SteppedUnit | None = None) -> None:
        """Wait until the kernels of ``unit``'s steps in flight (None: every unit's) have run:
        a forward after a backward that raised, or after an interrupted ``step()``, must not
        read a copy being stepped; a use waits for a step started ahead. Re-raises a step's
        failure."""
        start = time.perf_counter()
        try:
            self.steps.wait_stepped(unit)
        finally:
            self.timers.optimizer_s += time.perf_counter() - start

    def reap(self, wait: Wait = Wait.NONE) -> list[SteppedUnit]:
        """Units whose background steps have all landed (the caller releases them); see
        [Note: the life of a step job] in optim/records.py."""
        return self.steps.reap(wait)

    def drain(self) -> list[SteppedUnit]:
        """The run ends: expected and waiting steps are cancelled (nothing can read their
        results), the rest are seen through (failures logged), and every unit comes back."""
        self.cancel_expected()
        for job in self._waiting.values():
            self._stream.cancel(job)
        self._waiting.clear()
        return self.steps.drain()

    def cancel_expected(self) -> None:
        """The backward is over (or failed): units that got no gradients are not stepped."""
        for index, job in self._expected.items():
            self._stream.cancel(job)
            self.gradients.drop_buffer(self._by_unit[index])
        self._expected.clear()

    # -- the engine's backward ------------------------------------------------------------
    def begin_backward(self, boundary: bool, loss_scale: float = 1.0) -> None:
        """Called before each backward: ``boundary`` is True on the last micro-step, and the
        gradients carry ``loss_scale`` (fp16's; 1 otherwise); a speculation still pending from
        an earlier backward of this cycle was voided by the engine's forward."""
        if boundary or self.early_step:       # the values this backward may step with
            self.hyperparameters()
        self.grad_scale = loss_scale
        self.gradients.begin_backward(boundary)
        self.boundary.begin_backward(boundary)
        self._stepped_in_backward.clear()
        self._in_backward = True
        self.speculator.begin_backward(boundary)

    def abandon_backward(self) -> None:
        """A backward raised: drop the gradients collected since the last step (this backward's
        partial ones, and with accumulation the earlier micro-steps' too), so the next step
        sees none of them. Early steps that already ran keep their update: they cannot be
        undone; speculated ones are rolled back (``take_rolled_back``)."""
        self._in_backward = self.speculator.speculating = False
        self.boundary.end_backward()
        self.cancel_expected()
        try:
            self.boundary.collect(self.steps)   # stepped before the failure: they keep it
            if self.speculator.pending:
                self.speculator.roll_back("the backward raised", rebuild_gradients=False)
            self.gradients.land_writes()
        finally:
            dropped = self.gradients.drop_cycle()
            raised = sys.exc_info()[1]       # called while the backward's error is handled
            why = "" if raised is None else f" ({type(raised).__name__}: {str(raised)[:300]})"
            log.warning("backward raised%s: the gradients of %d unit(s) collected since the last "
                        "optimizer step are dropped%s", why, dropped,
                        "; units already stepped in this backward keep their update"
                        if self.early_step or self.boundary.pending else "")

    def end_backward(self) -> None:
        """Called by the engine after each backward: gradient writes land, and accumulation
        continues until a step."""
        self._in_backward = self.speculator.speculating = False
        self.boundary.end_backward()
        self.cancel_expected()
        # see [Note: gradients leave the device]: the adds into resident homes go on
        self.gradients.land_copies(homes=False)
        self.gradients.land_writes()

    # -- stepping --------------------------------------------------------------------------
    def grad_scale_for_clipping(self) -> float:
        """Divisor applied to gradients in the kernel: the loss scale, times the global-norm
        clipping factor when clipping acts (the norm is that of the unscaled gradients)."""
        norm = math.sqrt(self.gradients.sq_norm) / self.grad_scale
        self.last_grad_norm = norm
        if self.clip_norm > 0 and norm > self.clip_norm:
            return self.grad_scale * (norm + 1e-6) / self.clip_norm
        return self.grad_scale

    def forward_order(self) -> list[int]:
        """Unit indices in the order the next forward fetches them (the owner's; none alone)."""
        return self.owner.forward_order() if self.owner is not None else []

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch API
        """``optimizer.step()`` of a torch-style loop: the owner's step (the engine's, which
        counts it, releases what the step held and comes back through ``owner_step``; the loop
        steps its scheduler itself), or ``run_step`` for an optimizer used alone."""
        if closure is not None:
            raise ValueError("PartitionedOptimizer.step does not take a closure")
        if self.owner is not None and not self._owner_stepping:
            self._owner_stepping = True    # the owner comes back through ``owner_step``
            try:
                self.owner.step_from_optimizer()
            finally:
                self._owner_stepping = False
        else:
            self.run_step()
        return None

    def owner_step(self) -> None:
        """The owner's own step (the engine's): through ``step()``, so that torch's wrapper of
        it runs -- step pre/post hooks, and the mark an LR scheduler checks that the optimizer
        stepped before it -- and into ``run_step`` rather than back to the owner. Inside a
        user's ``step()`` (which came to the owner) the wrapper has run already: ``run_step``
        straight away, so the hooks run once a step, as torch's optimizers run them."""
        if self._owner_stepping:
            self.run_step()
            return
        self._owner_stepping = True
        try:
            self.step()
        finally:
            self._owner_stepping = False

    @torch.no_grad()
    def run_step(self) -> None:
        """Early schedule: wait until every unit's kernels have run. Deferred schedule: queue
        the step of every unit that received gradients, to run when the unit is next fetched
        (see [Note: the deferred step lands at the next fetch])."""
        start, comm_before = time.perf_counter(), self.comm.counters.comm_s
        self.overflow = False
        try:
            if self.early_step:
                self._finish_early_steps()
            else:
                self._queue_deferred_steps()
        finally:   # the norm's all-reduce is counted in comm_s, not here
            self.timers.optimizer_s += time.perf_counter() - start - \
                (self.comm.counters.comm_s - comm_before)

    def _queue_deferred_steps(self) -> None:
        self.gradients.land_copies()    # the steps read them: [Note: gradients leave the device]
        self.speculator.collect_norms()
        stepped_early = self.boundary.collect(self.steps)
        if self._waiting:
            names = [self._by_unit[i].unit.name for i in self._waiting]
            raise RuntimeError(
                f"the previous deferred step of {len(names)} unit(s) ({', '.join(names[:3])}) "
                "has not run yet: step through Engine.step, which fetches and steps them first")
        for state in self.states:
            if state.has_grads and not state.norm_counted:
                # its last gradient of the cycle came before the last micro-step: at home
                self.gradients.sq_norm += sum(
                    sum_of_squares(v, threads=torch.get_num_threads())
                    for _, v in self.gradients.home_gradient(state))
        self.gradients.sq_norm = self._global_sq_norm(self.gradients.sq_norm)
        if not math.isfinite(self.gradients.sq_norm):   # [Note: the last micro-batch steps early]
            say_not_finite(self.gradients.sq_norm, scaled=self.grad_scale != 1.0, stepped=(
                "the last micro-batch's backward" if stepped_early else None))
        if not math.isfinite(self.gradients.sq_norm) and not stepped_early:
            # inf or NaN in a gradient (see optim/loss_scaler.py): the step is skipped
            self.overflow = True
            self.last_grad_norm = math.sqrt(self.gradients.sq_norm) / self.grad_scale  # nan: nan
            try:
                self.speculator.resolve(keep=False, overflow=True)
            finally:
                self.gradients.drop_cycle()
            return
        scale = self.grad_scale_for_clipping()
        self.speculator.resolve(keep=scale == self.grad_scale)   # no clipping acted
        position = {uid: i for i, uid in enumerate(self.forward_order())}
        stepped = [s for s in self.states if s.has_grads]
        for state in sorted(stepped, key=lambda s: position.get(s.unit.index, len(position))):
            state.clear_gradient()
            # a forward between the backward and this step expected the next backward's units
            # (speculation planned): those reads are of the states this step is about to change
            stale = self._expected.pop(state.unit.index, None)
            if stale is not None:
                self._stream.cancel(stale)
            self._waiting[state.unit.index] = self._stream.expect(
                state, early=False, grad_scale=scale, params=self.gradients.take_arrived(state))

    def waiting_units(self) -> list[SteppedUnit]:
        """Units whose deferred step waits for them to be fetched, in the order queued."""
        return [self._by_unit[i].unit for i in self._waiting]

    def _finish_early_steps(self) -> None:
        """Wait until every unit's kernels have run (its device copy is the new parameters);
        writes still in flight go on behind the next forward (see [Note: writes behind the
        step]); the engine's next ``reap`` hands out the units whose writes have landed."""
        self.steps.wait_stepped()
        for job in self.steps.jobs:
            self.steps.collect_norm(job)
        # the kernels summed each unit's gradient squares as they stepped it: the norm no
        # step of this schedule needs, but get_global_grad_norm() reports
        self.last_grad_norm = math.sqrt(self._global_sq_norm(self.gradients.sq_norm)) / \
            self.grad_scale
        if not math.isfinite(self.last_grad_norm):
            say_not_finite(self.gradients.sq_norm, stepped="the backward", scaled=False)
        self.steps.reap(hand_out=False)

    # -- speculation (see [Note: speculative step] in optim/speculation.py) -----------------
    def void_speculation(self) -> None:
        """Something reads the model before ``step()``: roll the speculation back."""
        self.speculator.void()

    def take_rolled_back(self) -> list[SteppedUnit]:
        """The units rolled back since the last call (their device copies are stale)."""
        return self.speculator.take_rolled_back()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients never live on the parameters, but the ones collected since the last step
        are discarded, as torch's zero_grad between a backward and a step does: the owner's
        (the engine's) ``zero_grad`` knows the schedule's rules."""
        if self.owner is not None:
            self.owner.zero_grad(set_to_none)

    def holds_cycle_gradients(self) -> bool:
        """Whether a backward since the last step left gradients (or a speculated step) here."""
        return self.speculator.pending or any(s.grad.seen or s.has_grads for s in self.states)

    def discard_cycle_gradients(self) -> None:
        """zero_grad between a backward and a step: forget this cycle's gradients and roll a
        speculated step back (the engine then drops the rolled-back device copies)."""
        self.cancel_expected()
        if self.speculator.pending:
            self.speculator.roll_back("zero_grad() discarded the gradients",
                                      rebuild_gradients=False)
        self.gradients.land_writes()
        dropped = self.gradients.drop_cycle()
        log.info("zero_grad(): the gradients of %d unit(s) collected since the last step are "
                 "discarded", dropped)

    def close(self) -> None:
        try:
            self.gradients.close()
            if self._stream is not None:
                try:
                    self.drain()
                finally:
                    self._stream.shutdown()
        finally:
            for state in self.states:
                for store in (state.exp_avg, state.exp_avg_sq, state.master, state.grad_store,
                              state.exp_avg_scales, state.exp_avg_sq_scales):
                    if store is not None:
                        store.free()
