"""What the stage-3 coordinator (zero/coordinator.py) knows of the pass in progress and of each
unit: one enum and one record per unit, instead of parallel flags."""
from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Iterable

import torch


class PassPhase(enum.Enum):
    """The pass begun last (its value names its trace). A training forward stays the phase
    after it returns, until its backward begins: the units it used next are the backward's."""

    IDLE = None                   # none since the last backward ended (or a pass was abandoned)
    TRAIN_FORWARD = "train_fwd"
    EVAL_FORWARD = "eval_fwd"     # also a forward under no_grad, and one begun by no pass
    BACKWARD = "bwd"              # from its first pre-backward hook to its end-of-backward callback


FORWARDS = (PassPhase.TRAIN_FORWARD, PassPhase.EVAL_FORWARD)


class UnitBackward(enum.Enum):
    """Where a unit is in the backward in progress (each backward starts every unit PENDING).

    PENDING -> FETCHED (a pre-backward hook fetched it) -> INPUTS_DONE (the gradient w.r.t. its
    module's inputs exists) -> DONE (its gradients are complete); a unit's gradients may
    complete before its inputs' (DONE from FETCHED), and the end of the backward finishes any
    unit whose gradients came (DONE from PENDING). Transitions go through ``UnitStatus``'s
    verbs and are checked: finishing a unit twice in one backward is a bug, raised."""

    PENDING = "pending"
    FETCHED = "fetched"
    INPUTS_DONE = "inputs done"
    DONE = "done"


_FETCH = {UnitBackward.PENDING: UnitBackward.FETCHED}
"""A pre-backward fetch moves only a unit the backward has not reached (fetched again, or after
its backward, it stays where it is: see [Note: release during backward])."""
_INPUTS = {UnitBackward.PENDING: UnitBackward.INPUTS_DONE,
           UnitBackward.FETCHED: UnitBackward.INPUTS_DONE}
_FINISH = {UnitBackward.PENDING: UnitBackward.DONE, UnitBackward.FETCHED: UnitBackward.DONE,
           UnitBackward.INPUTS_DONE: UnitBackward.DONE}


@dataclasses.dataclass
class UnitStatus:
    """One unit as the coordinator's hooks see it."""

    users: int = 0           # module calls in progress and pins holding it fetched
    pins: int = 0            # of ``users``: held by ``pin``, not by hooks
    grads_pending: int = 0   # trainable parameters whose gradient this backward has not brought
    backward: UnitBackward = UnitBackward.PENDING
    stepping: bool = False       # a background step holds it fetched
    # its device copy holds a newer own shard than the other ranks' shards in it (a step ran, or
    # only the own shard was read): gathered before the next use (see [Note: shards])
    stale: bool = False
    versions: int | None = None  # its parameters' version counters at a forward's first use
    # a training forward saved a tensor reading its trainable values without their gradient:
    # its backward is done only at the backward's end (see zero/detached_reads.py)
    read_detached: bool = False
    # a training forward ran it under saved-tensor hooks not the engine's (non-reentrant
    # checkpointing), which hide its saves: done only once its inputs' gradient exists too.
    # Both stay set for the run: a backward's end must not clear what a forward whose backward
    # is still to come set (two forwards, then their backwards), and a model reads alike each step
    saves_unseen: bool = False
    # the training forwards' calls whose inputs carry a gradient (their backward is marked:
    # zero/input_gradients.py) and have not had it, held weakly (a dropped graph takes its
    # calls along); since the last backward, those marked and the calls whose inputs carry
    # none; ``forced``: finished with gradients this rank did not get (several ranks: at the
    # mark, where every rank finishes it)
    open_calls: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)
    calls_reached: int = 0
    calls_blind: int = 0
    forced: bool = False
    # training-forward calls run without grad whose inputs carry one: a reentrant checkpoint's
    # first forward, whose recomputation in the backward is watched instead (until then no
    # mark; [Note: a call's inputs mark its backward])
    calls_to_recompute: int = 0

    @property
    def held(self) -> bool:
        """A module call, a pin or a step needs it fetched."""
        return self.users > 0 or self.stepping

    @property
    def backward_done(self) -> bool:
        return self.backward is UnitBackward.DONE

    @property
    def inputs_done(self) -> bool:
        """The gradient w.r.t. its module's inputs exists (its backward may still be waiting
        for its parameters' gradients)."""
        return self.backward is UnitBackward.INPUTS_DONE

    @property
    def backward_may_read(self) -> bool:
        """A pre-backward hook of this backward fetched it and its backward is not done: an op
        about to run may read it (see [Note: release during backward])."""
        return self.backward in (UnitBackward.FETCHED, UnitBackward.INPUTS_DONE)

    def start_backward(self, trainable: int) -> None:
        self.grads_pending = trainable
        self.backward = UnitBackward.PENDING
        self.calls_blind = self.calls_reached = 0     # open calls: a later backward's
        self.calls_to_recompute = 0
        self.forced = False

    def note_call(self, call: Any) -> None:
        """A training forward's call of its module: the inputs' ``CallInputs``, or None where
        none carries a gradient."""
        if call is None:
            self.calls_blind += 1
        else:
            self.open_calls.add(call)

    def went_blind(self, call: Any) -> None:
        """A call whose output reads none of its inputs under grad (``drop_unused``): it
        counts as one whose inputs carry no gradient."""
        self.open_calls.discard(call)
        self.calls_blind += 1

    def unfinished_at_end(self, trainable: int, ranks: int) -> bool:
        """At the backward's end, not finished though it took part: some gradient came, or
        with several ranks its calls were watched (each rank finishes it then, alike)."""
        return not self.backward_done and (self.grads_pending < trainable or ranks > 1 and
                                           bool(self.calls_reached or self.calls_blind))

    @property
    def calls_done(self) -> bool:
        """Every call whose graph lives has the gradient of its inputs, one of them in this
        backward, and none had inputs without one: the point where its backward is over on
        every rank, whatever gradients each got ([Note: a call's inputs mark its backward])."""
        return self.calls_blind == 0 and self.calls_reached > 0 and not self.open_calls

    def may_finish(self, trainable: bool, frozen: bool, ranks: int) -> bool:
        """Its backward may be finished now (its gradients reduced, its step begun): once its
        gradients are in, or with several ranks where every rank finishes it ([Note: a call's
        inputs mark its backward]: a call whose inputs carry no gradient has no mark, so the
        backward's end) -- then ``forced`` says this rank lacked some; and once its inputs have
        their gradient where saves of its weights may be read still (frozen parameters, saves
        the hooks did not see) or it has nothing to train."""
        if self.backward_done or self.read_detached:
            return False
        if ranks > 1 and (self.open_calls or self.calls_reached or self.calls_blind):
            if self.calls_blind or not self.calls_done:
                return False
            self.forced = self.grads_pending > 0
        elif self.grads_pending > 0:
            return False
        return self.inputs_done or (trainable and not frozen and not self.saves_unseen)

    def fetched_for_backward(self) -> None:
        self.backward = _FETCH.get(self.backward, self.backward)

    def reached_inputs(self, call: Any = None) -> None:
        """A call of its module has the gradient w.r.t. its inputs."""
        if call is not None:
            self.open_calls.discard(call)
        self.calls_reached += 1
        self.backward = _INPUTS.get(self.backward, self.backward)

    def finish_backward(self) -> None:
        """Its gradients are complete: once per backward."""
        if self.backward not in _FINISH:
            raise RuntimeError(f"a unit's backward finished twice in one backward (state "
                               f"{self.backward.value}): the coordinator's hooks ran out of order")
        self.backward = _FINISH[self.backward]


DOUBLE_BACKWARD = (
    "a backward with create_graph=True (a double backward: a gradient penalty, a "
    "Hessian-vector product) reached parameters that ZeRO stage 3 releases after use, so its "
    "second backward would find them empty. Train such a loss with zero_optimization.stage 1 "
    "or 2 (offload_optimizer still works), as with DeepSpeed")
"""A backward with grad mode on (create_graph) reaching a released unit's hooks: refused."""


def defer_to_recompute(statuses: list[UnitStatus], inputs: Iterable[torch.Tensor]) -> None:
    """A training forward's call run without grad whose inputs carry one (a reentrant
    checkpoint's first forward): no mark now; its recomputation in the backward, whose graph is
    the one the backward runs, is watched instead (``take_recompute``)."""
    if any(t.requires_grad for t in inputs):
        for status in statuses:
            status.calls_to_recompute += 1


def drop_unused_inputs(call: Any, output: Any, statuses: list[UnitStatus]) -> None:
    """With several ranks: a call's inputs its output does not read are not waited for
    (``CallInputs.drop_unused``); a call left with none counts as one without a mark."""
    if call.drop_unused(output):
        for status in statuses:
            status.went_blind(call)


def take_recompute(statuses: list[UnitStatus]) -> bool:
    """Whether a recomputation's call is watched: its first forward's was not (above). A
    non-reentrant checkpoint's recomputation is not: its first forward's call was watched, and
    is open still (a unit also called under no_grad in that forward, a frozen teacher's block,
    counted a call to recompute that never comes: watching the recomputed graph, which no
    backward runs, held the unit open)."""
    if not all(status.calls_to_recompute and not status.open_calls for status in statuses):
        return False
    for status in statuses:
        status.calls_to_recompute -= 1
    return True


def next_trainable(units, statuses: list[UnitStatus], order: list[int], count: int) -> list[int]:
    """The first ``count`` distinct units of ``order`` (indices into ``units`` and
    ``statuses``) with trainable parameters whose backward is not done."""
    found: list[int] = []
    for uid in order:
        if len(found) == count:
            break
        if uid not in found and units[uid].has_trainable and not statuses[uid].backward_done:
            found.append(uid)
    return found


def upcoming_units(phase: PassPhase, traces: dict) -> list[int]:
    """The recorded order from now on (``traces`` by phase value): the rest of this pass, then
    the pass that follows."""
    fwd, bwd = traces["train_fwd"], traces["bwd"]
    if phase is PassPhase.BACKWARD:
        return bwd.upcoming() + fwd.order
    if phase is PassPhase.TRAIN_FORWARD:
        return fwd.upcoming() + bwd.order
    if phase is PassPhase.EVAL_FORWARD:
        return traces["eval_fwd"].upcoming()
    return list(fwd.order)   # after a backward: the next training forward
