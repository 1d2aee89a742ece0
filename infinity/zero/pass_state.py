"""What the stage-3 coordinator (zero/coordinator.py) knows of the pass in progress and of each
unit: one enum and one record per unit, instead of parallel flags."""
from __future__ import annotations

import dataclasses
import enum


class PassPhase(enum.Enum):
    """The pass begun last (its value names its trace). A training forward stays the phase
    after it returns, until its backward begins: the units it used next are the backward's."""

    IDLE = None                   # none since the last backward ended (or a pass was abandoned)
    TRAIN_FORWARD = "train_fwd"
    EVAL_FORWARD = "eval_fwd"     # also a forward under no_grad, and one begun by no pass
    BACKWARD = "bwd"              # from its first pre-backward hook to its end-of-backward callback


FORWARDS = (PassPhase.TRAIN_FORWARD, PassPhase.EVAL_FORWARD)


@dataclasses.dataclass
class UnitStatus:
    """One unit as the coordinator's hooks see it."""

    users: int = 0           # module calls in progress and pins holding it fetched
    pins: int = 0            # of ``users``: held by ``pin``, not by hooks
    grads_pending: int = 0   # trainable parameters whose gradient this backward has not brought
    inputs_done: bool = False    # the gradient w.r.t. its module's inputs exists
    backward_done: bool = False  # see [Note: release during backward]
    # a pre-backward hook of this backward fetched it: until its backward is done, an op about
    # to run may read it (see [Note: release during backward])
    backward_fetched: bool = False
    stepping: bool = False       # a background step holds it fetched
    # its device copy holds a newer own shard than the other ranks' shards in it (a step ran, or
    # only the own shard was read): gathered before the next use (see [Note: shards])
    stale: bool = False
    versions: int | None = None  # its parameters' version counters at a forward's first use

    @property
    def held(self) -> bool:
        """A module call, a pin or a step needs it fetched."""
        return self.users > 0 or self.stepping

    def start_backward(self, trainable: int) -> None:
        self.grads_pending = trainable
        self.inputs_done = self.backward_done = self.backward_fetched = False
