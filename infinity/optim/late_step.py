"""The late step: under the early step, the units the backward reaches first are stepped during
the next forward instead.

[Note: late step]
The early step runs each unit's step (read m and v, Adam, write parameters, m and v) while the
rest of the backward computes, so almost all of a step's disk traffic falls in the backward, and
at 0.49B with both on NVMe the backward waits on the disk while the forward's disk idles about
half its time (BENCHMARKS.md, session 12). The units the backward reaches first (the head, the
last layers) are the ones the next forward uses last: their steps can wait until after
``step()`` and run while the forward computes the units before them, moving their reads and
writes from the busy backward to the idle forward without changing a single value.

So at each backward a late set is chosen from the last recorded forward order: the last
trainable units to be first used, while their gradients together fit ``LATE_ROOM_UNITS``
largest units (a tied embedding, which the backward reaches first through the head, is the
forward's first unit: never late). When a
late unit's gradient is complete it is parked: its held parts leave the backward's room (which
must keep turning over, see [Note: held gradients] in optim/gradients.py) and wait in their
own, the unit stays fetched (its device copy is the fp32 master that will be stepped), and no
state of it is read. ``step()`` submits the parked steps, in the order the next forward uses
the units, waits for every other unit's kernels, and returns; the late steps run on the step
stream behind it. Whatever next reads a late unit -- the forward's fetch hook (training or eval),
``GatheredParameters``, ``flush`` -- waits for its kernels first, so nothing sees it before its
update; anyone who waits for steps (``settle``, device-memory backpressure) submits parked
steps first, so no wait can be for a step that was never submitted. The hyperparameters are the
ones of the backward, as for every early step. A failed backward drops the parked gradients
(they belong to the cycle being dropped), as the early step drops every gradient not yet
stepped. ``get_global_grad_norm`` waits for the late kernels, which sum their gradients'
squares as they step, as early ones do; the norm is settled at the latest when the next
backward begins.

Gradients are held only on a CPU device (where the late step is offered); a parked gradient
costs host memory (the host budget keeps a unit's worth for it) and its unit's device copy
stays in the device pool until the step has written it home.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from infinity.log import get_logger
from infinity.optim.gradients import CompleteGradient
from infinity.zero.unit import Unit

if TYPE_CHECKING:
    from infinity.optim.partitioned import UnitOptimState
    from infinity.optim.step_stream import StepJob

log = get_logger("optim")

LATE_ROOM_UNITS = 1.0   # largest units' worth of gradients parked for the late step


def choose_late_units(forward_order: list[int], trainable_numel: Callable[[int], int],
                      room_numel: int) -> frozenset[int]:
    """The last units of ``forward_order`` (each unit at its first use) with trainable
    parameters, while their gradients together fit ``room_numel`` elements (the first that
    does not fit ends the set: a unit before it is needed earlier in the next forward)."""
    chosen: list[int] = []
    total = 0
    for uid in reversed(list(dict.fromkeys(forward_order))):
        numel = trainable_numel(uid)
        if numel == 0:
            continue
        if total + numel > room_numel:
            break
        chosen.append(uid)
        total += numel
    return frozenset(chosen)


@dataclass(eq=False)
class ParkedStep:
    """A late unit's complete gradient, waiting for ``step()``."""

    state: UnitOptimState
    gradient: CompleteGradient
    params: frozenset[int]
    hyper: list[dict]           # of the backward that made the gradient
    nbytes: int


class LateSteps:
    """The late-step side of ``PartitionedOptimizer`` (its stream, states and timers)."""

    def _init_late_step(self, enabled: bool, max_trainable: int) -> None:
        self.late_step = enabled
        self.late_room_numel = int(LATE_ROOM_UNITS * max_trainable)
        self.late_ids: frozenset[int] = frozenset()
        self._parked: dict[int, ParkedStep] = {}
        self._late_jobs: list[StepJob] = []     # submitted; their norms not yet in last_grad_norm
        self._norm_open = False                 # last_grad_norm still waits for late kernels
        self._dropped_parked: list[Unit] = []   # for reap to hand back (released by the caller)
        self.late_stats = {"parked": 0, "parked_bytes_peak": 0, "waited_for": 0}

    # -- the norm --------------------------------------------------------------------------
    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm (after its late kernels have run)."""
        self._settle_late_norm()
        return self._last_grad_norm

    @last_grad_norm.setter
    def last_grad_norm(self, value: float | None) -> None:
        self._last_grad_norm = value
        self._norm_open = False

    def _settle_late_norm(self) -> None:
        """Wait for the late kernels of the last step and add their squares to its norm."""
        if not self._norm_open:
            return
        failed = False
        for job in self._late_jobs:
            try:
                job.stepped.result()
            except Exception:  # noqa: BLE001 - raised by reap; the norm is unknown
                failed = True
            self._collect_norm(job)
        self._late_jobs.clear()
        self._norm_open = False
        self._last_grad_norm = math.nan if failed else math.sqrt(self._sq_norm) / self.loss_scale

    # -- choosing and parking --------------------------------------------------------------
    def _choose_late(self) -> None:
        """The late set for this backward, from the last recorded forward order."""
        if not self.late_step:
            return
        by_unit = self._by_unit
        chosen = choose_late_units(
            self.forward_order(),
            lambda uid: by_unit[uid].unit.trainable_numel if uid in by_unit else 0,
            self.late_room_numel)
        if chosen != self.late_ids:
            log.info("late step: %s stepped during the next forward",
                     ", ".join(by_unit[u].unit.name for u in sorted(chosen)) or "no unit")
        self.late_ids = chosen

    def is_late(self, uid: int) -> bool:
        return uid in self.late_ids

    def _park(self, state: UnitOptimState, gradient: CompleteGradient,
              params: frozenset[int]) -> None:
        """Keep a late unit's complete gradient for ``step()``: its bytes leave the backward's
        room (see [Note: late step])."""
        nbytes = gradient.held_bytes
        self.held_room.give(nbytes)
        gradient.held_bytes = 0
        self._parked[state.unit.index] = ParkedStep(state, gradient, params,
                                                    self.hyperparameters(), nbytes)
        self.late_stats["parked"] += 1
        self.late_stats["parked_bytes_peak"] = max(
            self.late_stats["parked_bytes_peak"], sum(p.nbytes for p in self._parked.values()))

    def parked_units(self) -> list[Unit]:
        return [p.state.unit for p in self._parked.values()]

    def _submit_parked(self) -> None:
        """Queue the parked steps on the stream, in the order the next forward uses them."""
        if not self._parked:
            return
        position = {uid: i for i, uid in enumerate(self.forward_order())}
        for uid in sorted(self._parked, key=lambda u: position.get(u, len(position))):
            parked = self._parked.pop(uid)
            job = self._stream.submit(parked.state, early=True, gradient=parked.gradient,
                                      params=parked.params, hyper=parked.hyper)
            self._pending_steps.append((parked.state, job))
            self._late_jobs.append(job)

    def _wait_for_kernels_of(self, unit: Unit) -> None:
        """``unit`` is about to be read: submit its parked step if it has one, and wait until
        every step of it has run its kernels (its device copy is current)."""
        if unit.index in self._parked:
            self._submit_parked()
        running = [j for s, j in self._pending_steps if s.unit is unit and not j.stepped.done()]
        if not running:
            return
        self.late_stats["waited_for"] += 1
        start = time.perf_counter()
        try:
            for job in running:
                job.stepped.result()
        except Exception:  # noqa: BLE001 - raised by reap, which also drops the rest
            self.reap(wait=True)
            raise
        finally:
            self.timers.optimizer_s += time.perf_counter() - start

    def _drop_parked(self) -> list[Unit]:
        """Forget the parked gradients (a failed backward, or closing); returns their units,
        which no step holds any more."""
        units = []
        for parked in self._parked.values():
            self.release_gradient(parked.gradient)
            units.append(parked.state.unit)
        self._parked.clear()
        return units
