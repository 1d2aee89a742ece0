"""What the partitioned optimizer asks of the engine that owns it.

Why a Protocol: the optimizer is below the engine (DESIGN.md "Layers") but a torch-style loop
calls it directly -- ``optimizer.zero_grad()``, ``optimizer.step()`` -- and those calls must go
through the engine's rules (the schedule's zero_grad, the step that counts micro-steps and
releases what the step held); and the deferred step runs units in the order the next forward
fetches them, which the coordinator records. The engine passes an owner at construction;
an optimizer built alone (tests, tools) has none and does the plain thing.
"""
from __future__ import annotations

from typing import Protocol

__all__ = ["OptimizerOwner"]


class OptimizerOwner(Protocol):
    def zero_grad(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad()`` from a torch-style loop: the engine's zero_grad."""

    def step_from_optimizer(self) -> None:
        """``optimizer.step()`` from a torch-style loop: the engine's step, without its
        scheduler (the loop steps its own); it comes back through the optimizer's
        ``owner_step``."""

    def forward_order(self) -> list[int]:
        """Unit indices in the order the next forward fetches them."""
