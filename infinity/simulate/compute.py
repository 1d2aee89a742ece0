"""The training thread's compute on the simulated clock: forward hooks that advance the clock
by each call's FLOPs, and each unit's backward derived from its forward.

Why hooks: the dry run runs the model's own forward (on the meta device), so the calls it
charges are the ones the model makes, in its order, each at the point of the schedule where the
engine's coordinator has fetched (or is still waiting for) the unit that owns it.

The cost model: each ``nn.Linear`` call costs 2 x tokens x its weight's elements FLOPs, each
block (``zero.partition.find_blocks``) 4 x tokens x sequence x width more (attention), at
``flops_per_s``; a unit's backward is twice its forward (the stepper counts it when the unit's
first gradient arrives).
"""
from __future__ import annotations

from torch import nn

from infinity.simulate.clock import SimClock
from infinity.zero.partition import UnitSpec, find_blocks
from infinity.zero.unit import Unit

__all__ = ["SimCompute"]


class SimCompute:
    """The forward FLOPs of each unit in this micro-batch, charged to ``clock`` at
    ``flops_per_s``."""

    def __init__(self, clock: SimClock, flops_per_s: float) -> None:
        if flops_per_s <= 0:
            raise ValueError(f"the simulated compute needs a positive rate: flops_per_s is "
                             f"{flops_per_s}")
        self.clock, self.flops_per_s = clock, flops_per_s
        self.flops: dict[int, float] = {}
        """Forward FLOPs of this micro-batch, by unit index (``begin_step`` zeroes them)."""

    def begin_step(self) -> None:
        """A new step or micro-batch: its units' forward FLOPs start from zero."""
        for uid in self.flops:
            self.flops[uid] = 0.0

    def backward_s(self, unit: Unit) -> float:
        """Seconds ``unit``'s backward takes: twice its forward in this micro-batch."""
        return 2 * self.flops.get(unit.index, 0.0) / self.flops_per_s

    def install(self, model: nn.Module, specs: list[UnitSpec], *, tokens: int, seq_len: int,
                hidden: int | None) -> None:
        """Hook ``model``'s ``nn.Linear`` calls and, with ``hidden`` (the model's width; None:
        its shape is unknown), its blocks' attention; ``tokens`` a micro-batch's."""
        owner = {}
        for index, spec in enumerate(specs):
            for _, param in spec.params:
                owner[param] = index
        flops, clock, rate = self.flops, self.clock, self.flops_per_s

        def linear(module: nn.Module, args, output) -> None:
            weight = module.weight
            amount = 2.0 * tokens * weight.shape[0] * weight.shape[1]
            uid = owner.get(weight)
            if uid is not None:
                flops[uid] = flops.get(uid, 0.0) + amount
            clock.compute(amount / rate,
                          f"forward {specs[uid].name}" if uid is not None else "forward")

        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(linear)
        if hidden is None:
            return
        blocks = {id(m) for _, m in find_blocks(model)}
        for index, spec in enumerate(specs):
            if id(spec.module) in blocks:
                def attention(module, args, output, uid=index) -> None:
                    amount = 4.0 * tokens * seq_len * hidden
                    flops[uid] = flops.get(uid, 0.0) + amount
                    clock.compute(amount / rate, f"forward {specs[uid].name} attention")
                spec.module.register_forward_hook(attention)
