"""The flat layout of a unit (zero/unit.py [Note: flat layout], computed in
infinity/planner/alignment.py): aligned, non-overlapping, and no frozen element inside the range
the optimizer steps; the sizing bound covers every layout, and a unit is laid out by it."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from infinity.planner.alignment import PARAM_ALIGN_BYTES, flat_layout, unit_layout_bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_parameters_start_after_the_stepped_range(dtype) -> None:
    rng = random.Random(0)
    align = PARAM_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    for _ in range(200):
        items = [(rng.randint(1, 3000), True) for _ in range(rng.randint(0, 5))]
        items += [(rng.randint(1, 3000), False) for _ in range(rng.randint(0, 5))]
        offsets, numel, trainable = flat_layout(items, dtype.itemsize)
        spans = sorted((o, o + n) for o, (n, _) in zip(offsets, items))
        assert all(a % align == 0 for a, _ in spans)
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:])), "overlap"
        assert numel >= max((b for _, b in spans), default=0)
        assert trainable % 1024 == 0 and numel * torch.empty((), dtype=dtype).element_size() % 4096 == 0
        for offset, (_, is_trainable) in zip(offsets, items):
            assert is_trainable == (offset < trainable), (items, offsets, trainable)


def test_the_sizing_bound_covers_the_unit_whatever_the_group_order() -> None:
    rng = random.Random(1)
    for _ in range(100):
        groups = [(rng.randint(1, 700), rng.random() < 0.6) for _ in range(rng.randint(1, 8))]
        bound_numel, bound_trainable = unit_layout_bound(groups, 4)
        rng.shuffle(groups)
        _, numel, trainable = flat_layout(sorted(groups, key=lambda t: not t[1]), 4)
        assert numel <= bound_numel and trainable <= bound_trainable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_unit_is_laid_out_as_the_planner_computes(dtype) -> None:
    from infinity.zero.unit import Unit

    module = nn.Module()
    named = []
    for i, (n, group) in enumerate([(5, 0), (70, -1), (33, 0), (1, 1)]):
        p = nn.Parameter(torch.zeros(n, dtype=dtype), requires_grad=group >= 0)
        module.register_parameter(f"p{i}", p)
        named.append((f"p{i}", p, group))
    unit = Unit(0, "u", module, named, dtype, torch.device("cpu"))
    order = sorted(named, key=lambda t: (t[2] < 0, t[2]))
    offsets, numel, trainable = flat_layout([(p.numel(), g >= 0) for _, p, g in order],
                                            dtype.itemsize)
    assert (unit.numel, unit.trainable_numel) == (numel, trainable)
    assert [e.offset for e in unit.params] == offsets
