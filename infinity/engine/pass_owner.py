"""The engine as its parts' owner: the coordinator's ``PassOwner`` (zero/protocols.py: what the
stage-3 hooks tell the engine) and the optimizer's ``OptimizerOwner`` (optim/protocols.py: a
torch-style loop's ``optimizer.step()`` / ``zero_grad()``, the next forward's order), kept off
the engine's public surface and passed to each part when it is built."""
from __future__ import annotations

from typing import TYPE_CHECKING

from infinity.engine.guards import (
    BACKWARD_AFTER_BOUNDARY_STEPS,
    FOREIGN_BOUNDARY_BACKWARD,
    FOREIGN_EARLY_BACKWARD,
    SECOND_EARLY_BACKWARD,
)
from infinity.zero.init import engine_in_backward

if TYPE_CHECKING:
    from infinity.engine.engine import Engine
    from infinity.zero.unit import Unit


class EnginePassOwner:
    """Forwards the coordinator's and the optimizer's calls to the engine that owns them."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._started = 0.0     # when the untracked backward in progress began

    def before_read(self) -> None:
        self._engine._void_speculation()

    def modified_in_forward(self, unit: Unit) -> None:
        self._engine._keep_forward_change(unit)

    def begin_untracked_backward(self) -> None:
        """``loss.backward()`` called directly (the coordinator saw the first gradient of a
        backward that engine.backward did not start): do what engine.backward does before it,
        except scaling the loss, which is the caller's (torch's semantics: no division by the
        accumulation steps). With fp16 loss scaling, or a second backward under the early step,
        that cannot be right, so it is refused."""
        engine = self._engine
        optimizer = engine.optimizer
        problem = None
        if engine.loss_scaler is not None:
            problem = ("loss.backward() was called directly with fp16 loss scaling on: the loss "
                       "was not multiplied by the loss scale, so every gradient would come out "
                       f"{engine.loss_scale:g}x too small. Call engine.backward(loss) instead")
        elif optimizer.early_step and engine._backwards_since_step:
            problem = SECOND_EARLY_BACKWARD.format(call="loss.backward()")
        elif optimizer.early_step and (other := engine_in_backward(engine)) is not None:
            problem = FOREIGN_EARLY_BACKWARD.format(
                other=type(other.module).__name__, this=type(engine.module).__name__)
        if problem is not None:
            optimizer.abandon_backward()
            raise RuntimeError(problem)
        # the last micro-batch's backward steps the units (optim/boundary_steps.py): refused
        # before any of this backward's gradients is taken, the cycle's are kept for step()
        if optimizer.boundary.pending:
            raise RuntimeError(BACKWARD_AFTER_BOUNDARY_STEPS.format(call="loss.backward()"))
        if optimizer.boundary.enabled and engine.is_gradient_accumulation_boundary() and \
                (other := engine_in_backward(engine)) is not None:
            raise RuntimeError(FOREIGN_BOUNDARY_BACKWARD.format(
                other=type(other.module).__name__, this=type(engine.module).__name__))
        self._started = engine._begin_backward()

    def end_untracked_backward(self) -> None:
        self._engine._end_backward(self._started)

    def settle_failed_backward(self) -> None:
        """Before a forward, a step or a zero_grad: a ``loss.backward()`` that raised (its end
        never came; the engine cannot catch its error) is dropped as ``engine.backward``'s
        where it delivered gradients; one that delivered none (a failed ``torch.autograd.grad``
        for a saliency map, say) only lets its pass go, the cycle's gradients kept."""
        engine = self._engine
        delivered = engine.coordinator.unfinished_backward()
        if delivered:
            self.abandon_failed_backward()
        elif delivered is not None:
            engine.coordinator.abandon_pass()

    def abandon_failed_backward(self) -> None:
        """A backward raised (``engine.backward``'s, or a ``loss.backward()`` whose end never
        came, found at the next forward): the rest of its gradients never come, so the cycle's
        are dropped, its micro-batches counted from its first again (the failed batch is
        skipped, as docs/training-loop.md says) and the pass let go, so the next starts clean."""
        engine = self._engine
        engine.micro_steps -= engine.micro_steps % engine.gradient_accumulation_steps()
        try:
            engine.optimizer.abandon_backward()
        finally:
            engine.coordinator.abandon_pass()
            engine._drop_rolled_back()
            engine._release_dropped_activations()

    # -- the optimizer's owner -------------------------------------------------------------
    def zero_grad(self, set_to_none: bool) -> None:
        self._engine.zero_grad(set_to_none)

    def step_from_optimizer(self) -> None:
        self._engine._step_from_optimizer()

    def forward_order(self) -> list[int]:
        return self._engine.coordinator.forward_order()
