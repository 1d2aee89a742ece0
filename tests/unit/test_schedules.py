"""DeepSpeed's LR schedules as torch schedulers: values at known steps."""
from __future__ import annotations

import math

import pytest
import torch

from infinity.config import InfinityConfig
from infinity.optim.schedules import build_scheduler


def _lrs(sched_section: dict, steps: int, lr: float = 1.0) -> list[float]:
    cfg = InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": lr}},
                                    "scheduler": sched_section})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(cfg, opt, None)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_lr_linear_then_flat() -> None:
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                               "warmup_num_steps": 4, "warmup_type": "linear"}}, 7)
    assert lrs == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_warmup_decay_reaches_zero_at_total() -> None:
    lrs = _lrs({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 2,
                                                    "total_num_steps": 6, "warmup_type": "linear"}}, 7)
    assert lrs[2] == pytest.approx(0.1)
    assert lrs[6] == pytest.approx(0.0)


def test_warmup_cosine_ends_at_min_ratio() -> None:
    lrs = _lrs({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1, "total_num_steps": 11,
                                                     "cos_min_ratio": 0.1}}, 12, lr=2.0)
    assert lrs[1] == pytest.approx(2.0)
    assert lrs[6] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lrs[11] == pytest.approx(0.2)


def test_decay_without_total_steps_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="total_num_steps"):
        _lrs({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2}}, 1)
