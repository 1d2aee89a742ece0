"""The step stream: one background thread that runs the optimizer over units, sub-group by
sub-group, with the disk kept busy in both directions.

[Note: background early step]
In the early-step schedule a unit's step (swap-in of m and v, CPU Adam, swap-out of m, v and the
parameters) is submitted here as soon as its gradients are complete, and runs while backward goes
on with the next units. Off a CPU device "complete" means copied to the host or on the way: the
stream, not the training thread, waits for the copies before the unit's first kernel (see [Note:
gradients leave the device] in optim/gradients.py). The unit stays fetched (its device copy is
the fp32 master being stepped) until its job has landed, which ``reap`` reports (see [Note: the
life of a step job] in optim/records.py). ``step()`` waits until every unit's kernels have
run, so the next forward never sees a unit mid-update, and prefetch in backward only reads units
that have not had their backward yet (never one being written).

[Note: the deferred step lands at the next fetch]
The deferred schedule (clipping, loss scaling, accumulation) cannot step a unit before the whole
backward is over, but it need not step it at ``step()`` either: ``step()`` queues every unit
that got gradients as an expected job (with the clipping scale and the hyperparameters of this
step) in the order the next forward will use them, and returns. The stream reads their gradients
and Adam states ahead; when the next forward (or an eval forward, ``GatheredParameters``, a
flush) fetches a unit, the coordinator hands it over, the job steps its device copy -- the
parameters the forward fetched anyway, so they are not read a second time -- and the forward
waits only for that unit's kernels. Its writes land behind the forward, as in the early step.
Units the forward did not use are fetched and stepped by ``Engine.step`` before the next step
(or by ``Engine.flush``). So the step's disk traffic overlaps the next forward instead of
stopping training, and the parameters are read once per step instead of twice.

[Note: one stream of sub-groups]
The stream does not drain at each unit's end: sub-groups of every queued unit form one stream,
with up to ``READ_AHEAD`` sub-groups' reads in flight ahead of the one being stepped and the
writes of earlier ones retiring behind it, so the disk reads the next unit's states while the
last writes of the previous unit go out. A unit's job lands when the writes of its last
sub-group have landed. Slots are taken without blocking while reads are issued (a full pool
retires writes first, or stops reading ahead), so the stream cannot deadlock on its own slots.
Where the unit's flat buffer is page-aligned host memory (a CPU device, either schedule) the
parameters are written home straight from it; on a GPU from the host values it is made from.

[Note: expected steps]
Without help the stream would read a unit's m and v only once its gradients are complete, and
sit idle between units: the disk idles while backward computes, then Adam waits for the disk.
So the coordinator says which units' gradients are coming: at the start of a training forward
the first units of the recorded backward, and at each unit's pre-backward that unit and the
next one. Their jobs are queued "expected" (not ready): the stream reads their sub-groups with
slots it has to spare, and steps them only when ``make_ready`` says the gradients are complete.
A ready job always comes first: it is read before any expected one, and if the slots or the
read-ahead window are held by expected reads, the newest of those is given up (preempted) and
read again later, so a ready job never waits on gradients that may never come. Expected jobs
that got no gradients are cancelled when the backward ends (or fails) and their reads dropped;
``state.step`` only advances when a job's first kernel runs.

[Note: writes behind the step]
In the early step ``step()`` returns once every unit's kernels have run: the last units' writes
(m, v and parameters, about the last two units' worth) land while the next forward starts, when
the disk has little else to do. Units keep their device copies (from which parameters are
written) until their writes have landed; a later read of the same states (the unit's next step)
first retires the writes of that unit. ``Engine.flush`` waits for them (GatheredParameters,
which may write a unit home, does so first).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from infinity.optim.device_copy import (
    flat_rounded_by_kernel, host_temporary, kernel_writes_every_element)
from infinity.optim.formatted_step import MomentScales, scales_of
from infinity.optim.grad_norm import sum_of_squares
from infinity.optim.records import (
    CompleteGradient,
    JobPhase,
    OptimTimers,
    StepJob,
    StepRun,
    SubGroup,
    UnitOptimState,
    gather_gradient,
    sub_groups,
)
from infinity.optim.step_kernel import StepKernel
from infinity.storage.buffer_pool import BufferPool, Slot
from infinity.storage.manager import TierManager, padded_numel

READ_AHEAD = 2       # sub-groups whose reads are in flight ahead of the one being stepped
WRITES_BEHIND = 2    # sub-groups whose writes may still be in flight
IDLE_WAIT_S = 0.05   # the stream re-checks its jobs at least this often when it has nothing to do


def _run_while_held(ref: "weakref.ref[StepStream]", wake: threading.Condition) -> None:
    """The stream's thread: each pass takes the stream from a weak reference and it waits idle
    without it, so a stream (an engine) dropped without ``shutdown()`` is collected and its
    thread ends (a thread holding the stream kept every engine dropped without close() alive
    until exit, with its swap directory and buffers)."""
    while True:
        stream = ref()
        moved = None if stream is None else stream._pass()
        if moved is None:
            return
        with wake:
            idle = not moved and not stream._incoming and not stream._has_news()
            del stream
            if idle:
                wake.wait(IDLE_WAIT_S)


@dataclass(eq=False)
class _Loaded:
    job: StepJob
    group: SubGroup
    tensors: dict
    requests: list = field(default_factory=list)   # (request, slot or None)


class StepStream:
    """Owns the stream's thread and its sub-groups in flight (see the notes above)."""

    def __init__(self, kernel: StepKernel, manager: TierManager, pool: BufferPool | None,
                 sub_group_numel: int, timers: OptimTimers) -> None:
        self.kernel = kernel
        self.manager = manager
        self.pool = pool                  # slots for the states streamed from NVMe
        self.sub_group_numel = sub_group_numel
        self.timers = timers
        self._wake = threading.Condition()
        self._incoming: deque[StepJob | None] = deque()   # None: shut down after the rest
        self._stopping = False
        self._jobs: deque[StepJob] = deque()        # taken in, not finished
        self._loads: deque[_Loaded] = deque()
        self._writes: deque[tuple[StepJob, list]] = deque()
        # expected jobs queued, their sub-groups read before the gradients were complete,
        # reads given up for a ready job, jobs cancelled (no gradients came)
        self.stats = {"expected": 0, "read_early": 0, "preempted": 0, "cancelled": 0}
        self._thread = threading.Thread(target=_run_while_held, name="infinity-step-stream",
                                        args=(weakref.ref(self), self._wake), daemon=True)
        self._thread.start()

    # -- the training thread's side ---------------------------------------------------------
    def submit(self, state: UnitOptimState, early: bool, grad_scale: float = 1.0,
               gradient: CompleteGradient | None = None, speculative: bool = False,
               params: frozenset[int] | None = None, gradient_home: bool = False) -> StepJob:
        """Queue ``state``'s unit for a step with its gradients complete (an early step's
        ``gradient`` is the job's from here on) of the parameters ``params`` (None: all). The
        unit must be fetched and held until the job has landed: the step updates its
        device copy. A unit's next job must come after this one's kernels have run: jobs queued
        together read their Adam states at once, so the second would step stale ones (the
        partitioned optimizer waits for a unit's steps before it queues another)."""
        return self._queue_job(state, early, grad_scale, ready=True, gradient=gradient,
                               speculative=speculative, params=params,
                               gradient_home=gradient_home)

    def expect(self, state: UnitOptimState, early: bool = True, grad_scale: float = 1.0,
               params: frozenset[int] | None = None) -> StepJob:
        """Queue a step that may not run yet (see [Note: expected steps]): an early step whose
        gradients are still being computed, or a deferred step whose unit is not fetched yet
        (see [Note: the deferred step lands at the next fetch]). Its states are read ahead
        while slots are free; ``make_ready`` or ``cancel`` must follow."""
        self.stats["expected"] += 1
        return self._queue_job(state, early, grad_scale, ready=False, params=params)

    def make_ready(self, job: StepJob, gradient: CompleteGradient | None = None,
                   speculative: bool = False, grad_scale: float | None = None,
                   params: frozenset[int] | None = None, gradient_home: bool = False) -> None:
        """The expected job may run: its gradients are complete (an early step's ``gradient``,
        of the parameters ``params``, None: as queued) and its unit is fetched and held until
        the job has landed."""
        with self._wake:
            if job.hyper is None:
                job.hyper = self.kernel.hyperparameters()
            job.gradient = gradient
            if params is not None:
                job.params = params
            job.speculative = speculative
            job.gradient_home = gradient_home
            if grad_scale is not None:
                job.grad_scale = grad_scale
            job.make_ready()
            self._wake.notify()

    def cancel(self, job: StepJob) -> None:
        """The expected job will not run (no gradients came, or the engine closes): drop it
        (its reads are discarded)."""
        with self._wake:
            if job.cancel():
                self._wake.notify()

    def _queue_job(self, state, early: bool, grad_scale: float, ready: bool,
                   gradient: CompleteGradient | None = None, speculative: bool = False,
                   params: frozenset[int] | None = None, gradient_home: bool = False) -> StepJob:
        groups = deque(sub_groups(state, self.sub_group_numel))
        # the hyperparameters (learning rate) of the step being asked for: an early step's are
        # fixed when its gradients are complete, a deferred step's now (a scheduler moves the
        # rate before the step runs)
        hyper = self.kernel.hyperparameters() if ready or not early else None
        job = StepJob(state, groups, len(groups), early,
                      JobPhase.READY if ready else JobPhase.EXPECTED, grad_scale, hyper,
                      gradient, speculative=speculative, params=params,
                      gradient_home=gradient_home)
        with self._wake:
            self._incoming.append(job)
            self._wake.notify()
        return job

    def shutdown(self) -> None:
        with self._wake:
            self._incoming.append(None)
            self._wake.notify()
        self._thread.join()

    # -- the loop (``_run_while_held``) ---------------------------------------------------
    def _pass(self) -> bool | None:
        """One pass of the thread's loop: whether it moved anything, None once shut down and
        drained."""
        with self._wake:
            self._pull_incoming()
            if self._stopping and not self._jobs and not self._loads and not self._writes:
                return None
        start = time.perf_counter()
        try:
            moved = self._advance()
        except BaseException as exc:  # noqa: BLE001 - reported through the units' futures
            self._fail_all(exc)
            moved = True
        self.timers.background_s += time.perf_counter() - start
        return moved

    def _pull_incoming(self) -> None:
        while self._incoming:
            job = self._incoming.popleft()
            if job is None:
                self._stopping = True
                for waiting in self._jobs:      # no gradients will come any more
                    waiting.cancel()
                continue
            self._jobs.append(job)
            if not job.groups and job.ready:
                self._count_step(job)
                job.stepped()
                self._finish(job)

    def _has_news(self) -> bool:
        """A job that became ready or cancelled since the stream last looked."""
        return any(x.job.ready or x.job.cancelled for x in self._loads) or any(
            (j.ready and (j.groups or j.left == 0)) or j.cancelled for j in self._jobs)

    def _advance(self) -> bool:
        """Issue reads ahead, step the oldest loaded sub-group whose gradients are complete,
        retire writes behind it. False when nothing could move."""
        moved = self._drop_cancelled() | self._finish_empty()
        while self._read_next():
            moved = True
        loaded = next((x for x in self._loads if x.job.ready), None)
        if loaded is None:
            if self._writes:
                self._retire()
                return True
            return moved
        self._loads.remove(loaded)
        # the sub-group's slots, then its writes as they are issued: on an error the writes
        # already in flight are waited out before their slots go back (a slot reused while
        # the disk still reads from it would put garbage in another unit's states)
        writes: list = [(None, slot) for _, slot in loaded.requests]
        try:
            self.manager.wait(*[r for r, _ in loaded.requests])
            self._step(loaded, writes)
        except BaseException:
            self._abandon(writes)
            raise
        self._writes.append((loaded.job, writes))
        while len(self._writes) > WRITES_BEHIND:
            self._retire()
        return True

    def _finish_empty(self) -> bool:
        """Jobs of an empty range (a rank's shard past a unit's trainable part) that became
        ready: nothing to read or step; their step is counted, as on the other ranks."""
        empty = [j for j in self._jobs if j.phase is JobPhase.READY and not j.groups and
                 j.left == 0]
        for job in empty:
            self._count_step(job)
            job.stepped()
            self._finish(job)
        return bool(empty)

    def _next_to_read(self) -> StepJob | None:
        """Jobs whose gradients are complete come first; then expected ones, read ahead."""
        ready = next((j for j in self._jobs if j.ready and j.groups), None)
        if ready is not None:
            return ready
        return next((j for j in self._jobs if not j.ready and not j.cancelled and j.groups),
                    None)

    def _read_next(self) -> bool:
        """Issue the reads of one more sub-group, if the read-ahead window and the slots allow."""
        job = self._next_to_read()
        if job is None:
            return False
        ready_loads = sum(x.job.ready for x in self._loads)
        if len(self._loads) >= READ_AHEAD + 1:
            if not job.ready or ready_loads >= READ_AHEAD + 1 or not self._preempt():
                return False
        self._retire_writes_of(job.state)   # a sub-group is read only after its last write
        group = job.groups[0]
        n = group.end - group.start
        state, pool = job.state, self.pool
        stores = {"m": state.exp_avg, "v": state.exp_avg_sq}
        if state.master is not None:
            stores["p"] = state.master
        if not job.early:
            stores["g"] = state.grad_store
        needed = sum(not store.resident for store in stores.values())
        at = group.start - state.lo     # where the sub-group lies in the state's stores
        slots = []
        while len(slots) < needed:
            slot = self._free_slot()
            if slot is None and job.ready and self._preempt():
                continue
            if slot is None and (self._loads or not job.ready):
                for taken in slots:          # step what is loaded first; it frees slots
                    pool.release(taken)
                return False
            slots.append(slot if slot is not None else pool.acquire(timeout=600.0))
        job.groups.popleft()
        self.stats["read_early"] += int(not job.ready)
        loaded = _Loaded(job, group, {})
        free = iter(slots)
        for key, store in stores.items():
            if store.resident:
                loaded.tensors[key] = store.tensor[at:at + n]
                continue
            slot = next(free)
            buf = slot.view(store.dtype, padded_numel(n, store.dtype))
            loaded.requests.append((store.load_async(buf, at, n), slot))
            loaded.tensors[key] = buf[:n]
        self._loads.append(loaded)
        return True

    def _preempt(self) -> bool:
        """Give up the newest sub-group read ahead for a job whose gradients are not complete
        (its group goes back to the front of its job), so a ready job gets its slots; False
        when there is none."""
        for i in range(len(self._loads) - 1, -1, -1):
            loaded = self._loads[i]
            if not loaded.job.ready:
                del self._loads[i]
                self._abandon(loaded.requests)
                loaded.job.groups.appendleft(loaded.group)
                self.stats["preempted"] += 1
                return True
        return False

    def _drop_cancelled(self) -> bool:
        """Expected jobs that were cancelled: their reads are discarded, their futures done."""
        if not any(j.cancelled for j in self._jobs):
            return False
        for loaded in [x for x in self._loads if x.job.cancelled]:
            self._loads.remove(loaded)
            self._abandon(loaded.requests)
        for job in [j for j in self._jobs if j.cancelled]:
            self.stats["cancelled"] += 1
            job.groups.clear()
            self._jobs.remove(job)
            job.dropped()
        return True

    def _retire_writes_of(self, state: UnitOptimState) -> None:
        """Retire writes in flight until none belongs to ``state``'s unit: a read of a state
        must not race a write of the same range (the next step of a unit whose last writes
        went on after ``step()``)."""
        while any(job.state is state for job, _ in self._writes):
            self._retire()

    def _count_step(self, job: StepJob) -> None:
        if job.runs is None:
            job.runs = self.kernel.step_runs(job.state, job.params)

    def _abandon(self, requests: list) -> None:
        """A sub-group that will not be stepped or written on: wait for its issued (request,
        slot) pairs (errors ignored: a failure is already on its way, or the reads are not
        used), then free its slots."""
        for req, _ in requests:
            if req is not None:
                try:
                    self.manager.wait(req)
                except BaseException:  # noqa: BLE001
                    pass
        for _, slot in requests:
            if slot is not None:
                self.pool.release(slot)

    def _step(self, loaded: _Loaded, writes: list) -> None:
        """Adam on one sub-group of a fetched unit (the fp32 master is its device copy, unless
        a separate master was read); the writes of its results are appended to ``writes``."""
        job, group = loaded.job, loaded.group
        state, unit = job.state, job.state.unit
        start, end, n = group.start, group.end, group.end - group.start
        at = start - state.lo           # in the state's stores
        t = loaded.tensors
        self._count_step(job)
        # at most one device-copy write of this job beside this sub-group's kernel
        self.timers.device_write_wait_s += job.device_writes.settle()
        param = t["p"] if "p" in t else unit.flat[start:end]
        if job.early:
            job.gradient.landed()   # see [Note: background early step]; at once after the first
        grad = job.gradient.of(start, end) if job.early else t["g"]
        half = None
        into_flat = False
        if state.master is not None and unit.dtype != torch.float32:
            if not self.manager.copies.overlaps_compute and \
                    flat_rounded_by_kernel(unit, grad, job.runs, start, end):
                # see [Note: the kernel rounds into the device copy]; copies that overlap
                # compute stand for a GPU's even on a CPU device (the late copies of the tests)
                half, into_flat = unit.flat[start:end], True
            else:
                # parameters the runs skip keep their values: filled only where there are any
                every = kernel_writes_every_element(grad, job.runs, start, end)
                half = host_temporary(param, unit.dtype, pinned=unit.flat.device.type == "cuda",
                                      fill=not every)
        shadow = job.speculative
        flat_gradient = isinstance(grad, torch.Tensor)
        # the kernel norms the gradient where nothing else does: an early step's (the global
        # norm for get_global_grad_norm) and a speculated step's held gradient that stays here
        # (a flat buffer was normed when complete, one going home is normed as it is written)
        norm_in_kernel = job.early and not (shadow and (flat_gradient or job.gradient_home))
        # a home the next backward adds into: left at zero ([Note: the step gives the home
        # back at zero] in optim/kernel.py)
        home_given_back = job.gradient.zero_at_give_back if job.early else \
            state.grad_store.resident
        kernel_start = time.perf_counter()
        sq = self.kernel.run(state, start, end, param, grad, t["m"], t["v"], job.grad_scale,
                             half, job.hyper, job.runs, grad_sq_sum=norm_in_kernel,
                             scales=scales_of(state, at, n), zero_grad=home_given_back,
                             addends=job.gradient.addends if job.early else None)
        self.timers.kernel_s += time.perf_counter() - kernel_start
        job.sq_norm += sq
        if home_given_back and job.early:
            job.gradient.zeroed_by_step(start, end)
        _store(state.exp_avg, t["m"], at, n, writes, shadow)
        _store(state.exp_avg_sq, t["v"], at, n, writes, shadow)
        written = None     # the host values the device copy is written from
        flat_current = True     # the device copy holds them (optim/device_copy.py)
        if state.master is not None:
            _store(state.master, param, at, n, writes, shadow)
            if not into_flat:
                written = half if half is not None else param
                flat_current = job.device_writes.write(self.manager.copies, unit.flat[start:end],
                                                       written, temporary=half is not None,
                                                       filled=unit.fill_event)
        self._write_params(unit, start, n, writes, shadow, written, flat_current)
        if shadow and job.gradient_home:
            # kept at home for a redo: a flat buffer is written as it is (given back at
            # ``_finish``), held gradients are normed and copied
            if flat_gradient:
                _store(state.grad_store, grad, at, n, writes)
            else:
                self._write_held_gradient(job, start, end, writes)
        # otherwise a speculated held gradient is only normed (in the kernel): a roll-back
        # rebuilds it (see [Note: the gradient of a speculated step] in optim/speculation.py)
        if job.gradient is not None and not flat_gradient:
            self._free_stepped_parts(job)
        if not job.groups and all(x.job is not job for x in self._loads):
            # its last kernel ran: the gradient is given back, the device copy current once its
            # copies landed
            if job.gradient is not None and not (shadow and flat_gradient and job.gradient_home):
                job.gradient.give_back()
            self._stepped(job)

    def _free_stepped_parts(self, job: StepJob) -> None:
        """Free the held gradient parts no sub-group still to be stepped covers. A job's
        sub-groups are stepped in ascending order (a preempted read goes back to the front)."""
        first = next((x.group.start for x in self._loads if x.job is job), None)
        if first is None:
            first = job.groups[0].start if job.groups else None
        job.gradient.free_parts_before(first)

    def _write_held_gradient(self, job: StepJob, start: int, end: int, writes: list) -> None:
        """Norm a speculated step's held gradient over [start, end) and write it to the unit's
        gradient home (the gaps between parameters as zeros), for a redo."""
        store, n = job.state.grad_store, end - start
        values = store.tensor[start:end] if store.resident else \
            self._staging(writes, torch.float32, n)[:n]
        gather_gradient(job.state.unit, job.gradient.values, start, start, end, values)
        job.sq_norm += sum_of_squares(values)
        if not store.resident:
            writes.append((store.store_async(values, start, n), None))

    def _write_params(self, unit, start: int, n: int, writes: list, shadow: bool = False,
                      written: torch.Tensor | None = None, flat_current: bool = True) -> None:
        """The unit's updated device copy goes to its home (``shadow``: its shadow extent), from
        ``written``, the host values it was made from, unless the disk writes it directly
        (``flat_current``: it already holds them): on a GPU a read of it is a copy on the
        compute stream, after every kernel queued there."""
        store = unit.param_store
        if store is None:
            return
        at = start - unit.home_start    # the home holds the own shard (see [Note: shards])
        if not store.resident and unit.flat_on_aligned_host and flat_current:
            # the device buffer is host memory, page-aligned, and stays fetched until the
            # unit's job has landed: write it as it is (no staging copy)
            writes.append((store.store_async(unit.flat[start:], at, n, shadow), None))
        else:
            values = written if written is not None else unit.flat[start:start + n]
            self._write_values(store, values, at, n, writes, shadow)

    def _write_values(self, store, values: torch.Tensor, start: int, n: int,
                      writes: list, shadow: bool = False) -> None:
        """Write ``values`` (any memory) to ``store``, through a slot when it is on NVMe."""
        if store.resident:
            if shadow:
                raise RuntimeError(f"{store.name}: a speculative step cannot write a resident "
                                   "store in place")
            store.tensor[start:start + n].copy_(values)
            return
        buf = self._staging(writes, store.dtype, n)
        buf[:n].copy_(values)
        writes.append((store.store_async(buf, start, n, shadow), None))

    def _staging(self, writes: list, dtype: torch.dtype, n: int) -> torch.Tensor:
        """A slot's buffer for ``n`` elements to be written; the slot joins ``writes`` (it is
        the sub-group's from here on, freed when its writes have landed)."""
        slot = self._free_slot()
        while slot is None and self._preempt():
            slot = self._free_slot()
        slot = slot or self.pool.acquire(timeout=600.0)
        writes.append((None, slot))
        return slot.view(dtype, padded_numel(n, dtype))

    def _free_slot(self) -> Slot | None:
        """A free slot without blocking: retire writes (oldest first) until one is free; None
        when every slot is held by reads or the sub-group being stepped."""
        slot = self.pool.try_acquire()
        while slot is None and self._writes:
            self._retire()
            slot = self.pool.try_acquire()
        return slot

    def _retire(self) -> None:
        job, entries = self._writes.popleft()
        try:
            self.manager.wait(*[r for r, _ in entries if r is not None])
        except BaseException as exc:  # noqa: BLE001
            job.error = job.error or exc
        finally:
            for _, slot in entries:
                if slot is not None:
                    self.pool.release(slot)
        job.left -= 1
        if job.left == 0:
            self._finish(job)

    def _finish(self, job: StepJob) -> None:
        self._jobs.remove(job)
        if job.gradient is not None:     # a failed job's gradient, given back all the same
            job.gradient.give_back()
        if job.error is not None:
            try:    # no copy still writes the device copy once the unit is handed back
                job.device_writes.land()
            except BaseException:  # noqa: BLE001 - the job fails with its first error
                pass
            job.fail(job.error)
        else:
            if job.phase is JobPhase.READY:
                self._stepped(job)
            job.landed()

    def _stepped(self, job: StepJob) -> None:
        """The job's kernels have run: once its device-copy writes have landed, the device
        copy is current (see [Note: the device copy written behind the step])."""
        self.timers.device_write_wait_s += job.device_writes.land()
        job.stepped()

    def _fail_all(self, exc: BaseException) -> None:
        """An error mid-stream: wait out what is in flight, fail every unit in hand (expected
        ones too: their gradients would have nowhere to go)."""
        for loaded in self._loads:
            self._abandon(loaded.requests)
        self._loads.clear()
        while self._writes:
            self._retire()
        for job in list(self._jobs):
            job.error = job.error or exc
            job.groups.clear()
            self._finish(job)


def _store(store, tensor: torch.Tensor, start: int, count: int, writes: list,
           shadow: bool = False) -> None:
    """Write back a loaded tensor (resident stores were updated in place, nothing to do;
    ``shadow``: to the store's shadow extent)."""
    if not store.resident:
        writes.append((store.store_async(tensor, start, count, shadow), None))
