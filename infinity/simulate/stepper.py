"""The optimizer as the coordinator sees it (``zero.protocols.UnitStepper``), on the dry run's
simulated clock: which units a step holds and when it lets them go, what it reads and writes.

This is a model of ``optim.partitioned.PartitionedOptimizer`` and its step stream, not the
code itself (that one runs the Adam kernel over real slots). What it keeps of them, from their
notes in optim/step_stream.py:

* early step (and a speculative step, which runs in the backward the same way): a unit whose
  gradients are complete is stepped in the background and stays fetched until the writes of
  its parameters and Adam states have landed (``on_unit_backward_done`` returns False, ``reap``
  hands it back); the states of the units whose backward comes next are read ahead
  (``expect_backward``); ``step()`` waits for every unit's kernels;
* deferred step: gradients go home (written to NVMe when their tier is NVMe) and the unit is
  released; ``step()`` queues every unit's step in the next forward's order with its states
  read ahead, and the forward's fetch of a unit runs it on the fetched copy
  (``step_fetched``), waiting for its kernels; the writes land behind. On a GPU a unit's step
  starts as soon as its copy to the device is issued (``step_ahead``; [Note: the deferred step
  runs ahead of the forward] in zero/steps_ahead.py);
* on a GPU a stepped unit's 16-bit values cross to its device copy on the "H2D" lane after
  its Adam, and the unit counts as stepped when they have;
* deferred step with ``boundary_steps``: the last micro-batch's backward steps each unit with
  a resident gradient home as an early step does, after its gradient's add; ``step()`` waits
  for their kernels and queues the others ([Note: the last micro-batch steps early] in
  optim/boundary_steps.py);
* deferred step, one rank, a resident gradient home: each micro-batch's gradient is added into
  the home after its copy, on the "host adds" lane at the host's memory bandwidth (the adder
  thread's on a GPU, going on behind the next micro-batch, the step waiting for the last; on
  a CPU device the training thread's, at the copy); on a GPU the last micro-batch's adds of a
  unit stepped in that backward are folded into its step, only the staged gradient read.

Per unit the job is coarse (the stream's sub-groups are not modelled): its reads on the disk
lane, its Adam on one CPU lane (the step stream's thread), its writes on the disk lane. The
states are the optimizer's stores in the unit's format (``planner.state_format.unit_stores``,
as ``optim.state_formats.build_state`` makes them): m and v in fp32, bf16 or int8 codes, an
fp32 master where one is kept, the int8 scales in host memory (never read or written).
Gradients leave the device (a GPU's; on a CPU device the copies are free) when a unit's
backward and its reduce-scatter are over: the rank's range of the gradient, in its home's
dtype, is copied to the host (``manager.copies.to_host``, the "D2H" row), and the unit's CPU
Adam, or the gradient's write to NVMe, or the deferred step's read of it, starts after that
copy's end ([Note: copy events] in storage/transfers.py: the host reads a gradient only after
its copy's event). The optimizer on the device keeps them there (no copy). With several ranks
on a GPU the unit's gradient is reduced in a device buffer of the communication dtype
(``communication_data_type``, unset the compute dtype: ``comm_dtype``) and only the rank's
range of it is copied, in that dtype whatever the home's (widened on the host at the wait, not
modelled: [Note: gradients reduced on the device] in optim/device_gradients.py); the buffers
are device bytes the backend reserves. A CPU device reduces in fp32 on the host.
The buffers are also a schedule: the stepper takes them from the optimizer's own pool
(``optim.device_gradients.DeviceGradientPool``, ``device_grad_buffers`` kept, the plan's
count, made at the first backward in the device budget) over the clock's copies, so the choice
of buffer and the waits are the engine's: a unit takes one at its first gradient and gives it
back at its reduce with its shard's copy out, and the part of a buffer that copy reads is
written again only after its end (a "compute waits" span labelled with the unit whose copy out
it waits for). The copy reads the shard at the buffer's back, so a scattered unit's gradients
fill the front while it runs and only the reduce waits: with one buffer a unit's reduce starts
no earlier than the copy out of the unit before it, with two of the one two units back. At
stage 0 the copy reads the front (the all-reduced values), and a unit's first gradient waits:
the engine's at that gradient, partway into its backward, the dry run's before the whole
backward (at most the backward before that gradient more than the engine waits). A unit
finding every kept buffer collecting (a tied weight's) gets one beyond them, or the engine's
error where the budget has no room.
``instant``: every job lands when it is submitted (a step that costs nothing), so the schedule
no longer depends on timing: the order tests compare this with a real engine whose background
steps are waited for at each reap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from infinity.optim.device_gradients import (
    DeviceGradient,
    DeviceGradientPool,
    buffer_numels,
    pool_buffer_numel,
)
from infinity.optim.gradients import FOLDING_UNITS
from infinity.optim.state_formats import MOMENT_DTYPES
from infinity.planner.state_format import (
    FP32_STATES,
    StateFormat,
    keeps_fp32_master,
    unit_format,
    unit_stores,
)
from infinity.planner.step_time import adam_rate_factor
from infinity.simulate.clock import Lane
from infinity.simulate.collectives import SimCollectives
from infinity.simulate.copies import SimCopies, SimCopyEvent
from infinity.simulate.storage import META, SimManager, SimStore
from infinity.planner.tiers import Tier
from infinity.zero.protocols import Wait
from infinity.zero.unit import Unit

__all__ = ["SimStepper", "HOST_ADDS"]

HOST_ADDS = "host adds"
"""The timeline row of the gradient adds into resident host homes."""


@dataclass
class _Job:
    unit: Unit
    reads_end: float
    kernel_end: float = -1.0
    adam_end: float = -1.0      # the kernel's own end (kernel_end: its device-copy write's)
    landed: float = -1.0

    @property
    def stepped(self) -> bool:
        return self.kernel_end >= 0


class SimStepper:
    """The optimizer's schedule on ``manager``'s clock (see the module docstring)."""

    def __init__(self, units: list[Unit], manager: SimManager, *, early: bool, speculative: bool,
                 opt_tier: Tier, grad_tier: Tier, master_separate: bool, adam_params_per_s: float,
                 comm: SimCollectives, grads_held: bool, backward_s: Callable[[Unit], float],
                 instant: bool = False, grad_dtype: torch.dtype = torch.float32,
                 state_format: StateFormat = FP32_STATES,
                 comm_dtype: torch.dtype = torch.float32, device_grad_buffers: int = 0,
                 scatter: bool = False, host_add_Bps: float = 0.0,
                 boundary_steps: bool = False) -> None:
        self.manager, self.clock = manager, manager.clock
        # several ranks: the dtype of the reduce and of the shard's copy to the host
        self.comm_dtype = comm_dtype
        if device_grad_buffers < 0:
            raise ValueError(f"device_grad_buffers is {device_grad_buffers}: expected >= 0 "
                             "(0: gradients are not reduced in device buffers)")
        # a manager with immediate copies (not the dry run's): free, as SimCopies at rate 0
        self.copies = manager.copies if isinstance(manager.copies, SimCopies) else \
            SimCopies(self.clock, 0.0)
        # the device gradient buffers (several ranks on a GPU; None: the host path), the
        # optimizer's own pool; ``scatter``: reduce-scattered (stages 1-3), else all-reduced
        self.scatter = scatter
        trainable = [u for u in units if u.has_trainable]
        self.device_pool: DeviceGradientPool | None = None
        if device_grad_buffers and comm.active and trainable:
            self.device_pool = DeviceGradientPool(
                manager, self.copies, pool_buffer_numel(trainable, scatter),
                count=device_grad_buffers, dtype=comm_dtype)
        self._device: dict[int, DeviceGradient] = {}   # unit -> the buffer it collects in
        self.buffer_wait_s = 0.0
        """Seconds compute waited for a device gradient buffer's copy out."""
        self.early_like = early or speculative     # stepped during the backward
        self.early, self.speculative = early, speculative
        # deferred, the last micro-batch's backward steps the units with a resident gradient
        # home ([Note: the last micro-batch steps early] in optim/boundary_steps.py)
        self.boundary_steps = boundary_steps and not self.early_like
        self._boundary = False
        self._stepped_at_boundary: set[int] = set()
        self.comm = comm
        self.instant = instant
        self.grads_held = grads_held
        self.backward_s = backward_s
        # the rate is fp32 states' (DryRunRates): the format's kernel sets it (step_time)
        self.adam = Lane(self.clock, float("inf") if instant else
                         adam_params_per_s * adam_rate_factor(state_format), "CPU Adam")
        # a gradient added into its resident host home (deferred, one rank): on a GPU by the
        # copies' adder thread as its copy lands, on a CPU device at the copy, on the training
        # thread; ``host_add_Bps`` the bytes it moves a second (0: free)
        self.host_adds = Lane(self.clock, float("inf") if instant else host_add_Bps,
                              HOST_ADDS)
        self._adds_end = 0.0
        # this backward's units whose last adds wait for their steps: when each step ends
        self._folding_until: dict[int, float] = {}
        if host_add_Bps > 0 and not instant:
            self.host_adds.share(self.adam)     # the same cores and memory bandwidth
        self.states: dict[int, list[SimStore]] = {}
        self.scales: dict[int, list[SimStore]] = {}   # int8 scales: host memory, not moved
        self.masters: set[int] = set()                # units with a separate fp32 master
        self.grad_stores: dict[int, SimStore] = {}
        # gradients go to the host for a CPU Adam (or a host or NVMe gradient home)
        self.grads_leave = opt_tier is not Tier.DEVICE or grad_tier is not Tier.DEVICE
        self.grad_dtype = grad_dtype
        self.grad_numel: dict[int, int] = {}         # unit -> the range its gradient copies
        self.grad_landed: dict[int, float] = {}      # unit -> when its copy to the host ends
        for unit in units:
            if not unit.has_trainable:
                continue
            # the range this rank steps, as the optimizer takes it (optim.partitioned)
            t = unit.trainable_numel
            lo = min(unit.shard_start, t) if unit.shards > 1 else 0
            span = min(unit.shard_start + unit.shard_numel, t) - lo if unit.shards > 1 else t
            n = max(1, span)
            self.grad_numel[unit.index] = n
            fmt = unit_format([state_format], t)      # per unit, as build_state decides
            master = keeps_fp32_master(fmt, master_separate=master_separate,
                                       compute_itemsize=unit.dtype.itemsize)
            if master:
                self.masters.add(unit.index)
            stores = unit_stores(fmt, n, fp32_master=master)
            self.states[unit.index] = [
                manager.create(f"{unit.name}.{st.name}", st.numel,
                               torch.float32 if st.name == "master" else MOMENT_DTYPES[fmt.moments],
                               opt_tier, doubled=speculative)
                for st in stores if not st.in_host]
            self.scales[unit.index] = [
                manager.create(f"{unit.name}.{st.name}", st.numel, torch.float32, Tier.HOST)
                for st in stores if st.in_host]
            if not early:
                self.grad_stores[unit.index] = manager.create(f"{unit.name}.grad", n,
                                                              grad_dtype, grad_tier)
        self.jobs: dict[int, _Job] = {}         # stepping: held until landed
        self.expected: dict[int, float] = {}    # unit -> when its states' reads are through
        self.waiting: list[Unit] = []           # deferred steps queued for the next fetch
        self._seen: set[int] = set()            # units whose gradients began this backward
        self.held_bytes = 0
        self.held_peak = 0
        self._held: dict[int, int] = {}

    # -- what a job moves -----------------------------------------------------------------
    def _read_states(self, unit: Unit) -> float:
        end = self.clock.now
        for store in self.states[unit.index]:
            if not store.resident:
                end = max(end, self._req(store.read_bytes(store.nbytes)))
        grad = self.grad_stores.get(unit.index)
        if grad is not None and not grad.resident and not self.early_like:
            end = max(end, self._req(grad.read_bytes(grad.nbytes)))
        return end

    def _req(self, request) -> float:
        return self.clock.now if self.instant else request.end

    def _run(self, job: _Job) -> None:
        """Adam after the reads, then the writes of the parameters and the states."""
        unit = job.unit
        # the gradient is read on the host after its copy's event (``_gradient_to_host``)
        start = max(job.reads_end, self.clock.now, self.grad_landed.pop(unit.index, 0.0))
        # the rank's range (its shard with several ranks), at the rank's share of the node's rate
        job.adam_end = self.adam.schedule(self.grad_numel[unit.index], not_before=start,
                                          what=f"step {unit.name}")
        job.kernel_end = job.adam_end
        if self.instant:
            job.kernel_end = job.adam_end = self.clock.now
        elif self.copies.overlaps_compute and unit.index in self.masters:
            # the 16-bit result goes to the device copy on the host-to-device copies, and the
            # unit is stepped once they landed ([Note: the device copy written behind the step]
            # in optim/device_copy.py); the job is coarse: its copies are issued after its
            # kernels, from the step stream's thread (not ahead of the copies the training
            # thread issues before then)
            nbytes = self.grad_numel[unit.index] * unit.dtype.itemsize
            job.kernel_end = self.copies.h2d.reserve(
                nbytes, at=job.kernel_end, what=f"stepped {unit.name} {nbytes / 2**20:.1f} MiB")
        end = job.kernel_end
        store = unit.param_store
        if store is not None and not store.resident:
            nbytes = store.nbytes       # written once (a speculative step: to the shadow)
            end = max(end, self._req(store.write_bytes(nbytes, not_before=job.kernel_end)))
        for state in self.states[unit.index]:
            if not state.resident:
                end = max(end, self._req(state.write_bytes(state.nbytes,
                                                           not_before=job.kernel_end)))
        job.landed = self.clock.now if self.instant else end
        self._drop_held(unit)

    def _drop_held(self, unit: Unit) -> None:
        self.held_bytes -= self._held.pop(unit.index, 0)

    # -- the coordinator's UnitStepper -----------------------------------------------------
    def _take_buffer(self, unit: Unit) -> None:
        """``unit``'s first gradient takes a device gradient buffer from the pool, compute
        waiting for the copy out of its last shard if that is not over."""
        before = self.clock.now
        self._device[unit.index] = self.device_pool.acquire(
            *buffer_numels(unit, self.scatter), what=f"{unit.name} gradient")
        self.buffer_wait_s += self.clock.now - before

    def on_grad(self, unit: Unit, entry, grad) -> None:
        if unit.index not in self._seen:
            self._seen.add(unit.index)
            if self.device_pool is not None:
                self._take_buffer(unit)
            self.clock.compute(self.backward_s(unit), f"backward {unit.name}")   # made them
        if self.grads_held:
            nbytes = grad.numel() * grad.element_size()
            self._held[unit.index] = self._held.get(unit.index, 0) + nbytes
            self.held_bytes += nbytes
            self.held_peak = max(self.held_peak, self.held_bytes)

    def _gradient_to_host(self, unit: Unit) -> float:
        """The unit's gradient (the rank's range, in its home's dtype) copied to the host
        now; when it has landed (the clock's now when it stays on the device)."""
        n = self.grad_numel.get(unit.index)
        if not self.grads_leave or n is None:
            return self.clock.now
        # several ranks: the reduced shard leaves the device buffer in the communication dtype
        dtype = self.comm_dtype if self.comm.active else self.grad_dtype
        grad = torch.empty(n, dtype=dtype, device=META)
        with self.copies.for_unit(unit.name):
            event = self.copies.to_host(grad, grad)
        self.grad_landed[unit.index] = event.end
        return event.end

    def on_unit_backward_done(self, unit: Unit) -> bool:
        device = self._device.pop(unit.index, None)
        if device is not None:     # the reduce writes it after a copy out still reading it
            before = self.clock.now
            self.device_pool.before_reduce(device)
            self.buffer_wait_s += self.clock.now - before
        self.comm.reduce_scatter(unit.flat_numel * self.comm_dtype.itemsize)
        landed = self._gradient_to_host(unit)
        if device is not None:     # given back: written again after its shard's copy out
            n = self.grad_numel.get(unit.index, 0)
            reads = device.shard[:n] if self.scatter else device.values[:n]
            copied_out = SimCopyEvent(self.clock, landed, f"the copy out of {unit.name}'s "
                                      "gradient shard (its device gradient buffer)")
            self.device_pool.release(device, copied_out, reads)
        if self.early_like:
            reads = self.expected.pop(unit.index, None)
            job = _Job(unit, reads if reads is not None else self._read_states(unit))
            self._run(job)
            self.jobs[unit.index] = job
            return False
        grad = self.grad_stores.get(unit.index)
        if grad is not None and not grad.resident:
            grad.write_bytes(grad.nbytes, not_before=landed)
        elif grad is not None and self.grads_leave and not self.comm.active:
            folded = self._folds(unit)
            landed = self._add_into_home(unit, landed, folded=folded)
            if folded:
                self._folding_until[unit.index] = float("inf")   # until its step ends
        self._drop_held(unit)
        if self._takes(unit):        # stepped now, as an early step, from its home
            self.grad_landed[unit.index] = landed
            reads = self.expected.pop(unit.index, None)
            job = _Job(unit, reads if reads is not None else self._read_states(unit))
            self._run(job)
            if unit.index in self._folding_until:
                self._folding_until[unit.index] = job.adam_end
            self.jobs[unit.index] = job
            self._stepped_at_boundary.add(unit.index)
            return False
        return True

    def _takes(self, unit: Unit) -> bool:
        """The backward in progress steps ``unit`` once its gradient is complete."""
        grad = self.grad_stores.get(unit.index)
        return self._boundary and grad is not None and grad.resident

    def _folds(self, unit: Unit) -> bool:
        """The unit's last adds are left to its step (``GradientCollector._folding_now``): on a
        GPU, in the backward whose steps take it, while fewer than ``FOLDING_UNITS`` units of
        that backward hold adds their steps have not yet read. The engine decides at the unit's
        first add; here at its backward's end, the add's issue."""
        if not (self._takes(unit) and self.copies.overlaps_compute):
            return False
        holding = sum(1 for end in self._folding_until.values() if end > self.clock.now)
        return holding < FOLDING_UNITS

    def _add_into_home(self, unit: Unit, landed: float, folded: bool = False) -> float:
        """The unit's gradient added into its resident home after its copy: read in the
        compute dtype, the fp32 home read and written ([Note: host adds off the training
        thread] in storage/host_adds.py). The step waits for the last one. ``folded``: the
        step the unit is taken by folds it into its kernel ([Note: the last adds fold into
        the step] in optim/boundary_steps.py) on a GPU: only the staged gradient is read, on
        the same resource (the lanes are shared)."""
        n = self.grad_numel[unit.index]
        per = unit.dtype.itemsize + (0 if folded and self.copies.overlaps_compute else 8)
        into = " in its step" if folded and self.copies.overlaps_compute else ""
        end = self.host_adds.schedule(n * per, not_before=landed,
                                      what=f"add {unit.name}'s gradient{into}")
        if self.copies.overlaps_compute:
            self._adds_end = max(self._adds_end, end)
        else:
            self.clock.wait_until(end, "adds a gradient into its home")
        return end

    def expect_backward(self, unit: Unit) -> None:
        if (self.early_like or self._takes(unit)) and unit.index in self.states \
                and unit.index not in self.expected and unit.index not in self.jobs:
            self.expected[unit.index] = self._read_states(unit)

    def _run_waiting(self, unit: Unit) -> _Job | None:
        """Run ``unit``'s waiting deferred step now; None when none waits."""
        at = next((i for i, waiting in enumerate(self.waiting) if waiting is unit), None)
        if at is None:
            return None
        del self.waiting[at]
        job = self.jobs[unit.index]
        self._run(job)
        return job

    def step_fetched(self, unit: Unit) -> bool:
        job = self._run_waiting(unit)
        if job is None:
            return False
        self.clock.wait_until(job.kernel_end)
        return True

    def step_ahead(self, unit: Unit) -> bool:
        return unit.index in self.masters and self._run_waiting(unit) is not None

    def wait_stepped(self, unit: Unit | None = None) -> None:
        for job in list(self.jobs.values()):
            if (unit is None or job.unit is unit) and job.stepped:
                self.clock.wait_until(job.kernel_end)

    def reap(self, wait: Wait = Wait.NONE) -> list[Unit]:
        stepped = [j for j in self.jobs.values() if j.stepped]
        if wait is Wait.ALL and stepped:
            self.clock.wait_until(max(j.landed for j in stepped))
        elif wait is Wait.ONE and stepped and all(j.landed > self.clock.now for j in stepped):
            self.clock.wait_until(min(j.landed for j in stepped))
        done = [j for j in stepped if j.landed <= self.clock.now]
        for job in done:
            del self.jobs[job.unit.index]
        return [job.unit for job in done]

    def drain(self) -> list[Unit]:
        self.waiting.clear()
        self.jobs = {i: j for i, j in self.jobs.items() if j.stepped}
        return self.reap(Wait.ALL)

    # -- the engine's calls ---------------------------------------------------------------
    def begin_backward(self, boundary: bool = True) -> None:
        """``boundary``: the cycle's last micro-batch."""
        self._seen.clear()
        self._boundary = self.boundary_steps and boundary
        self._folding_until.clear()

    def end_backward(self) -> None:
        self.expected.clear()     # units that got no gradients are not stepped
        self._boundary = False

    def step(self, forward_order: list[int], units: list[Unit]) -> None:
        """Early: every unit's kernels have run. Deferred: queue the steps in the next
        forward's order, their states read ahead now."""
        if self.early_like:
            self.wait_stepped()
            return
        # the gradients the step reads are complete (the adds went on behind the forwards)
        self.clock.wait_until(self._adds_end, "waits for the gradients' copies and adds")
        if self._stepped_at_boundary:       # their kernels, as the early step's
            self.wait_stepped()
        stepped, self._stepped_at_boundary = self._stepped_at_boundary, set()
        position = {uid: i for i, uid in enumerate(forward_order)}
        for unit in sorted((u for u in units if u.index in self.states
                            and u.index not in stepped),
                           key=lambda u: position.get(u.index, len(position))):
            self.jobs[unit.index] = _Job(unit, self._read_states(unit))
            self.waiting.append(unit)

    def waiting_units(self) -> list[Unit]:
        return list(self.waiting)

