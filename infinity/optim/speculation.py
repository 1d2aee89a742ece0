"""The speculative step: the deferred schedule's step run during backward, kept or redone.

[Note: speculative step]
The deferred schedule (clipping, fp16 loss scaling, accumulation) cannot step a unit before the
backward is over: the clipping factor and the overflow check need every gradient. So its whole
step (read gradient, m, v; write parameters, m, v) has to share the next forward's disk, while
the disk is half idle during backward (see [Note: the deferred step lands at the next fetch]).
But most steps of a run need no clipping and do not overflow: for them the step that will run
is the plain one, known as soon as a unit's gradient is complete.

So, at the backward that ends an accumulation cycle, each unit is stepped as in the early step
(on its fetched device copy, as its gradients complete) but every result goes to a second copy:
its NVMe stores are doubled (``FlatStore.doubled``) and the step writes parameters, m and v to
the shadow extents, reading only the current ones; its gradient is normed, and written home
only when a redo is likely (see [Note: the gradient of a speculated step]). At ``step()`` the
norm is known:
- no clipping acts and the gradients are finite: commit. Every speculated store flips (the
  shadow becomes current) and nothing is left to do; the units' device copies are the new
  parameters, as after an early step.
- clipping acts, or a gradient overflowed: roll back. The current extents still hold the old
  states; the speculated units' device copies (new parameters) are dropped, their step counts
  go back, and the deferred step runs from the gradients at home, written there during
  backward or rebuilt now (on overflow nothing runs and the gradients are dropped).
A unit that cannot be doubled (persistent, or a state resident in memory) is not speculated and
takes the deferred path. Reading the model between backward and step (a forward, or
GatheredParameters) would see speculated parameters, so the speculation is rolled back first
(``void``), and the deferred path takes over for that cycle.

With ``speculative_step`` "auto" a step speculates while the last step would have kept its
speculation (first step included): a run whose gradients are clipped every step stops paying
the wasted writes after one step and tries again after a step that needed no clipping.

[Note: the gradient of a speculated step]
Writing each speculated unit's gradient home, in case the step is redone, costs a quarter of
the step's writes (1.8 of 7.4 GiB a step at 0.49B) for a copy that a kept speculation never
reads. With clipping configured a redo is a likely outcome, and the gradient goes home while
backward runs (also for a param group in Adam's L2 mode, where m holds g + l2 * p and taking
l2 * p back out would cost the rebuild its precision). Otherwise only rare events roll a
speculation back (an overflow, which needs no gradient; a learning rate set by hand before
``step()``; a forward or ``GatheredParameters`` before ``step()``), so it is not written: the
step's own results hold it. The speculated m is m' = beta1 * m + (1 - beta1) * g / s (s: the
loss scale it was stepped with), and both m (current extent) and m' (shadow extent) are on disk
until the next speculation, so a roll-back that goes on to the deferred step (the learning rate
or betas changed, or the model was read before the step) rebuilds g = s * (m' - beta1 * m) / (1 - beta1) in float64, chunk by chunk,
into the gradient's home, for the parameters the step stepped (zero elsewhere). The rebuilt
gradient differs from the one autograd made by the rounding of m' (a few float32 ulps of m,
divided by 1 - beta1); the redone step multiplies it by 1 - beta1 again, so its m and v are
within a few ulps of a step from the original gradient. A roll-back that drops the gradients
(an overflow, ``zero_grad``, a failed backward) rebuilds nothing. A rebuild reads m twice and
writes g, on the training thread: the price of the rare path.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from infinity.base.log import get_logger
from infinity.optim.gradients import GradientCollector
from infinity.optim.kernel import AdamKernel
from infinity.optim.pending_steps import PendingSteps
from infinity.optim.records import JobPhase, StepJob, UnitOptimState
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.zero.protocols import SteppedUnit, Wait

log = get_logger("optim")

SPECULATION_MODES = ("off", "auto", "on")
VOIDED = "the model was read before step()"   # a roll-back counted as "voided"
BLOCK_NUMEL = 1024     # fp32 elements in 4 KiB: a rebuild chunk starts on an O_DIRECT boundary

# submit(state, gradient, params, **job settings) -> the job, queued ready and pending
Submit = Callable[..., StepJob]


class Speculator:
    """The speculative step of the deferred schedule (see the notes above), owned by the
    optimizer, with its gradients, kernel and pending steps."""

    def __init__(self, mode: str, manager: TierManager, gradients: GradientCollector,
                 kernel: AdamKernel, steps: PendingSteps, grad_pool: BufferPool | None) -> None:
        if mode not in SPECULATION_MODES:
            raise ValueError(f"speculative step mode {mode!r}: expected one of {SPECULATION_MODES}")
        self.mode = mode
        self.manager = manager
        self.gradients = gradients
        self.kernel = kernel
        self.steps = steps
        self.grad_pool = grad_pool
        self.speculating = False        # this backward speculates
        self.jobs: list[StepJob] = []   # speculated, waiting for step() to keep or drop them
        # the last step would have kept its speculation ("auto" speculates while it is True);
        # checkpoints keep it, so a resumed run speculates where the uninterrupted one did
        self.pays = True
        self.rolled_back: list[SteppedUnit] = []  # units whose device copies hold rolled-back values
        self.stats = {"committed": 0, "rolled_back": 0, "voided": 0}
        # units whose speculated gradient is neither at home nor on its way there
        self._gradient_not_home: set[int] = set()

    # -- deciding --------------------------------------------------------------------------
    def plans(self) -> bool:
        """Whether the next cycle's last backward will speculate."""
        if self.mode == "off":
            return False
        return self.mode == "on" or self.pays

    def begin_backward(self, boundary: bool) -> None:
        """A speculation still pending from an earlier backward of this cycle was voided by
        the engine's forward; this backward speculates at the boundary."""
        self.speculating = boundary and self.plans() and not self.jobs

    def can_speculate(self, state: UnitOptimState) -> bool:
        """Every store the unit's step writes has a shadow extent (see the note)."""
        store = state.unit.param_store
        return (self.speculating and store is not None and store.doubled
                and state.fmt.is_default            # the redo reads fp32 states
                and state.exp_avg.doubled and state.exp_avg_sq.doubled
                and (state.master is None or state.master.doubled)
                and not any(job.state is state for job in self.jobs))

    @property
    def pending(self) -> bool:
        """Speculated steps wait for ``step()`` to keep or drop them."""
        return bool(self.jobs)

    # -- running ---------------------------------------------------------------------------
    def speculate(self, state: UnitOptimState, clip_norm: float, loss_scale: float,
                  submit: Submit) -> StepJob:
        """Step the unit (fetched, gradients complete) into its shadow extents. Held gradients
        (see [Note: held gradients]) are normed by the stream, a flat buffer was normed here;
        either goes home only with clipping configured (see [Note: the gradient of a
        speculated step])."""
        at_home = False
        if state.grad.parts is not None:
            gradient = self.gradients.take(state)
            state.keep_gradient()
            state.count_norm()                # the job's norm joins at step()
        else:
            self.gradients.zero_unwritten(state)
            grads = self.gradients.finish(state, write_home=False)
            at_home = state.grad_store.resident      # accumulated in its home: nothing to rebuild
            gradient = self.gradients.take(state, grads)
        params = self.gradients.take_arrived(state)
        # with clipping configured a roll-back is a likely outcome: the gradient goes home
        # while backward runs; without, only rare events roll back (see the note)
        home = not at_home and (clip_norm > 0 or any(
            _l2(self.kernel.hyper(e.group_index)) for e in state.unit.trainable_entries()))
        job = submit(state, gradient, params, speculative=True, grad_scale=loss_scale,
                     gradient_home=home)
        if not (at_home or home):
            self._gradient_not_home.add(state.unit.index)
        self.jobs.append(job)
        return job

    def collect_norms(self) -> None:
        """Add the norms the stream computed for speculated held gradients to the step's norm
        (once per job; waits for their kernels)."""
        for job in self.jobs:
            job.stepped_future.result()
            self.steps.collect_norm(job)

    def resolve(self, keep: bool, overflow: bool = False) -> None:
        """At ``step()``: commit (``keep``) or roll back every speculated unit (for the deferred
        step, or with ``overflow`` for no step at all). A speculation whose hyperparameters are
        no longer this step's (the learning rate was set between backward and step) is rolled
        back too."""
        self.pays = keep
        if not self.jobs:
            return
        now = self.kernel.hyperparameters()
        if keep and any(job.hyper != now for job in self.jobs):
            self.roll_back("the hyperparameters changed after the backward")
            return
        if not keep:
            self.roll_back("an overflow" if overflow else "clipping",
                           rebuild_gradients=not overflow)
            return
        for job in self.jobs:
            job.stepped_future.result()     # its writes are issued: bound to the shadow extents
        # (waited first: an interrupt there leaves the speculation whole, to be resolved again)
        speculated, self.jobs = self.jobs, []
        self._gradient_not_home.clear()
        for job in speculated:
            state = job.state
            for store in (state.unit.param_store, state.exp_avg, state.exp_avg_sq, state.master):
                if store is not None:
                    store.flip()
            state.clear_gradient()
            if state.grad_store.resident:
                state.grad_store.tensor.zero_()   # the next cycle accumulates from zero
        self.stats["committed"] += 1

    def roll_back(self, why: str, rebuild_gradients: bool = True) -> None:
        """Drop every speculated result: wait for the jobs (their writes read the units' device
        copies), give their step counts back, and list the units whose device copies must be
        dropped (``rolled_back``). With ``rebuild_gradients`` the gradients are rebuilt at
        home for the deferred path (see [Note: the gradient of a speculated step])."""
        # every wait first: an interrupt (Ctrl-C) in one leaves the speculation whole, to be
        # rolled back again; a failed step is raised (and recorded) by reap, after the
        # bookkeeping below
        with contextlib.suppress(Exception):
            self.collect_norms()   # the gradients stay counted (norm_counted)
        self.stats["voided" if why == VOIDED else "rolled_back"] += 1
        speculated, self.jobs = self.jobs, []
        try:
            self.steps.reap(Wait.ALL, hand_out=False)   # the engine releases them next
        finally:
            for job in speculated:
                state = job.state
                if job.counted:
                    self.kernel.uncount_step(state, job.params)
                if job.phase in (JobPhase.REAPED, JobPhase.FAILED):
                    job.roll_back()
                else:   # a failure cut the wait short: its count went back all the same
                    job.runs = None
                # the deferred step takes these parameters' gradients from home
                state.arrived |= job.params if job.params is not None else {
                    e.offset for e in state.unit.trainable_entries()}
                self.rolled_back.append(state.unit)
        log.debug("speculative step of %d unit(s) rolled back (%s)", len(speculated), why)
        if rebuild_gradients:
            self._rebuild_gradients([j for j in speculated
                                     if j.state.unit.index in self._gradient_not_home])
        self._gradient_not_home.clear()

    def _rebuild_gradients(self, speculated: list[StepJob]) -> None:
        """Write each unit's gradient home, recovered from the m its step read and the m it
        wrote (see [Note: the gradient of a speculated step]), through a free gradient slot (or
        the accumulation chunk) cut in pieces."""
        if not speculated:
            return
        slot = self.grad_pool.try_acquire() if self.grad_pool is not None else None
        try:
            pieces = _pieces(slot.view(torch.float32, self.grad_pool.slot_bytes // 4)
                             if slot is not None else self.gradients.chunk_buffer(), 3)
            if pieces is None:   # units of under 3 x 1024 elements: a small buffer of its own
                pieces = _pieces(self.manager.host_empty(3 * BLOCK_NUMEL, torch.float32,
                                                         what="gradient rebuild"), 3)
            for job in speculated:
                self._rebuild_gradient(job, *pieces)
        finally:
            if slot is not None:
                self.grad_pool.release(slot)

    def _rebuild_gradient(self, job: StepJob, m_old: torch.Tensor, m_new: torch.Tensor,
                          out: torch.Tensor) -> None:
        """One unit's rebuild, ``m_old.numel()`` elements at a time."""
        state = job.state
        chunk = m_old.numel()
        n, home = state.unit.trainable_numel, state.grad_store
        for start in range(0, n, chunk):
            count = min(chunk, n - start)
            self.manager.wait(state.exp_avg.load_async(m_old, start, count),
                              state.exp_avg.load_async(m_new, start, count, shadow=True))
            out.zero_()
            for run in job.runs:
                a, b = max(run.start, start) - start, min(run.end, start + count) - start
                if a < b:
                    g = _gradient_term(m_old[a:b], m_new[a:b], job.hyper[run.group_index]["beta1"])
                    out[a:b] = g.mul_(job.grad_scale)
            if home.resident:
                home.tensor[start:start + count].copy_(out[:count])
            else:
                self.manager.wait(home.store_async(out, start, count))

    def void(self) -> None:
        """Something reads the model before ``step()``: roll back now, so it sees the
        parameters of the last step; the deferred path takes this cycle over. The caller drops
        the device copies ``take_rolled_back`` lists."""
        if self.jobs:
            self.roll_back(VOIDED)

    def take_rolled_back(self) -> list[SteppedUnit]:
        """The units rolled back since the last call (their device copies are stale)."""
        units, self.rolled_back = self.rolled_back, []
        return units


def _l2(hyper: dict) -> bool:
    """Whether a param group's step added weight decay to the gradient (Adam's L2 mode)."""
    return not hyper["adamw_mode"] and hyper["weight_decay"] != 0.0


def _gradient_term(m: torch.Tensor, m_new: torch.Tensor, beta1: float) -> torch.Tensor:
    """(m_new - beta1 * m) / (1 - beta1) in float64, with beta1 * m and 1 - beta1 rounded to
    float32 as the kernel rounded them: where the step's gradient term was exactly 0 (a row
    no token used), so is this, and m, v that are 0 stay 0 in the redone step (noise there
    would be divided by a v of the same size)."""
    one_minus_beta1 = float(torch.tensor(1.0 - beta1, dtype=torch.float32))
    return (m_new - m * beta1).double().div_(one_minus_beta1)


def _pieces(buffer: torch.Tensor, parts: int) -> list[torch.Tensor] | None:
    """``parts`` equal pieces of ``buffer``, each a multiple of 4 KiB (so each starts on an
    O_DIRECT boundary of a page-aligned buffer); None when it is too small."""
    size = buffer.numel() // parts // BLOCK_NUMEL * BLOCK_NUMEL
    return None if size == 0 else [buffer[i * size:(i + 1) * size] for i in range(parts)]
