"""The flat layout of a unit (zero/unit.py [Note: flat layout]): aligned, non-overlapping, and no
frozen element inside the range the optimizer steps; the sizing bound covers every layout."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from infinity.engine.sizing import _layout_bound
from infinity.zero.partition import UnitSpec
from infinity.zero.unit import PARAM_ALIGN_BYTES, flat_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_parameters_start_after_the_stepped_range(dtype) -> None:
    rng = random.Random(0)
    align = PARAM_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    for _ in range(200):
        items = [(rng.randint(1, 3000), True) for _ in range(rng.randint(0, 5))]
        items += [(rng.randint(1, 3000), False) for _ in range(rng.randint(0, 5))]
        offsets, numel, trainable = flat_layout(items, dtype)
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
        module = nn.Module()
        params = []
        for i in range(rng.randint(1, 8)):
            p = nn.Parameter(torch.empty(rng.randint(1, 700)), requires_grad=rng.random() < 0.6)
            module.register_parameter(f"p{i}", p)
            params.append((f"p{i}", p))
        spec = UnitSpec("u", module, params)
        bound_numel, bound_trainable = _layout_bound(spec, torch.float32)
        groups = [(p.numel(), p.requires_grad) for _, p in params]
        rng.shuffle(groups)
        _, numel, trainable = flat_layout(sorted(groups, key=lambda t: not t[1]), torch.float32)
        assert numel <= bound_numel and trainable <= bound_trainable
