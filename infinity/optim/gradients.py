"""How gradients reach the optimizer: collected parameter by parameter from the coordinator's
hooks, accumulated in fp32 (in a HOST gradient store, or a transient host buffer written to
NVMe), normed for clipping and overflow, handed to an early step, or dropped.

[Note: held gradients]
In the early step on a CPU device a unit's gradients are not copied anywhere: the tensors
autograd produced are held, by parameter, until the unit's step has run, and the Adam kernel
reads them piece by piece. Copying them into one flat buffer cost the training thread about
0.7 s a step at 0.49B (2 GB read and written on the cores backward computes on). They are held
in the dtype autograd made them (bf16 under bf16 compute; the kernels widen 16-bit gradients in
registers, exactly): widening them to fp32 here was a fresh fp32 tensor per parameter, 1.9 GB
of new pages to fault and zero a step at 0.49B, and twice the held bytes. Held gradients
are counted in their own bytes against a room of one unit's gradient (``HELD_ROOM_UNITS``; the host
budget keeps two units' worth, the room and the part that waits for it): a part that does not
fit waits for a background step to free the parts it has stepped (see optim/held_room.py). On
CUDA the gradients are on the device and go through ``GRADS_HELD`` flat host buffers (copied
there as [Note: gradients leave the device] says; ``_hold_grad`` refuses another device). Both
counts live in planner/engine_sizes.py, which sizes the host budget by them.

[Note: gradients leave the device]
A gradient that is not held goes to its host buffer (or its resident home) through the copies'
owner (storage/transfers.py ``to_host``): on a GPU on the device-to-host stream, overlapped with
the rest of backward; with several ranks on a GPU only the unit's reduced shard makes that
copy, one per unit, issued by ``reduce`` (see [Note: gradients reduced on the device]). Each
copy's event is kept in the unit's gradient (``BackwardGradient.copies``) and
``copies_landed`` waits for them all, the one wait before the training thread reads the unit's
gradient, writes its buffer, or gives its slot back (reduce, finish, home_gradient,
drop_buffer and so drop_cycle: ``BackwardGradient.release`` waits first as well); ``end_backward``
lands every unit's (see [Note: copy events] and [Note: the life of a backward gradient] in
optim/backward_gradient.py).
``zero_unwritten`` does not wait: it zeroes only bytes no copy writes (the gaps, the
parameters that got no gradient; every copy goes to a parameter of its ``written``).

The early step's gradient is not read on the training thread at all: ``take`` hands the
unit's events over with the gradient (``CompleteGradient.landing``) and returns without
waiting, and the step stream waits for them (``CompleteGradient.landed``) before its first
kernel reads the gradient, and again (at once) before its slot goes back (``give_back``). A
wait at ``take`` would block the training thread at every unit until the device had run the
backward kernels the copy is queued behind, so it could not run ahead to queue the next units'
backward; now the CPU Adam starts on a unit when its copies have landed and the training thread
never waits for them. Where the training thread does read the gradient, the wait stays there:
with several ranks on a CPU device ``reduce`` (the collective reads the host buffer; ``take``
then finds no events; on a GPU the collective reads the device buffer, so ``reduce`` waits for
nothing and the shard's copy event goes on to ``take`` or ``finish``), and in the deferred
schedule, speculated or not, ``finish`` where it reads the gradient: to add it to a shard or
to what its NVMe home holds, to write it home, and to sum the clipping norm and the overflow
check at the boundary before any step can apply them. One rank's gradient in a resident home
(host memory, the deferred schedule) is not read there: its copies (on a GPU, adds made by the
copies' adder thread as they land; see [Note: host adds off the training thread] in
storage/host_adds.py) go into the home itself, ``finish`` keeps their events in the collector
without waiting (``home_copies_landed`` waits for them where a home is read: ``home_gradient``,
``drop_cycle``, a ``finish`` that reads the home, ``land_copies`` at the step), and its norm
is summed at the step, from the home, like that of a unit whose last gradient came before the
last micro-step. Waiting there made every unit's backward hook synchronize with the GPU and add
on the training thread while no kernel was queued. The end of a backward does not wait for
them either (``land_copies(homes=False)``): the next forward reads no home, and the adds of
the next backward into a home are made after these, in the order issued; on the H200 that wait
was ~10 ms of idle GPU between each micro-batch's backward and the next forward. Their number
is bounded (``HOME_COPIES_IN_FLIGHT`` units): each holds its staging until its add is made.
The early step has neither clipping nor an overflow check (the planner allows it only without them); the norm it reports
is summed by the kernels on the step stream, after the wait.

[Note: gradients over ranks]
With several data-parallel ranks a unit's gradient is collected whole in a flat buffer (never
held, never straight into a resident home: the home holds only the own shard), and when the
unit's backward is done it is averaged over the ranks: reduce-scatter into the own shard at
stages 1-3, all-reduce of the whole trainable range at stage 0. Where the buffer is depends on
the device: on a GPU it is a device buffer of the communication dtype (DeepSpeed's
``communication_data_type``, unset the gradients' own), reduced there, and only the own shard
(the trainable range at stage 0) is copied to the unit's host buffer, a 16-bit one widened to
fp32 there by whoever waits for its copy (see [Note: gradients reduced on the device] in
optim/device_gradients.py); on a CPU device it is the fp32 host buffer itself,
every gradient copied (or added) into it and the shard landing at its front. Which parameters
got a gradient is OR-ed over ranks (a parameter is stepped if any rank gave it one). From there
the shard is what a single rank's whole gradient was: added to its home, normed (the global
norm sums the ranks' squares at the step), or handed to an early step.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from infinity.comm.collectives import NO_COMM, Collectives
from infinity.optim import device_gradients
from infinity.optim.backward_gradient import GradientOwners
from infinity.optim.device_gradients import DeviceGradient, DeviceGradientPool
from infinity.optim.grad_norm import NATIVE_GRAD_DTYPES, sum_of_squares
from infinity.optim.held_room import HeldRoom
from infinity.optim.records import CompleteGradient, OptimTimers, UnitOptimState
from infinity.planner.engine_sizes import accumulate_chunk_numel
from infinity.storage.buffer_pool import BufferPool, Slot
from infinity.storage.manager import TierManager
from infinity.storage.transfers import DONE, CopyEvent
from infinity.zero.protocols import SteppedUnit
from infinity.zero.unit import ParamEntry


FOLDING_UNITS = 4
"""Units whose last adds into their resident homes may wait to be folded into their steps at
once (see [Note: the last adds fold into the step] in optim/boundary_steps.py): each holds its
last micro-batch's gradient in pinned staging until its step's kernel has read it, memory the
host budget does not count; a unit beyond them has its adds made by the adder thread, as in the
earlier micro-batches. Four 101 MB layers of the 0.49B model's: the step stream was up to ~8
units behind the last backward on the fourth H200 pass, before its writes had a stream of their
own."""

HOME_COPIES_IN_FLIGHT = 2
"""Units whose copies (adds) into their resident gradient homes may be in flight at once (see
[Note: gradients leave the device]). On a GPU each add holds its gradient's pinned staging
until the adder has made it (storage/host_adds.py), memory the host budget does not count: a
whole backward's gradients if nothing waited. A third unit's ``finish`` waits for the oldest's,
two units back in the backward, whose copy and add are over unless the host is behind; the
GPU still has the two units' kernels queued meanwhile."""


def _never() -> bool:
    return False


def gradients_held(device: torch.device) -> bool:
    """Whether an early step holds autograd's gradients as they are (see [Note: held
    gradients]): on a CPU device; elsewhere they are copied to a host buffer."""
    return device.type == "cpu"


class GradientCollector:
    """The gradients of every unit's state, from the coordinator's hooks to a step: owned by the
    optimizer; ``steps_running`` says whether a background step may still give room or slots
    back, ``speculates`` whether a unit's step this backward is speculated."""

    def __init__(self, states: list[UnitOptimState], manager: TierManager, *, early_step: bool,
                 holds_grads: bool, grad_pool: BufferPool | None, held_room: HeldRoom,
                 timers: OptimTimers, max_trainable: int, steps_running: Callable[[], bool],
                 speculates: Callable[[UnitOptimState], bool], comm: Collectives = NO_COMM,
                 scatter: bool = False, device_buffers: int | None = None,
                 device_dtype: str = "fp32",
                 folds: Callable[[UnitOptimState], bool] = lambda state: False) -> None:
        self.states = states
        self._by_unit = {s.unit.index: s for s in states}
        self.manager = manager
        self.copies = manager.copies     # see [Note: gradients leave the device]
        self.early_step = early_step
        self.holds_grads = holds_grads
        self.grad_pool = grad_pool
        self.held_room = held_room
        self.timers = timers
        self._max_trainable = max_trainable
        self._steps_running = steps_running
        self._speculates = speculates
        self.sq_norm = 0.0       # sum of squares of this cycle's gradients (clipping, overflow)
        self.boundary = True     # the backward in progress is the cycle's last micro-step
        self._writes: list[tuple] = []   # deferred: (request, slot, buffer) in flight
        # copies into resident homes this backward, waited where a home is read (see [Note:
        # gradients leave the device])
        self._home_copies: dict[int, list[CopyEvent]] = {}     # by unit index, in order
        # whether a unit's adds into its home in this backward fold into its step, and the
        # units whose folded adds are not made yet (see [Note: the last adds fold into the
        # step] in optim/boundary_steps.py)
        self._folds = folds
        self._folding: set[int] = set()
        self._not_folding: set[int] = set()     # this backward's units whose adds do not fold
        self._chunk: torch.Tensor | None = None
        # see [Note: gradients over ranks]: reduce-scatter (``scatter``) or all-reduce
        self.comm = comm
        self.reduces = comm.active
        self.scatter = scatter and comm.active
        # see [Note: gradients reduced on the device]: on a GPU (the module's function, looked
        # up here so that tests can force the path on a CPU device) the unit's gradient is
        # collected and reduced in a device buffer, and only the own shard goes to the host
        self.device_pool: DeviceGradientPool | None = None
        if self.reduces and states and device_gradients.reduces_on_device(manager.device):
            numel = device_gradients.pool_buffer_numel((s.unit for s in states), self.scatter)
            self.device_pool = DeviceGradientPool(
                manager, self.copies, numel, dtype=device_gradients.COMM_DTYPES[device_dtype],
                **({} if device_buffers is None else {"count": device_buffers}))

    def collect_numel(self, unit: SteppedUnit) -> int:
        """Elements of the flat buffer a unit's gradient is collected in: its trainable range,
        or every shard of its flat buffer when the gradient is reduce-scattered."""
        return device_gradients.buffer_numels(unit, self.scatter)[0]

    def begin_backward(self, boundary: bool) -> None:
        """Called before each backward: ``boundary`` is True on the last micro-step."""
        self.boundary = boundary
        # the adds a previous backward left to its steps are made (stepped, or waited for by
        # step() or by drop_cycle): none of that backward's units holds staging any more
        self._folding.clear()
        self._not_folding.clear()
        if boundary:
            # a second backward before the step recounts everything (units it does not touch
            # are read from their home at the step)
            self.sq_norm = 0.0
            for state in self.states:
                state.uncount_norm()

    def on_grad(self, unit: SteppedUnit, entry: ParamEntry, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        state = self._by_unit[unit.index]
        state.arrived.add(entry.offset)
        if self.holds_grads and (state.grad.parts is not None or self._holds_for(state)):
            self._hold_grad(state, entry, grad)
            self.timers.grad_s += time.perf_counter() - start
            return
        if self.device_pool is not None:
            self._add_on_device(state, entry, grad)
            self.timers.grad_s += time.perf_counter() - start
            return
        target = self._grad_target(state)
        view = target[entry.offset:entry.offset + entry.numel].view(entry.shape)
        if state.grad.first_write(entry.offset):
            event = self.copies.to_host(view, grad)     # first gradient into a fresh buffer
        else:   # zeroed targets, or a second
            event = self.copies.to_host(view, grad, add=True, deferred=self._folding_now(state))
        state.grad.copied(event)   # see [Note: gradients leave the device]
        self.timers.grad_s += time.perf_counter() - start

    def _folding_now(self, state: UnitOptimState) -> bool:
        """Whether an add into ``state``'s home is left for its step to fold into its kernel
        (and the unit counted among those holding such adds, up to ``FOLDING_UNITS``). Only in
        the backward whose steps take the unit; decided at the unit's first add there and
        kept (a unit whose adds went to the adder thread never defers a later one over the
        same elements: the adder could make it first)."""
        if not self._folds(state):
            return False
        index = state.unit.index
        if index in self._folding:
            return True
        if index in self._not_folding or len(self._folding) >= FOLDING_UNITS:
            self._not_folding.add(index)
            return False
        self._folding.add(index)
        return True

    def _add_on_device(self, state: UnitOptimState, entry: ParamEntry,
                       grad: torch.Tensor) -> None:
        """Copy (a first gradient) or add (a second) ``grad`` into the unit's device buffer,
        on the compute stream: what the host path's copies make of it, element for element
        (see [Note: gradients reduced on the device])."""
        buffer = self._device_target(state)
        view = buffer.values[entry.offset:entry.offset + entry.numel].view(entry.shape)
        with torch.no_grad():
            if state.grad.first_write(entry.offset):
                view.copy_(grad)
            else:
                view.add_(grad)
        state.grad.copied(None)

    def _device_target(self, state: UnitOptimState) -> DeviceGradient:
        """The unit's device buffer, taken from the pool at its first gradient."""
        if state.grad.device is None:
            unit = state.unit
            state.grad.on_device(self.device_pool.acquire(
                *device_gradients.buffer_numels(unit, self.scatter),
                what=f"{unit.name} gradient"))
        return state.grad.device

    def _holds_for(self, state: UnitOptimState) -> bool:
        """Whether the unit's gradients of this backward are held as autograd made them: for
        an early step, or a speculated one whose gradient starts this cycle (an accumulated
        one is added to its home copy, through a buffer)."""
        if self.early_step:
            return True
        return (state.grad.buffer is None and not state.has_grads
                and self._speculates(state))

    def _hold_grad(self, state: UnitOptimState, entry: ParamEntry, grad: torch.Tensor) -> None:
        """Keep ``grad`` for the unit's step instead of copying it (see [Note: held
        gradients]), in the dtype autograd made it: the kernels read fp32, bf16 and fp16
        gradients and widen them in registers, exactly. A second gradient of the same
        parameter makes a new sum in fp32, never an in-place add (autograd may have handed
        the same tensor to another parameter)."""
        if not gradients_held(grad.device):
            raise RuntimeError(
                f"{state.unit.name}: a gradient on {grad.device} would be held; only a CPU "
                "device's gradients are held (see [Note: held gradients]), others are copied "
                "to host buffers: the optimizer's holds_grads disagrees with its device")
        parts = state.grad.hold()
        flat = grad.detach().reshape(-1)
        if flat.dtype not in NATIVE_GRAD_DTYPES:
            flat = flat.to(torch.float32)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        held = parts.get(entry.offset)
        if held is not None:
            flat = held.float() + flat.float()
        grown = flat.numel() * flat.element_size() - (
            0 if held is None else held.numel() * held.element_size())
        if grown:
            # backpressure: waits while background steps hold the room (they give it back as
            # they go); a unit's first part never waits (see [Note: room in bytes, freed as
            # the step goes])
            may_wait = self._steps_running if state.grad.held_bytes else _never
            self.timers.grad_wait_s += self.held_room.take(grown, may_wait)
        state.grad.held(entry.offset, flat, grown)

    def _grad_target(self, state: UnitOptimState) -> torch.Tensor:
        if state.grad_store is not None and state.grad_store.resident and not self.reduces:
            state.grad.into_home()
            return state.grad_store.tensor
        if state.grad.buffer is None:
            state.grad.collect_into(*self._host_buffer(state, self.collect_numel(state.unit)))
        return state.grad.buffer

    def _host_buffer(self, state: UnitOptimState, numel: int) -> tuple[torch.Tensor, Slot | None]:
        """A host buffer of ``numel`` fp32 elements for the unit's gradient and its slot (of
        the gradient pool; None: a budgeted one outside it), for the state to keep."""
        # Usually one unit is incomplete at a time; if more are (a tied weight waits for its
        # last use), take a budgeted buffer outside the pool instead of waiting for a slot.
        slot = self.grad_pool.try_acquire()
        while slot is None and self._writes:
            self._land_write()   # deferred: the oldest gradient write frees its slot
            slot = self.grad_pool.try_acquire()
        if slot is None and self._steps_running():
            # backpressure: a background step frees its gradient slot when it finishes
            slot = self.grad_pool.acquire(timeout=600.0)
        if slot is not None:
            return slot.view(torch.float32, numel), slot
        return self.manager.host_empty(numel, torch.float32,
                                       what=f"{state.unit.name} gradient"), None

    def _owners(self) -> GradientOwners:
        """Who the resources of a unit's gradient go back to (read at each call)."""
        return GradientOwners(self.copies, self.grad_pool, self.device_pool, self.held_room)

    def copies_landed(self, state: UnitOptimState) -> None:
        """Every device-to-host copy into the unit's gradient is over: the one wait before the
        host reads it, writes it or gives its buffer back (see [Note: gradients leave the
        device])."""
        # the events leave the state only once waited for: a wait cut short (Ctrl-C, a
        # device error) leaves them to the next one, so drop_buffer never gives the slot
        # back under a copy still landing (a wait that is over returns at once)
        state.grad.land_copies(self.copies)

    def land_copies(self, homes: bool = True) -> None:
        """Every unit's device-to-host copies are over; without ``homes`` those into resident
        homes may go on (a backward ends: the next forward reads no home, and the next
        backward's adds into a home follow this one's, in order; the step waits for them)."""
        if homes:
            self.home_copies_landed()
        for state in self.states:
            self.copies_landed(state)

    def home_copies_landed(self, keep: int = 0) -> None:
        """The copies (and adds) into resident homes that ``finish`` did not wait for are over,
        the oldest units' first, all but the last ``keep`` units' (0: the wait before the host
        reads, zeroes or steps from a resident home; ``HOME_COPIES_IN_FLIGHT``: the bound on
        those in flight)."""
        while len(self._home_copies) > keep:
            # kept until waited, like a unit's own (a wait cut short leaves them to the next)
            oldest = next(iter(self._home_copies))
            self.copies.host_waits(self._home_copies[oldest])
            del self._home_copies[oldest]
            self._folding.discard(oldest)      # its adds are made (by that wait)

    def take_home(self, state: UnitOptimState) -> CompleteGradient:
        """The unit's complete gradient in its resident home, for a step that starts now (see
        [Note: the last micro-batch steps early] in optim/boundary_steps.py): the copies into
        the home still landing go with it (the step stream waits for them), and the home is
        zeroed when the step gives it back."""
        store = state.grad_store
        if store is None or not store.resident:
            raise RuntimeError(f"{state.unit.name}: a step from the gradient home needs a resident "
                               "home (host memory)")
        index = state.unit.index
        return CompleteGradient(store.tensor[: state.numel], origin=state.lo, copies=self.copies,
                                landing=self._home_copies.pop(index, []),
                                zero_at_give_back=True,
                                on_give_back=lambda: self._folding.discard(index))

    def zero_unwritten(self, state: UnitOptimState) -> None:
        """Zero what of a fresh host buffer no gradient was copied into (gaps, unused
        params). No wait for the unit's copies: no copy writes these bytes (see [Note:
        gradients leave the device]), and the early step's training thread must not block.
        With a device buffer (see [Note: gradients reduced on the device]) its gaps are zeroed,
        on the device."""
        gradient = state.grad
        target = gradient.buffer if gradient.device is None else gradient.device.values
        if gradient.written is None or target is None:
            return
        covered = sorted((e.offset, e.offset + e.numel) for e in state.unit.trainable_entries()
                         if e.offset in gradient.written)
        cursor, total = 0, target.numel()
        for start, end in covered + [(total, total)]:
            if start > cursor:
                target[cursor:start].zero_()
            cursor = max(cursor, end)
        gradient.unwritten_zeroed()

    def drop_cycle(self) -> int:
        """Forget every gradient collected since the last step; returns how many units had
        some."""
        dropped = 0
        self.home_copies_landed()     # a copy landing after the zeroing below would add back
        for state in self.states:
            touched = state.grad.seen > 0 or state.has_grads
            dropped += touched
            state.arrived.clear()
            self.drop_buffer(state, forget=True)
            state.clear_gradient()
            if touched and state.grad_store is not None and state.grad_store.resident:
                # in place since this cycle began (no waiting step reads it: the unit was
                # fetched, so its step ran, before any of these gradients came)
                state.grad_store.tensor.zero_()
        self.sq_norm = 0.0
        return dropped

    def reduce(self, state: UnitOptimState) -> None:
        """The unit's gradient of this backward is complete on every rank: average it over
        the ranks into the state's range (see [Note: gradients over ranks]); a no-op with one
        rank."""
        if not self.reduces:
            return
        if self.device_pool is not None:
            self._reduce_on_device(state)
            self._or_arrived(state)
            return
        unit, buffer = state.unit, self._grad_target(state)
        self.copies_landed(state)      # the collective reads it here, on the training thread
        self.zero_unwritten(state)
        if self.scatter:
            shard = torch.empty(unit.shard_numel, dtype=torch.float32)
            self.comm.reduce_scatter_mean(shard, buffer[:unit.flat_numel], tag=unit.index)
            buffer[:state.numel].copy_(shard[:state.numel])
        else:
            self.comm.all_reduce_mean(buffer[:unit.trainable_numel], tag=unit.index)
        state.grad.reduced(state.numel)
        self._or_arrived(state)

    def _or_arrived(self, state: UnitOptimState) -> None:
        """Which parameters got a gradient, OR-ed over the ranks."""
        entries = state.unit.trainable_entries()
        mask = torch.tensor([e.offset in state.arrived for e in entries], dtype=torch.bool)
        state.arrived = {e.offset for e, got in zip(entries, self.comm.any_mask(mask).tolist())
                         if got}

    def _reduce_on_device(self, state: UnitOptimState) -> None:
        """Average the unit's device buffer over the ranks and copy only the own shard (the
        trainable range at stage 0) to a host buffer, the copy's event kept in the state; the
        device buffer goes back to its pool with that event (see [Note: gradients reduced on
        the device])."""
        unit, device = state.unit, self._device_target(state)   # one with no gradient too
        self.zero_unwritten(state)
        self.device_pool.before_reduce(device)
        if self.scatter:
            self.comm.reduce_scatter_mean(device.shard, device.values[:unit.flat_numel],
                                          tag=unit.index)
            reduced = device.shard[:state.numel]
        else:
            self.comm.all_reduce_mean(device.values[:unit.trainable_numel], tag=unit.index)
            reduced = device.values[:state.numel]
        host, slot = self._host_buffer(state, state.numel)
        state.grad.reduced_to(host, slot)   # the device buffer held until its copy out
        # the training thread goes on; whoever reads the host buffer waits for the event (a
        # 16-bit shard is widened there), the device buffer only for the copy (see [Note:
        # gradients leave the device])
        landing, copied = (device_gradients.shard_to_host(self.copies, host, reduced)
                           if state.numel else (DONE, DONE))
        state.grad.copied_out(landing, copied, reduced, self.device_pool)

    def finish(self, state: UnitOptimState, write_home: bool = True,
               norm: bool = True) -> torch.Tensor:
        """The unit's gradient of this backward is complete: add what earlier micro-steps left
        at home, count it in the norm at the boundary (unless ``norm`` is False: a step that
        starts now sums it in its kernels), and (``write_home``) send it home. Returns the
        complete gradient (without ``write_home`` still in the state's buffer)."""
        store = state.grad_store
        if write_home and store.resident and not self.reduces:
            # the copies went straight into the resident home and nothing reads it before the
            # step: no wait here, and the norm is summed at the step, from the home
            self._home_copies.setdefault(state.unit.index, []).extend(
                state.grad.hand_over_copies())
            self.home_copies_landed(keep=HOME_COPIES_IN_FLIGHT)
            state.keep_gradient()
            return store.tensor[: state.numel]
        self.copies_landed(state)
        if store.resident:
            self.home_copies_landed()     # read below: earlier micro-steps' adds are in it
        buffer = state.grad.finished()
        if store.resident and self.reduces:
            grads = store.tensor[: state.numel]
            grads.add_(buffer)     # the own shard, averaged over ranks
        elif store.resident:
            grads = store.tensor[: state.numel]
        else:
            grads = buffer
            if state.has_grads:      # an earlier micro-step of this cycle left one at home
                self._add_home_gradient(state, grads)
        state.keep_gradient()
        if self.boundary and norm:
            self.sq_norm += sum_of_squares(grads, threads=torch.get_num_threads())
            state.count_norm()
        if write_home and not store.resident and state.numel:
            # the write goes on while backward continues; the buffer (slot) is released when it
            # has landed (``land_writes``), at the latest when the backward ends
            request = store.store_async(grads)
            self._writes.append((request, state.grad.send_home(), grads))
        return grads

    def _add_home_gradient(self, state: UnitOptimState, grads: torch.Tensor) -> None:
        """Add the gradient the unit's NVMe home holds into ``grads``."""
        for start, values in self.home_gradient(state):
            grads[start:start + values.numel()].add_(values)

    def home_gradient(self, state: UnitOptimState):
        """(start, values) pieces of the gradient at the unit's home: the resident store as it
        is, or NVMe read through one budgeted chunk (a whole-unit buffer would be a second
        gradient's worth of host memory)."""
        self.copies_landed(state)
        n, store = state.numel, state.grad_store
        if store.resident:
            self.home_copies_landed()
            yield 0, store.tensor[:n]
            return
        buffer = self.chunk_buffer()
        chunk = buffer.numel()
        for start in range(0, n, chunk):
            count = min(chunk, n - start)
            self.manager.wait(store.load_async(buffer, start, count))
            yield start, buffer[:count]

    def chunk_buffer(self) -> torch.Tensor:
        """The budgeted host chunk through which the training thread reads and writes
        gradients at home (accumulation, norms, a speculated step's rebuild); one at a time."""
        if self._chunk is None:
            self._chunk = self.manager.host_empty(
                accumulate_chunk_numel(self._max_trainable), torch.float32,
                what="gradient accumulation chunk")
        return self._chunk

    def close(self) -> None:
        """Land the gradient writes, then free the device buffers (the optimizer closes)."""
        self.home_copies_landed()
        self.land_writes()
        if self.device_pool is not None:
            self.device_pool.close()

    def land_writes(self) -> None:
        """Wait for every gradient write in flight and free its slot."""
        while self._writes:
            self._land_write()

    def _land_write(self) -> None:
        request, slot, _buffer = self._writes.pop(0)
        try:
            self.manager.wait(request)
        finally:
            if slot is not None:
                self.grad_pool.release(slot)

    def drop_buffer(self, state: UnitOptimState, forget: bool = False) -> None:
        """Give back the unit's transient gradient (buffer, slot, device buffer, held parts),
        its copies waited for first (``BackwardGradient.release``); ``forget``: its gradients
        of this cycle are stepped or dropped."""
        self.copies_landed(state)    # a copy still landing would write the next user's bytes
        state.grad.release(self._owners(), forget=forget)

    def take_arrived(self, state: UnitOptimState) -> frozenset[int]:
        """The parameters that got a gradient since the unit's last step, for the step being
        asked for (the next cycle starts with none)."""
        arrived = frozenset(state.arrived)
        state.arrived.clear()
        return arrived

    def take(self, state: UnitOptimState,
             values: torch.Tensor | None = None) -> CompleteGradient:
        """Move the unit's complete gradient (``values``, else its held parts or its buffer)
        out of its state, for a step that owns it from here on, with the events of the copies
        into it still landing: the step waits for them, not the caller (see [Note: gradients
        leave the device])."""
        values, slot, held_bytes, landing = state.grad.take(values)
        return CompleteGradient({} if values is None else values, slot, held_bytes,
                                self.grad_pool, self.held_room,
                                origin=state.lo if isinstance(values, torch.Tensor) else 0,
                                copies=self.copies, landing=landing)
