"""The last micro-batch of an accumulating step steps each unit as its backward completes.

[Note: the last micro-batch steps early]
With gradient accumulation the early step cannot run (a unit's gradient is complete only after
the last micro-batch), so the deferred schedule keeps gradients at home and steps every unit
after the backward: on a GPU its steps run ahead of the next forward (zero/steps_ahead.py),
but a step's CPU Adam (0.18 s for the 0.49B model on the H200's 16 cores) outlasted that
forward's compute (~70 ms), so the first forward of each step waited for the Adam unit by unit
and the copies issued then ran beside an idle GPU (docs/benchmark-history.md, "The third H200 pass").

The gradient of a unit is complete, though, as soon as the last micro-batch's backward of that
unit is done: the home holds the earlier micro-batches' sum and this backward's copies add the
rest. Where no step needs the global gradient norm first -- no clipping and no fp16 overflow
check, the early step's own conditions (planner/placement.py ``choose_boundary_steps``) -- that
unit is stepped then, beside the rest of the backward, like an early step, with the home as its
gradient:
- the unit stays held until its step has landed (``on_unit_backward_done`` returns False), as
  in the early step; its Adam states are read ahead while the backward reaches it
  (``expect_backward``);
- the job's gradient is the resident home (``GradientCollector.take_home``), with the copies
  (on a GPU, the host adds) into it still landing: the step stream waits for them before its
  first read, and zeroes the home when it gives the gradient back, so the next cycle
  accumulates from zero;
- the kernels sum its squares (the norm ``get_global_grad_norm`` reports); ``step()`` waits for
  these jobs' kernels and collects their norms, and queues the deferred steps of the units it
  did not take (an NVMe home, or a unit whose last gradient came before the last micro-batch).
Only resident homes (host memory): an NVMe home would be written by the backward and read back
by the step, so with the optimizer's states (and so the gradients) on NVMe the units wait for
``step()`` as before, or the speculative step, chosen there where the swap space has room,
steps them in that backward into second copies (``RunPlan.boundary_steps`` is off with it).
A gradient that arrives for a unit after its step started (a module applied twice whose first
backward is recomputed later, as reentrant checkpointing of a shared block does) would be
missing from it: it is refused with what to do (``LATE_GRADIENT``), here and in the early step.
What the early step trades, this trades too: a step taken in the backward cannot be undone, so
``zero_grad()`` or another backward between it and ``step()`` is refused (engine/guards.py),
a change of the learning rate between the backward and ``step()`` applies from the next step
(with a warning), and a non-finite gradient is stepped, not skipped (the deferred schedule's
overflow check needs every gradient before any step).

[Note: the last adds fold into the step]
On a GPU each micro-batch's gradient lands in pinned staging and is added into the home by the
copies' adder thread (storage/host_adds.py): 10 bytes a parameter (the home read and written,
the 16-bit gradient read). In the last micro-batch those adds ran beside the step stream's Adam
of the units already complete, both on the host's memory bandwidth: per layer of the 0.49B
model ~0.5 GB of adds beside ~1.9 GB of Adam and zeroing, against ~17 ms of the layer's
backward on the H200 machine, so the steps fell behind the backward and the GPU waited for them
at the step's end. So in that backward a unit this class takes has its adds left to its step
(``GradientCollector._folding_now``: ``to_host(deferred=True)``, no thread makes them): the
step claims them from the gradient's landing events (``CompleteGradient.landed``, in issue
order; an event it cannot claim is waited where it stands, the claimed adds made first) and the
kernel adds each 64K-element chunk of them into the home chunk while it is in cache, right
before stepping it (``inf_adam_step_fold``): 2 bytes a parameter instead of 10, the bits those
of the adds made first. At most ``FOLDING_UNITS`` units hold such adds (their staging) at once;
beyond, the adder makes them as before. On a CPU device the adds are made at the copy and
there is nothing to fold; the late copies of the tests make every add at its wait, so there the
step folds all of a unit's adds not yet made.
"""
from __future__ import annotations

from infinity.optim.pending_steps import PendingSteps
from infinity.optim.records import StepJob, UnitOptimState

__all__ = ["BoundarySteps", "LATE_GRADIENT"]

LATE_GRADIENT = (
    "{unit}: a gradient arrived after the unit's backward was complete and its step had "
    "started (a module applied twice, its first application's backward recomputed later, as "
    "reentrant activation checkpointing does with a shared block, or a model run twice into "
    "one loss): the step read the gradient without it. Use non-reentrant checkpointing "
    "(use_reentrant=False), or set infinity.early_step \"off\" and "
    "infinity.speculative_step \"off\" (every step then waits for the whole backward)")


class BoundarySteps:
    """Whether the backward in progress steps its units as they complete, and the jobs it
    started this cycle (see the module's Note)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._boundary = False          # the backward in progress is the cycle's last
        self.jobs: list[StepJob] = []

    def begin_backward(self, boundary: bool) -> None:
        self._boundary = self.enabled and boundary

    def end_backward(self) -> None:
        self._boundary = False

    @property
    def now(self) -> bool:
        """The backward in progress steps its units as their gradients complete."""
        return self._boundary

    @property
    def pending(self) -> bool:
        """Units were stepped in this cycle's backward and ``step()`` has not collected them."""
        return bool(self.jobs)

    def takes(self, state: UnitOptimState) -> bool:
        """Whether ``state``'s unit is stepped now that its backward is done: in the last
        micro-batch, from a resident home."""
        store = state.grad_store
        return self._boundary and store is not None and store.resident

    def started(self, job: StepJob) -> None:
        self.jobs.append(job)

    def collect(self, steps: PendingSteps) -> bool:
        """At ``step()``: wait for the kernels of the units stepped in the backward and add
        their norms to the step's; whether there were any."""
        if not self.jobs:
            return False
        steps.wait_stepped()
        for job in self.jobs:
            steps.collect_norm(job)
        self.jobs = []
        return True
