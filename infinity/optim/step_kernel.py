"""What the step stream (optim/step_stream.py) asks of the optimizer's Adam kernel
(optim/kernel.py): a Protocol, so that the stream, which moves sub-groups through memory and
threads, does not depend on how the kernel steps them (the speculation's and tests' kernels
step through the same calls)."""
from __future__ import annotations

from typing import Protocol

import torch

from infinity.optim.formatted_step import MomentScales
from infinity.optim.records import StepRun, UnitOptimState

__all__ = ["StepKernel"]


class StepKernel(Protocol):
    """What the stream asks of the optimizer's kernel (optim/kernel.py)."""

    def hyperparameters(self) -> list[dict]:
        """Each param group's hyperparameters now (fixed into a job when its step is asked)."""

    def step_runs(self, state: UnitOptimState, stepped: frozenset[int] | None) -> list[StepRun]:
        """Advance the unit's step count for ``stepped`` and return the runs to step."""

    def run(self, state: UnitOptimState, start: int, end: int, param: torch.Tensor,
            grad: torch.Tensor | dict[int, torch.Tensor], m: torch.Tensor, v: torch.Tensor,
            grad_scale: float, half_out: torch.Tensor | None, hyper: list[dict],
            runs: list[StepRun], grad_sq_sum: bool = False,
            scales: MomentScales | None = None, zero_grad: bool = False,
            addends: list[tuple[int, torch.Tensor]] | None = None) -> float:
        """Adam on elements [start, end) of the unit; the gradient's squares when asked; the
        gradient left at zero with ``zero_grad``, completed first by ``addends``."""
