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
the shadow extents, reading only the current ones; its gradient is written home as the deferred
schedule does. At ``step()`` the norm is known:
- no clipping acts and the gradients are finite: commit. Every speculated store flips (the
  shadow becomes current) and nothing is left to do; the units' device copies are the new
  parameters, as after an early step.
- clipping acts, or a gradient overflowed: roll back. The current extents still hold the old
  states; the speculated units' device copies (new parameters) are dropped, their step counts
  go back, and the deferred step runs from the gradients at home (or, on overflow, nothing).
A unit that cannot be doubled (persistent, or a state resident in memory) is not speculated and
takes the deferred path. Reading the model between backward and step (a forward, or
GatheredParameters) would see speculated parameters, so the speculation is rolled back first
(``void``), and the deferred path takes over for that cycle.

With ``speculative_step`` "auto" a step speculates while the last step would have kept its
speculation (first step included): a run whose gradients are clipped every step stops paying
the wasted writes after one step and tries again after a step that needed no clipping.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from infinity.log import get_logger
from infinity.optim.gradients import CompleteGradient
from infinity.zero.unit import Unit

if TYPE_CHECKING:
    from infinity.optim.partitioned import UnitOptimState
    from infinity.optim.step_stream import StepJob

log = get_logger("optim")

SPECULATION_MODES = ("off", "auto", "on")
VOIDED = "the model was read before step()"   # a roll-back counted as "voided"


class Speculation:
    """The speculative side of ``PartitionedOptimizer`` (its states, stream and pending steps)."""

    def _init_speculation(self, mode: str) -> None:
        if mode not in SPECULATION_MODES:
            raise ValueError(f"speculative step mode {mode!r}: expected one of {SPECULATION_MODES}")
        self.speculation = mode
        self._speculating = False        # this backward speculates
        self._speculated: list[tuple[UnitOptimState, StepJob]] = []
        self._speculation_pays = True    # the last step would have kept its speculation
        self.rolled_back: list[Unit] = []  # units whose device copies hold rolled-back values
        self.speculation_stats = {"committed": 0, "rolled_back": 0, "voided": 0}

    # -- deciding --------------------------------------------------------------------------
    def plans_speculation(self) -> bool:
        """Whether the next cycle's last backward will speculate."""
        if self.early_step or self.speculation == "off":
            return False
        return self.speculation == "on" or self._speculation_pays

    def _can_speculate(self, state: UnitOptimState) -> bool:
        """Every store the unit's step writes has a shadow extent (see the note)."""
        store = state.unit.param_store
        return (self._speculating and store is not None and store.doubled
                and state.exp_avg.doubled and state.exp_avg_sq.doubled
                and (state.master is None or state.master.doubled)
                and not any(s is state for s, _ in self._speculated))

    @property
    def speculation_pending(self) -> bool:
        """Speculated steps wait for ``step()`` to keep or drop them."""
        return bool(self._speculated)

    # -- running ---------------------------------------------------------------------------
    def _speculate(self, state: UnitOptimState) -> StepJob:
        """Step the unit (fetched, gradients complete) into its shadow extents; its gradient
        goes home from the job (for a redo). Held gradients (see [Note: held gradients]) are
        normed and copied home by the stream; a flat buffer was normed here."""
        if state.grad_parts is not None:
            gradient = self._take_gradient(state)
            state.has_grads = state.norm_counted = True    # the job's norm joins at step()
        else:
            self._zero_unwritten(state)
            grads = self._finish_grads(state, write_home=False)
            gradient = CompleteGradient(grads, state.grad_slot)
            state.grad_slot = state.grad_buffer = state.grad_written = None
            state.grads_seen = 0
        params = self.take_arrived(state)
        job = self._expected.pop(state.unit.index, None)
        if job is not None:
            self._stream.make_ready(job, gradient, speculative=True, grad_scale=self.loss_scale,
                                    params=params)
        else:
            job = self._stream.submit(state, early=True, gradient=gradient,
                                      grad_scale=self.loss_scale, speculative=True,
                                      params=params)
        self._pending_steps.append((state, job))
        self._speculated.append((state, job))
        return job

    def _collect_speculated_norms(self) -> None:
        """Add the norms the stream computed for speculated held gradients to the step's norm
        (once per job; waits for their kernels)."""
        for _, job in self._speculated:
            if not job.norm_collected:
                job.stepped.result()
                self._sq_norm += job.sq_norm
                job.norm_collected = True

    def _resolve_speculation(self, keep: bool) -> None:
        """At ``step()``: commit (``keep``) or roll back every speculated unit. A speculation
        whose hyperparameters are no longer this step's (the learning rate was set between
        backward and step) is rolled back too."""
        self._speculation_pays = keep
        if not self._speculated:
            return
        now = self.hyperparameters()
        if keep and any(job.hyper != now for _, job in self._speculated):
            self._roll_back("the hyperparameters changed after the backward")
            return
        if not keep:
            self._roll_back("clipping or an overflow")
            return
        speculated, self._speculated = self._speculated, []
        for _, job in speculated:
            job.stepped.result()     # its writes are issued: bound to the shadow extents
        for state, _ in speculated:
            for store in (state.unit.param_store, state.exp_avg, state.exp_avg_sq, state.master):
                if store is not None:
                    store.flip()
            state.has_grads = state.norm_counted = False
            if state.grad_store.resident:
                state.grad_store.tensor.zero_()   # the next cycle accumulates from zero
        self.speculation_stats["committed"] += 1

    def _roll_back(self, why: str) -> None:
        """Drop every speculated result: wait for the jobs (their writes read the units' device
        copies), give their step counts back, and list the units whose device copies must be
        dropped (``rolled_back``). The gradients stay at home for the deferred path."""
        self.speculation_stats["voided" if why == VOIDED else "rolled_back"] += 1
        try:
            self._collect_speculated_norms()   # the gradients stay counted (norm_counted)
        finally:
            speculated, self._speculated = self._speculated, []
        try:
            self.reaped_at_step.extend(self.reap(wait=True))
        finally:
            for state, job in speculated:
                if job.counted:
                    self.uncount_step(state, job.params)
                    job.counted = False
                # the deferred step takes these parameters' gradients from home
                state.arrived |= job.params if job.params is not None else {
                    e.offset for e in state.unit.trainable_entries()}
                self.rolled_back.append(state.unit)
        log.debug("speculative step of %d unit(s) rolled back (%s)", len(speculated), why)

    def void_speculation(self) -> None:
        """Something reads the model before ``step()``: roll back now, so it sees the
        parameters of the last step; the deferred path takes this cycle over. The caller drops
        the device copies ``take_rolled_back`` lists."""
        if self._speculated:
            self._roll_back(VOIDED)

    def take_rolled_back(self) -> list[Unit]:
        """The units rolled back since the last call (their device copies are stale)."""
        units, self.rolled_back = self.rolled_back, []
        return units
