"""The engine as the coordinator's ``PassOwner`` (zero/protocols.py): what the stage-3 hooks tell
the engine, kept off the engine's public surface."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infinity.engine.engine import Engine
    from infinity.zero.unit import Unit


class EnginePassOwner:
    """Forwards the coordinator's calls to the engine that owns the passes."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def before_read(self) -> None:
        self._engine._void_speculation()

    def modified_in_forward(self, unit: Unit) -> None:
        self._engine._keep_forward_change(unit)

    def begin_untracked_backward(self) -> None:
        self._engine._begin_untracked_backward()

    def end_untracked_backward(self) -> None:
        self._engine._end_untracked_backward()
