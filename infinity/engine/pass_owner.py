"""The engine as the coordinator's ``PassOwner`` (zero/protocols.py): what the stage-3 hooks tell
the engine, kept off the engine's public surface."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from infinity.engine.guards import FOREIGN_EARLY_BACKWARD, SECOND_EARLY_BACKWARD
from infinity.zero.init import engine_in_backward

if TYPE_CHECKING:
    from infinity.engine.engine import Engine
    from infinity.zero.unit import Unit


class EnginePassOwner:
    """Forwards the coordinator's calls to the engine that owns the passes."""

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
        engine._void_speculation()
        optimizer.loss_scale = engine.loss_scale
        optimizer.begin_backward(engine.is_gradient_accumulation_boundary())
        engine._hyper_at_backward = optimizer.hyperparameters() if optimizer.early_step else None
        self._started = time.perf_counter()

    def end_untracked_backward(self) -> None:
        engine = self._engine
        engine.report.add_time("backward", time.perf_counter() - self._started)
        engine._release_dropped_activations()
        engine.optimizer.end_backward()
        engine._backwards_since_step += 1
