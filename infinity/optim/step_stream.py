"""The step stream: one background thread that runs the optimizer over units, sub-group by
sub-group, with the disk kept busy in both directions.

[Note: background early step]
In the early-step schedule a unit's step (swap-in of m and v, CPU Adam, swap-out of m, v and the
parameters) is submitted here as soon as its gradients are complete, and runs while backward goes
on with the next units. The unit stays fetched (its device copy is the fp32 master being stepped)
until its future is done, which ``PartitionedOptimizer.reap`` reports. Everything waits for the
stream in ``step()``, so the next forward never sees a unit mid-update, and prefetch in backward
only reads units that have not had their backward yet (never one being written). The deferred
schedule submits every unit at ``step()`` (with the clipping scale) and waits for all of them;
its gradients and parameters come from their homes instead of the transient buffer and the
device copy, except the parameters of a unit still fetched on a CPU device (kept for reuse):
nothing moves it during ``step()``, so it is stepped in place and written home from there.

[Note: one stream of sub-groups]
The stream does not drain at each unit's end: sub-groups of every queued unit form one stream,
with up to ``READ_AHEAD`` sub-groups' reads in flight ahead of the one being stepped and the
writes of earlier ones retiring behind it, so the disk reads the next unit's states while the
last writes of the previous unit go out. A unit's future completes when the writes of its last
sub-group have landed. Slots are taken without blocking while reads are issued (a full pool
retires writes first, or stops reading ahead), so the stream cannot deadlock on its own slots.
In the early step on a CPU device the parameters are written home straight from the unit's
page-aligned device buffer; elsewhere through a slot.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from infinity.storage.manager import padded_numel
from infinity.storage.tiers import Residency

if TYPE_CHECKING:
    from infinity.optim.partitioned import (
        PartitionedOptimizer,
        SubGroup,
        UnitOptimState,
    )
    from infinity.storage.buffer_pool import Slot

READ_AHEAD = 2       # sub-groups whose reads are in flight ahead of the one being stepped
WRITES_BEHIND = 2    # sub-groups whose writes may still be in flight


def _steps_in_device(unit) -> bool:
    """Deferred step of a unit still fetched in page-aligned host memory (a CPU device, kept for
    reuse): its device copy is current, so it is stepped there instead of reading the params."""
    return unit.residency == Residency.FETCHED and unit.flat.device.type == "cpu" and \
        unit.flat.data_ptr() % 4096 == 0


@dataclass(eq=False)
class _UnitJob:
    state: UnitOptimState
    future: Future
    groups: deque
    left: int                      # sub-groups not yet retired
    early: bool                    # gradient in the transient buffer, fp32 master on the device
    grad_scale: float = 1.0
    error: BaseException | None = None


@dataclass(eq=False)
class _Loaded:
    job: _UnitJob
    group: SubGroup
    tensors: dict
    requests: list = field(default_factory=list)   # (request, slot or None)


class StepStream:
    """Owns the stream's thread and its sub-groups in flight (see the notes above)."""

    def __init__(self, optimizer: PartitionedOptimizer) -> None:
        self.opt = optimizer
        self._queue: queue.Queue[_UnitJob | None] = queue.Queue()
        self._jobs: deque[_UnitJob] = deque()        # taken from the queue, sub-groups left
        self._loads: deque[_Loaded] = deque()
        self._writes: deque[tuple[_UnitJob, list]] = deque()
        self._thread = threading.Thread(target=self._run, name="infinity-step-stream", daemon=True)
        self._thread.start()

    def submit(self, state: UnitOptimState, early: bool, grad_scale: float = 1.0) -> Future:
        """Queue ``state``'s unit for a step; the future completes when its writes have landed."""
        future: Future = Future()
        groups = deque(self.opt._sub_groups(state))
        self._queue.put(_UnitJob(state, future, groups, len(groups), early, grad_scale))
        return future

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._loads and not self._writes and not self._has_groups():
                job = self._queue.get()
                if job is None:
                    return
                self._take(job)
            start = time.perf_counter()
            try:
                self._advance()
            except BaseException as exc:  # noqa: BLE001 - reported through the units' futures
                self._fail_all(exc)
            self.opt.timers.background_s += time.perf_counter() - start

    def _has_groups(self) -> bool:
        self._pull_queued()
        return any(job.groups for job in self._jobs)

    def _pull_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._queue.put(None)   # shutdown after the work in hand
                return
            self._take(job)

    def _take(self, job: _UnitJob) -> None:
        job.state.step += 1
        self._jobs.append(job)
        if not job.groups:
            self._finish(job)

    def _advance(self) -> None:
        """Issue reads ahead, step the oldest loaded sub-group, retire writes behind it."""
        while len(self._loads) < READ_AHEAD + 1 and self._read_next():
            pass
        if not self._loads:
            if self._writes:
                self._retire()
            return
        loaded = self._loads.popleft()
        # the sub-group's slots, then its writes as they are issued: on an error the writes
        # already in flight are waited out before their slots go back (a slot reused while
        # the disk still reads from it would put garbage in another unit's states)
        writes: list = [(None, slot) for _, slot in loaded.requests]
        try:
            self.opt.manager.wait(*[r for r, _ in loaded.requests])
            self._step(loaded, writes)
        except BaseException:
            self._abandon(writes)
            raise
        self._writes.append((loaded.job, writes))
        while len(self._writes) > WRITES_BEHIND:
            self._retire()

    def _read_next(self) -> bool:
        self._pull_queued()
        job = next((j for j in self._jobs if j.groups), None)
        if job is None:
            return False
        group = job.groups[0]
        n = group.end - group.start
        state, pool = job.state, self.opt.step_pool
        stores = {"m": state.exp_avg, "v": state.exp_avg_sq}
        if state.master is not None:
            stores["p"] = state.master
        elif not job.early and state.unit.param_store is not None and \
                not _steps_in_device(state.unit):
            stores["p"] = state.unit.param_store
        if not job.early:
            stores["g"] = state.grad_store
        needed = sum(not store.resident for store in stores.values())
        slots = []
        while len(slots) < needed:
            slot = self._free_slot()
            if slot is None and self._loads:
                for taken in slots:          # step what is loaded first; it frees slots
                    pool.release(taken)
                return False
            slots.append(slot if slot is not None else pool.acquire(timeout=600.0))
        job.groups.popleft()
        loaded = _Loaded(job, group, {})
        free = iter(slots)
        for key, store in stores.items():
            if store.resident:
                loaded.tensors[key] = store.tensor[group.start:group.end]
                continue
            slot = next(free)
            buf = slot.view(torch.float32, padded_numel(n, torch.float32))
            loaded.requests.append((store.load_async(buf, group.start, n), slot))
            loaded.tensors[key] = buf[:n]
        self._loads.append(loaded)
        return True

    def _abandon(self, writes: list) -> None:
        """A sub-group failed: wait for its issued writes (errors ignored, the first one is
        already on its way), then free its slots."""
        for req, _ in writes:
            if req is not None:
                try:
                    self.opt.manager.wait(req)
                except BaseException:  # noqa: BLE001
                    pass
        for _, slot in writes:
            if slot is not None:
                self.opt.step_pool.release(slot)

    def _step(self, loaded: _Loaded, writes: list) -> None:
        """Adam on one sub-group; the writes of its results are appended to ``writes``."""
        opt, job, group = self.opt, loaded.job, loaded.group
        state, unit = job.state, job.state.unit
        start, end, n = group.start, group.end, group.end - group.start
        t = loaded.tensors
        param = t["p"] if "p" in t else unit.flat[start:end]
        grad = state.grad_buffer[start:end] if job.early else t["g"]
        half = None
        if state.master is not None and unit.dtype != torch.float32:
            half = torch.empty(n, dtype=unit.dtype)
        opt._kernel(state, start, end, param, grad, t["m"], t["v"], job.grad_scale, half)
        opt._store(state.exp_avg, t["m"], start, n, writes)
        opt._store(state.exp_avg_sq, t["v"], start, n, writes)
        new = half if half is not None else param
        if state.master is not None:
            opt._store(state.master, param, start, n, writes)
        if job.early:
            if state.master is not None:
                unit.flat[start:end].copy_(new)
            self._write_params(unit, start, n, writes)
        else:
            if "p" in t and unit.residency == Residency.FETCHED:
                unit.flat[start:end].copy_(new)    # a unit kept fetched stays current
            store = unit.param_store
            if store is not None and state.master is None and "p" not in t:
                # stepped in the unit's device buffer (kept fetched): written home from it
                self._write_params(unit, start, n, writes)
            elif store is not None and state.master is None:
                opt._store(store, param, start, n, writes)
            elif store is not None:
                self._write_values(store, new, start, n, writes)
        if job.early and not job.groups and all(x.job is not job for x in self._loads):
            opt._drop_grad_buffer(state)   # its last kernel ran: the gradient slot is free

    def _write_params(self, unit, start: int, n: int, writes: list) -> None:
        """The unit's updated device copy goes to its home (early step, or a deferred step of a
        unit kept fetched)."""
        store = unit.param_store
        if store is None:
            return
        if not store.resident and unit.flat.device.type == "cpu" and \
                unit.flat.data_ptr() % 4096 == 0:
            # the device buffer is host memory, page-aligned, and stays fetched until the
            # unit's future is done: write it as it is (no staging copy)
            writes.append((store.store_async(unit.flat[start:], start, n), None))
        else:
            self._write_values(store, unit.flat[start:start + n], start, n, writes)

    def _write_values(self, store, values: torch.Tensor, start: int, n: int,
                      writes: list) -> None:
        """Write ``values`` (any memory) to ``store``, through a slot when it is on NVMe."""
        if store.resident:
            store.tensor[start:start + n].copy_(values)
            return
        slot = self._free_slot() or self.opt.step_pool.acquire(timeout=600.0)
        writes.append((None, slot))        # the slot is the sub-group's from here on
        buf = slot.view(store.dtype, padded_numel(n, store.dtype))
        buf[:n].copy_(values)
        writes.append((store.store_async(buf, start, n), None))

    def _free_slot(self) -> Slot | None:
        """A free slot without blocking: retire writes (oldest first) until one is free; None
        when every slot is held by reads or the sub-group being stepped."""
        slot = self.opt.step_pool.try_acquire()
        while slot is None and self._writes:
            self._retire()
            slot = self.opt.step_pool.try_acquire()
        return slot

    def _retire(self) -> None:
        job, entries = self._writes.popleft()
        try:
            self.opt.manager.wait(*[r for r, _ in entries if r is not None])
        except BaseException as exc:  # noqa: BLE001
            job.error = job.error or exc
        finally:
            for _, slot in entries:
                if slot is not None:
                    self.opt.step_pool.release(slot)
        job.left -= 1
        if job.left == 0:
            self._finish(job)

    def _finish(self, job: _UnitJob) -> None:
        self._jobs.remove(job)
        self.opt._drop_grad_buffer(job.state)
        if job.error is not None:
            job.future.set_exception(job.error)
        else:
            job.future.set_result(None)

    def _fail_all(self, exc: BaseException) -> None:
        """An error mid-stream: wait out what is in flight, fail every unit in hand."""
        for loaded in self._loads:
            for req, slot in loaded.requests:
                try:
                    self.opt.manager.wait(req)
                except BaseException:  # noqa: BLE001 - the first error is the one reported
                    pass
                self.opt.step_pool.release(slot)
        self._loads.clear()
        while self._writes:
            self._retire()
        for job in list(self._jobs):
            job.error = job.error or exc
            job.groups.clear()
            self._finish(job)
