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


def test_warmup_decay_ends_at_the_min_lr_as_deepspeed() -> None:
    """DeepSpeed's WarmupDecayLR: lr = min + (max - min) * gamma, gamma falling linearly to 0 at
    total_num_steps after the warm-up, so the run ends at warmup_min_lr, not at 0."""
    lrs = _lrs({"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 2,
        "total_num_steps": 6, "warmup_type": "linear"}}, 8)
    assert lrs == pytest.approx([0.01, 0.055, 0.1, 0.0775, 0.055, 0.0325, 0.01, 0.01])


def test_warmup_cosine_as_deepspeed() -> None:
    """DeepSpeed's WarmupCosineLR: a warm-up of 1 step is made 2, and the cosine's progress at
    step i is (i - warmup + 1) / (total - warmup), capped at 1."""
    lrs = _lrs({"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 1, "total_num_steps": 11, "cos_min_ratio": 0.1,
        "warmup_type": "linear"}}, 13, lr=2.0)

    def cosine(progress: float) -> float:
        return 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    assert lrs[0] == pytest.approx(0.0) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(cosine(1 / 9))
    assert lrs[6] == pytest.approx(cosine(5 / 9))
    assert lrs[10] == pytest.approx(0.2) and lrs[12] == pytest.approx(0.2)


def test_a_one_step_warmup_is_two_steps_as_deepspeed() -> None:
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                               "warmup_num_steps": 1, "warmup_type": "linear"}}, 3)
    assert lrs == pytest.approx([0.0, 0.05, 0.1])


def test_decay_without_total_steps_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="total_num_steps"):
        _lrs({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2}}, 1)
