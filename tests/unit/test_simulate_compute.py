"""The dry run's compute model (simulate/compute.py): each ``nn.Linear`` call charges the
clock 2 x tokens x its weight's elements FLOPs, each repeated block 4 x tokens x sequence x
width more for attention, counted per unit; a unit's backward is twice its forward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.simulate.clock import COMPUTE, SimClock
from infinity.simulate.compute import SimCompute
from infinity.zero.partition import partition

RATE = 1e9
TOKENS, SEQ, HIDDEN = 6, 3, 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(HIDDEN, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _run(hidden: int | None) -> tuple[SimClock, SimCompute, list]:
    model = _Model()
    specs = partition(model)
    clock = SimClock(spans=[])
    compute = SimCompute(clock, RATE)
    compute.install(model, specs, tokens=TOKENS, seq_len=SEQ, hidden=hidden)
    with torch.no_grad():
        model(torch.zeros(TOKENS, HIDDEN))
    return clock, compute, specs


@pytest.mark.parametrize("hidden", [None, HIDDEN], ids=["linears only", "with attention"])
def test_each_call_charges_its_flops_to_its_unit_and_the_clock(hidden: int | None) -> None:
    clock, compute, specs = _run(hidden)
    names = [s.name for s in specs]
    linear = 2.0 * TOKENS * HIDDEN * HIDDEN
    attention = 4.0 * TOKENS * SEQ * HIDDEN if hidden else 0.0
    expected = {names.index("layers.0"): linear + attention,
                names.index("layers.1"): linear + attention,
                names.index("head"): 2.0 * TOKENS * HIDDEN * 5}
    assert compute.flops == pytest.approx(expected, rel=1e-12)
    assert clock.now == pytest.approx(sum(expected.values()) / RATE, rel=1e-12)
    assert clock.io_wait_s == 0.0
    assert {row for row, *_ in clock.spans} == {COMPUTE}
    head = next(u for u in range(len(specs)) if specs[u].name == "head")

    class _Unit:
        index = head
    assert compute.backward_s(_Unit()) == pytest.approx(2 * expected[head] / RATE, rel=1e-12)


def test_a_new_step_starts_from_no_flops() -> None:
    _, compute, _ = _run(HIDDEN)
    compute.begin_step()
    assert compute.flops and set(compute.flops.values()) == {0.0}


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_a_rate_that_is_not_positive_is_refused_with_its_value(rate: float) -> None:
    with pytest.raises(ValueError, match=f"flops_per_s is {rate}"):
        SimCompute(SimClock(), rate)
