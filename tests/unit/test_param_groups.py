"""Param groups given to ``infinity.initialize`` are checked there, with the group's index and
what is wrong, not at the first step (infinity/engine/param_groups.py)."""
from __future__ import annotations

import pytest
import torch

import infinity

CONFIG = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


@pytest.mark.parametrize("groups, message", [
    (lambda m: m.named_parameters(), "pairs: pass model.parameters"),
    (lambda m: [{"params": list(m.parameters()), "lr": "0.1"}], "group 0: lr must be a finite"),
    (lambda m: [{"params": [m[0].weight]}, {"params": [m[1].weight], "lr": -0.1}],
     "group 1: lr must be a finite number >= 0, got -0.1"),
    (lambda m: [{"params": list(m.parameters()), "betas": 0.9}], "betas must be two numbers"),
    (lambda m: [{"params": list(m.parameters()), "betas": (0.9, 1.0)}], "betas must be two"),
    (lambda m: [{"params": list(m.parameters()), "weight_decay": None}], "weight_decay must"),
    (lambda m: [{"lr": 0.1}], 'group 0 must be a dict with a "params" list'),
    # a learnable loss temperature outside the model was accepted and never stepped
    (lambda m: [{"params": list(m.parameters())},
                {"params": [torch.nn.Parameter(torch.ones(()))]}],
     r"param group 1 holds a parameter of shape \(\) that is not in the model"),
    (lambda m: [{"params": list(m.parameters()), "momentum": 0.9}], "a setting of another optimizer"),
    (lambda m: [{"params": list(m.parameters()), "weight_decy": 0.1}], "did you mean .weight_decay."),
    (lambda m: [{"params": list(m.parameters()), "adamw_mode": "false"}],
     r"group 0: adamw_mode must be true or false, got 'false'"),
    (lambda m: [{"params": [m[0].weight]}, {"params": [m[0].weight]}],
     r"listed in param groups 0 and 1"),
    (lambda m: [{"params": [m[0].weight, m[0].weight]}], r"listed twice in param group 0"),
])
def test_bad_param_groups_are_refused_at_initialize(groups, message) -> None:
    model = _model()
    with pytest.raises(ValueError, match=message):
        infinity.initialize(model=model, model_parameters=groups(model), config=CONFIG)


def test_good_param_groups_are_taken() -> None:
    model = _model()
    engine, optimizer, _, _ = infinity.initialize(
        model=model, config=CONFIG,
        model_parameters=[{"params": model[0].weight}, {"params": list(model[1].parameters()),
                                                        "lr": 0.5, "betas": [0.8, 0.9]}])
    try:
        assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 0.5]
    finally:
        engine.close()
