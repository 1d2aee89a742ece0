"""The partitioned optimizer: Adam states of every unit in their home tier, stepped by the CPU Adam.

Each trainable unit owns flat fp32 stores for exp_avg and exp_avg_sq (and a separate fp32 master
when the compute copy is not fp32-on-CPU), laid out like the unit's flat parameters (see
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
parameters are stored once, not twice. How gradients are collected, accumulated, normed and
dropped is in optim/gradients.py.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from infinity.base.log import get_logger
from infinity.optim.cpu_adam import adam_step_flat
from infinity.optim.gradients import (
    GRADS_HELD,
    CompleteGradient,
    GradientCollector,
    _grad_pieces,
    _sum_of_squares,
    gradients_held,
    held_room_bytes,
)
from infinity.optim.held_room import HeldRoom
from infinity.optim.speculation import Speculation
from infinity.optim.step_reaping import StepReaping
from infinity.optim.step_stream import StepJob, StepStream
from infinity.planner.engine_sizes import step_slot_count
from infinity.storage.buffer_pool import BufferPool, Slot
from infinity.storage.manager import FlatStore, TierManager
from infinity.storage.tiers import Residency, Tier
from infinity.zero.unit import Unit

log = get_logger("optim")


@dataclass(eq=False)
class UnitOptimState:
    """The Adam states of one unit (fp32, ``unit.trainable_numel`` elements each)."""

    unit: Unit
    exp_avg: FlatStore
    exp_avg_sq: FlatStore
    master: FlatStore | None          # None: the parameter itself is the fp32 master
    grad_store: FlatStore | None      # deferred schedule only
    step: int = 0
    # [Note: parameters without a gradient]: steps taken by each trainable parameter (by entry
    # offset), and the parameters that received a gradient since the unit's last step
    param_steps: dict[int, int] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)
    grad_buffer: torch.Tensor | None = None   # transient fp32 gradient during backward
    grad_slot: Slot | None = None
    grads_seen: int = 0
    # offsets of the parameters whose gradient was copied into a fresh ``grad_buffer`` (the
    # buffer is not zeroed up front; what no gradient covered is zeroed when the unit is done)
    grad_written: set[int] | None = None
    # early step on a CPU device: the gradients autograd produced, by entry offset, held as they
    # are until the unit's step has run (see [Note: held gradients])
    grad_parts: dict[int, torch.Tensor] | None = None
    held_bytes: int = 0     # of grad_parts, counted in the held room
    # deferred schedule: gradients arrived since the unit's last step (a unit without any is
    # not stepped, as torch skips parameters whose gradient is None)
    has_grads: bool = False
    norm_counted: bool = False   # its gradient is in the clipping norm of this cycle


@dataclass
class OptimTimers:
    """Seconds spent by the training thread in the optimizer (waiting for background steps
    included) and in gradient handling, and by the background early-step worker."""

    optimizer_s: float = 0.0
    grad_s: float = 0.0
    grad_wait_s: float = 0.0    # of grad_s: backward waiting for room for held gradients
    background_s: float = 0.0

    def reset(self) -> None:
        self.optimizer_s = self.grad_s = self.grad_wait_s = self.background_s = 0.0


class StepRun(NamedTuple):
    """A contiguous range [start, end) of one param group's parameters stepped together, all
    taking step ``step`` (from 1)."""

    group_index: int
    start: int
    end: int
    step: int


@dataclass(frozen=True)
class SubGroup:
    """An aligned chunk [start, end) of one unit's trainable range, stepped at once."""

    state: UnitOptimState
    start: int
    end: int


_STATE_DICT_REFUSED = (
    "{call}: the Adam states of an infinity engine live in their tiers (host memory or the "
    "NVMe swap space), unit by unit, and may not fit in memory as one dict. Save and restore "
    "them with engine.save_checkpoint(dir) / engine.load_checkpoint(dir) (also the model, "
    "scheduler and counters), as with DeepSpeed")


class PartitionedOptimizer(GradientCollector, Speculation, StepReaping, torch.optim.Optimizer):
    """Adam/AdamW over offloaded, flat, per-unit states (a torch Optimizer for LR schedulers)."""

    def __init__(self, units: list[Unit], param_groups: list[dict], manager: TierManager, *,
                 optimizer_tier: Tier, grad_tier: Tier, early_step: bool, sub_group_numel: int,
                 master_separate: bool, staging_pool: BufferPool | None,
                 adamw_mode: bool = True, threads: int | None = None,
                 speculation: str = "off", defaults: dict | None = None) -> None:
        super().__init__(param_groups, defaults=dict(defaults or {}))
        self._groups_fixed = True    # see add_param_group
        # see [Note: speculative step] in optim/speculation.py
        self._init_speculation("off" if early_step else speculation)
        doubled = self.speculation != "off"
        self.manager = manager
        self.staging_pool = staging_pool
        # both schedules step through one stream (optim/step_stream.py)
        self._stream: StepStream | None = None
        self._grad_writes: list[tuple] = []   # deferred: (request, slot, buffer) in flight
        self._pending_steps: list[tuple[UnitOptimState, StepJob]] = []
        # units whose steps are over, not yet handed out by ``reap`` (reaped inside step() or
        # a roll-back, or by a wait that was interrupted)
        self._unclaimed: list[Unit] = []
        self._expected: dict[int, StepJob] = {}   # unit index -> early step read ahead
        # unit index -> deferred step waiting for its unit to be fetched (see [Note: the
        # deferred step lands at the next fetch] in step_stream.py)
        self._waiting: dict[int, StepJob] = {}
        # the unit indices in the order the next forward uses them (set by the engine)
        self.forward_order: Callable[[], list[int]] = list
        self._in_backward = False
        self.early_step = early_step
        self.adamw_mode = adamw_mode
        self.threads = threads
        self.timers = OptimTimers()
        self.clip_norm = 0.0
        self.last_grad_norm: float | None = None
        self.loss_scale = 1.0        # the fp16 loss scale the gradients carry (set by the engine)
        self.overflow = False        # the last step was skipped: its gradients were not finite
        self.step_failure: BaseException | None = None   # the first background step that failed
        self.on_zero_grad: Callable[[bool], None] | None = None   # the engine's zero_grad
        # the engine's step without its scheduler (a torch loop's optimizer.step()), and
        # whether the engine's own step is calling
        self.on_user_step: Callable[[], None] | None = None
        self.engine_stepping = False
        self._sq_norm = 0.0
        self._accumulate_chunk: torch.Tensor | None = None
        self._boundary = True
        self.states: list[UnitOptimState] = []
        trainable_units = [u for u in units if u.has_trainable]
        max_trainable = max((u.trainable_numel for u in trainable_units), default=0)
        # multiples of 2048 elements keep every sub-group 4 KiB aligned in fp32 and in 16-bit
        self.sub_group_numel = -(-max(1, min(sub_group_numel, max_trainable or 1)) // 2048) * 2048
        self._max_trainable = max_trainable
        for unit in trainable_units:
            n = unit.trainable_numel
            master = (manager.create(f"{unit.name}.master", n, torch.float32, optimizer_tier,
                                     doubled=doubled) if master_separate else None)
            grad_store = None if early_step else manager.create(
                f"{unit.name}.grad", n, torch.float32, grad_tier)
            self.states.append(UnitOptimState(
                unit, manager.create(f"{unit.name}.exp_avg", n, torch.float32, optimizer_tier,
                                     doubled=doubled),
                manager.create(f"{unit.name}.exp_avg_sq", n, torch.float32, optimizer_tier,
                               doubled=doubled),
                master, grad_store))
            if master is not None:
                self._init_master(unit, master)
        self._by_unit = {s.unit.index: s for s in self.states}
        # see [Note: held gradients]: a room of HELD_ROOM_UNITS (optim/held_room.py)
        self.holds_grads = (early_step or doubled) and gradients_held(manager.device)
        self.held_room = HeldRoom(held_room_bytes(max_trainable))
        needs_grad_buffer = (early_step and not self.holds_grads) or grad_tier is Tier.NVME
        self.grad_pool = BufferPool(manager, max_trainable * 4, GRADS_HELD, "gradient") \
            if needs_grad_buffer and max_trainable else None
        any_nvme = optimizer_tier is Tier.NVME or grad_tier is Tier.NVME or any(
            u.param_store is not None and not u.param_store.resident for u in trainable_units)
        param_tier = next((u.param_store.home for u in trainable_units if u.param_store is not None),
                          Tier.DEVICE)
        count = step_slot_count(optimizer_tier, param_tier, grad_tier, master_separate, early_step)
        self.step_pool = BufferPool(manager, self.sub_group_numel * 4, count, "optimizer") \
            if any_nvme and max_trainable else None
        self._stream = StepStream(self)

    # -- set-up ----------------------------------------------------------------------------
    def _init_master(self, unit: Unit, master: FlatStore) -> None:
        """Seed the fp32 master from the unit's current parameters."""
        was_released = unit.residency != Residency.FETCHED
        if was_released:
            unit.finish_fetch(self.manager, self.staging_pool)
        values = unit.flat[: unit.trainable_numel].float()
        if master.resident:
            master.tensor[: unit.trainable_numel].copy_(values)
        else:
            buf = self.manager.host_empty(master.padded, torch.float32, what="master init")
            buf[: unit.trainable_numel].copy_(values)
            self.manager.wait(master.store_async(buf))
        if was_released:
            unit.release(self.manager)

    def reload_master(self, unit: Unit) -> None:
        """The unit's parameters were changed by hand: make the fp32 master match them."""
        state = self._by_unit.get(unit.index)
        if state is not None and state.master is not None:
            self._init_master(unit, state.master)

    # -- gradients (called by the coordinator's hooks) -------------------------------------
    def on_unit_backward_done(self, unit: Unit) -> bool:
        """All of ``unit``'s gradients for this backward have arrived.

        Returns True when the unit may be released now; False when an early step of it is
        running in the background (see [Note: background early step]); ``reap`` then says when.
        """
        start = time.perf_counter()
        state = self._by_unit[unit.index]
        if self._can_speculate(state):
            try:
                self._speculate(state)
            finally:
                self.timers.grad_s += time.perf_counter() - start
            return False
        self._zero_unwritten(state)
        if self.early_step:
            gradient = self._take_gradient(state)
            params = self.take_arrived(state)
            job = self._expected.pop(unit.index, None)
            if job is not None:
                self._stream.make_ready(job, gradient, params=params)
            else:
                job = self._stream.submit(state, early=True, gradient=gradient, params=params)
            self._pending_steps.append((state, job))
            self.timers.grad_s += time.perf_counter() - start
            return False
        try:
            self._finish_grads(state)
        finally:
            self._drop_grad_buffer(state)
            state.grads_seen = 0
            self.timers.grad_s += time.perf_counter() - start
        return True

    def stream_stats(self) -> dict[str, int]:
        """Counters of the step stream's expected steps (see [Note: expected steps])."""
        return dict(self._stream.stats)

    def expect_backward(self, unit: Unit) -> None:
        """``unit``'s gradients are coming (early step, or a backward that speculates): its
        Adam states may be read ahead while the stream has slots to spare (see [Note: expected
        steps])."""
        state = self._by_unit.get(unit.index)
        steps_now = self._speculating if self._in_backward else self.plans_speculation()
        # (not while a deferred step of the unit waits: its reads would overtake that step)
        if not (self.early_step or steps_now) or state is None or unit.index in self._expected or \
                unit.index in self._waiting or \
                any(s is state and not j.stepped.done() for s, j in self._pending_steps):
            return
        self._expected[unit.index] = self._stream.expect(state)

    def cancel_expected(self) -> None:
        """The backward is over (or failed): units that got no gradients are not stepped."""
        for index, job in self._expected.items():
            self._stream.cancel(job)
            self._drop_grad_buffer(self._by_unit[index])
        self._expected.clear()

    def begin_backward(self, boundary: bool) -> None:
        """Called before each backward (see ``GradientCollector``); a speculation still pending
        from an earlier backward of this cycle was voided by the engine's forward."""
        super().begin_backward(boundary)
        self._in_backward = True
        self._speculating = boundary and self.plans_speculation() and not self._speculated

    def abandon_backward(self) -> None:
        """A backward raised: drop the gradients collected since the last step (this backward's
        partial ones, and with accumulation the earlier micro-steps' too), so the next step
        sees none of them. Early steps that already ran keep their update: they cannot be
        undone; speculated ones are rolled back (``take_rolled_back``)."""
        self._in_backward = self._speculating = False
        self.cancel_expected()
        try:
            if self._speculated:
                self._roll_back("the backward raised", rebuild_gradients=False)
            while self._grad_writes:
                self._retire_grad_write()
        finally:
            dropped = self._drop_cycle_gradients()
            log.warning("backward raised: the gradients of %d unit(s) collected since the last "
                        "optimizer step are dropped%s", dropped,
                        "; units already stepped in this backward keep their update"
                        if self.early_step else "")

    def end_backward(self) -> None:
        """Called by the engine after each backward: gradient writes land, and accumulation
        continues until a step."""
        self._in_backward = self._speculating = False
        self.cancel_expected()
        while self._grad_writes:
            self._retire_grad_write()

    # -- stepping --------------------------------------------------------------------------
    def _hyper(self, group_index: int) -> dict:
        g = self.param_groups[group_index]
        lr = g["lr"]
        return {"lr": float(lr), "beta1": g["betas"][0], "beta2": g["betas"][1], "eps": g["eps"],
                "weight_decay": g["weight_decay"], "bias_correction": g.get("bias_correction", True),
                "adamw_mode": g.get("adamw_mode", self.adamw_mode)}

    def hyperparameters(self) -> list[dict]:
        """Each param group's Adam hyperparameters now, for a step that runs later (a deferred
        step runs after the scheduler has moved the learning rate on)."""
        return [self._hyper(i) for i in range(len(self.param_groups))]

    def step_runs(self, state: UnitOptimState, stepped: frozenset[int] | None) -> list[StepRun]:
        """Count one step for the parameters in ``stepped`` (entry offsets; None: all) and
        return the runs the kernel steps: contiguous ranges of one param group whose
        parameters all take the same step (see [Note: parameters without a gradient]). With
        every parameter stepped every time there is one run per param group."""
        state.step += 1
        runs: list[StepRun] = []
        entries = sorted(state.unit.trainable_entries(), key=lambda e: e.offset)
        for entry in entries:
            if stepped is not None and entry.offset not in stepped:
                runs.append(None)             # a break: this parameter is not stepped
                continue
            count = state.param_steps.get(entry.offset, 0) + 1
            state.param_steps[entry.offset] = count
            last = runs[-1] if runs else None
            if last is not None and (last.group_index, last.step) == (entry.group_index, count):
                runs[-1] = StepRun(last.group_index, last.start, entry.offset + entry.numel, count)
            else:
                runs.append(StepRun(entry.group_index, entry.offset, entry.offset + entry.numel,
                                    count))
        return [r for r in runs if r is not None]

    def uncount_step(self, state: UnitOptimState, stepped: frozenset[int] | None) -> None:
        """Undo ``step_runs``' counting (a speculated step rolled back)."""
        state.step -= 1
        for entry in state.unit.trainable_entries():
            if stepped is None or entry.offset in stepped:
                state.param_steps[entry.offset] -= 1

    def _kernel(self, state: UnitOptimState, start: int, end: int, param: torch.Tensor,
                grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad_scale: float,
                half_out: torch.Tensor | None, hyper: list[dict], runs: list[StepRun],
                grad_sq_sum: bool = False) -> float:
        """Run Adam on elements [start, end) of the unit; tensors are indexed from ``start``;
        ``hyper`` per param group (``hyperparameters()`` when the step was asked for), ``runs``
        from ``step_runs``. Returns the stepped gradient's sum of squares (as given) when
        ``grad_sq_sum``, else 0."""
        total = 0.0
        for run in runs:
            a, b = max(run.start, start), min(run.end, end)
            if a >= b:
                continue
            for x, y, g in _grad_pieces(state.unit, grad, start, a, b):
                s = slice(x - start, y - start)
                total += adam_step_flat(
                    param[s], g, m[s], v[s], step=run.step, grad_scale=grad_scale,
                    half_out=None if half_out is None else half_out[s], threads=self.threads,
                    grad_sq_sum=grad_sq_sum, **hyper[run.group_index]) or 0.0
        return total

    def _sub_groups(self, state: UnitOptimState) -> list[SubGroup]:
        n = state.unit.trainable_numel
        return [SubGroup(state, a, min(a + self.sub_group_numel, n))
                for a in range(0, n, self.sub_group_numel)]

    def _store(self, store: FlatStore, tensor: torch.Tensor, start: int, count: int, reqs: list,
               shadow: bool = False):
        """Write back a loaded tensor (resident stores were updated in place, nothing to do;
        ``shadow``: to the store's shadow extent)."""
        if not store.resident:
            reqs.append((store.store_async(tensor, start, count, shadow), None))

    def grad_scale_for_clipping(self) -> float:
        """Divisor applied to gradients in the kernel: the loss scale, times the global-norm
        clipping factor when clipping acts (the norm is that of the unscaled gradients)."""
        norm = math.sqrt(self._sq_norm) / self.loss_scale
        self.last_grad_norm = norm
        if self.clip_norm > 0 and norm > self.clip_norm:
            return self.loss_scale * (norm + 1e-6) / self.clip_norm
        return self.loss_scale

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch API
        """Early schedule: wait until every unit's kernels have run. Deferred schedule: queue
        the step of every unit that received gradients, to run when the unit is next fetched
        (see [Note: the deferred step lands at the next fetch]). Called by a torch-style loop
        (``optimizer.step()``), it goes through the engine's step (``on_user_step``), which
        counts it and releases what the step held; the loop steps its scheduler itself."""
        if closure is not None:
            raise ValueError("PartitionedOptimizer.step does not take a closure")
        if self.on_user_step is not None and not self.engine_stepping:
            self.on_user_step()
            return None
        start = time.perf_counter()
        self.overflow = False
        try:
            if self.early_step:
                self._finish_early_steps()
            else:
                self._queue_deferred_steps()
        finally:
            self.timers.optimizer_s += time.perf_counter() - start

    def _queue_deferred_steps(self) -> None:
        self._collect_speculated_norms()
        if self._waiting:
            names = [self._by_unit[i].unit.name for i in self._waiting]
            raise RuntimeError(
                f"the previous deferred step of {len(names)} unit(s) ({', '.join(names[:3])}) "
                "has not run yet: step through Engine.step, which fetches and steps them first")
        for state in self.states:
            if state.has_grads and not state.norm_counted:
                # its last gradient of the cycle came before the last micro-step: at home
                self._sq_norm += sum(_sum_of_squares(v) for _, v in self._home_gradient(state))
        if not math.isfinite(self._sq_norm):
            # inf or NaN in a gradient (see optim/loss_scaler.py): the step is skipped
            self.overflow = True
            self.last_grad_norm = math.inf
            try:
                self._resolve_speculation(keep=False, overflow=True)
            finally:
                self._drop_cycle_gradients()
            return
        scale = self.grad_scale_for_clipping()
        self._resolve_speculation(keep=scale == self.loss_scale)   # no clipping acted
        position = {uid: i for i, uid in enumerate(self.forward_order())}
        stepped = [s for s in self.states if s.has_grads]
        for state in sorted(stepped, key=lambda s: position.get(s.unit.index, len(position))):
            state.has_grads = state.norm_counted = False
            # a forward between the backward and this step expected the next backward's units
            # (speculation planned): those reads are of the states this step is about to change
            stale = self._expected.pop(state.unit.index, None)
            if stale is not None:
                self._stream.cancel(stale)
            self._waiting[state.unit.index] = self._stream.expect(
                state, early=False, grad_scale=scale, params=self.take_arrived(state))

    def waiting_units(self) -> list[Unit]:
        """Units whose deferred step waits for them to be fetched, in the order queued."""
        return [self._by_unit[i].unit for i in self._waiting]

    def step_fetched(self, unit: Unit) -> bool:
        """``unit`` has just been fetched: run its waiting deferred step on the device copy and
        wait for its kernels. True when it did: the unit must stay fetched until ``reap``
        returns it (its writes go out from the device copy)."""
        job = self._waiting.pop(unit.index, None)
        if job is None:
            return False
        start = time.perf_counter()
        self._stream.make_ready(job)
        self._pending_steps.append((self._by_unit[unit.index], job))
        try:
            self.wait_stepped(unit)
        finally:
            self.timers.optimizer_s += time.perf_counter() - start
        return True

    def _finish_early_steps(self) -> None:
        """Wait until every unit's kernels have run (its device copy is the new parameters);
        writes still in flight go on behind the next forward (see [Note: writes behind the
        step]). The units whose writes have landed too wait for the next ``reap``."""
        self.wait_stepped()
        for _, job in self._pending_steps:
            self._collect_norm(job)
        # the kernels summed each unit's gradient squares as they stepped it: the norm no
        # step of this schedule needs, but get_global_grad_norm() reports
        self.last_grad_norm = math.sqrt(self._sq_norm) / self.loss_scale
        self._unclaimed.extend(self.reap())

    # -- state dict ------------------------------------------------------------------------
    def state_dict(self):  # noqa: D401 - torch API
        """Refused: the Adam states live in their tiers (NVMe, host), possibly larger than
        memory; torch's empty dict would restore as a silent reset of Adam."""
        raise RuntimeError(_STATE_DICT_REFUSED.format(call="optimizer.state_dict()"))

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError(_STATE_DICT_REFUSED.format(call="optimizer.load_state_dict()"))

    def add_param_group(self, param_group: dict) -> None:
        """Only while the optimizer is built: each parameter's states, sub-groups and unit are
        laid out at ``initialize``, so a group added later would never be stepped."""
        if getattr(self, "_groups_fixed", False):
            raise ValueError(
                "optimizer.add_param_group() after infinity.initialize: the engine lays out the "
                "optimizer states of every parameter it trains at initialize, so the new group "
                "would never be stepped. Give every group to infinity.initialize "
                "(model_parameters=[...]); to start training more of the model later, "
                "save_checkpoint, build a new engine with the new groups and load_checkpoint "
                "with load_optimizer_states=False")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients never live on the parameters, but the ones collected since the last step
        are discarded, as torch's zero_grad between a backward and a step does: the engine's
        ``zero_grad`` (``on_zero_grad``) knows the schedule's rules."""
        if self.on_zero_grad is not None:
            self.on_zero_grad(set_to_none)

    def holds_cycle_gradients(self) -> bool:
        """Whether a backward since the last step left gradients (or a speculated step) here."""
        return self.speculation_pending or any(s.grads_seen or s.has_grads for s in self.states)

    def discard_cycle_gradients(self) -> None:
        """zero_grad between a backward and a step: forget this cycle's gradients and roll a
        speculated step back (the engine then drops the rolled-back device copies)."""
        self.cancel_expected()
        if self._speculated:
            self._roll_back("zero_grad() discarded the gradients", rebuild_gradients=False)
        while self._grad_writes:
            self._retire_grad_write()
        dropped = self._drop_cycle_gradients()
        log.info("zero_grad(): the gradients of %d unit(s) collected since the last step are "
                 "discarded", dropped)

    def close(self) -> None:
        try:
            while self._grad_writes:
                self._retire_grad_write()
            if self._stream is not None:
                try:
                    self.drain()
                finally:
                    self._stream.shutdown()
        finally:
            for state in self.states:
                for store in (state.exp_avg, state.exp_avg_sq, state.master, state.grad_store):
                    if store is not None:
                        store.free()
