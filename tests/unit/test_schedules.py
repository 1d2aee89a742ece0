"""DeepSpeed's LR schedules: the lr (and betas) each optimizer step runs at, as DeepSpeed 0.19.8's
engine gives them (checked against it in test_matches_deepspeed when deepspeed is installed)."""
from __future__ import annotations

import math

import pytest
import torch

from infinity.config import InfinityConfig
from infinity.optim.schedules import build_scheduler


def _run(sched_section: dict, steps: int, lr: float = 1.0) -> list[tuple[float, tuple]]:
    """(lr, betas) of each optimizer step, the scheduler stepped after each as the engine does."""
    cfg = InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": lr}},
                                    "scheduler": sched_section})
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(cfg, opt, None)
    out = []
    for _ in range(steps):
        out.append((opt.param_groups[0]["lr"], tuple(opt.param_groups[0]["betas"])))
        opt.step()
        sched.step()
    return out


def _lrs(sched_section: dict, steps: int, lr: float = 1.0) -> list[float]:
    return [lr for lr, _ in _run(sched_section, steps, lr)]


def test_warmup_lr_linear_then_flat() -> None:
    """The first two steps both run at the start value: DeepSpeed's count starts at -1."""
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                               "warmup_num_steps": 4, "warmup_type": "linear"}}, 8)
    assert lrs == pytest.approx([0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_warmup_lr_log_climbs_to_each_groups_lr() -> None:
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_num_steps": 5}}, 8,
               lr=0.5)
    gamma = [math.log(i + 1) / math.log(5) for i in range(5)]
    assert lrs == pytest.approx([0.01] + [0.01 + 0.49 * g for g in gamma] + [0.5, 0.5])


def test_warmup_decay_ends_at_the_min_lr_as_deepspeed() -> None:
    """DeepSpeed's WarmupDecayLR: lr = min + (max - min) * gamma, gamma falling linearly to 0 at
    total_num_steps after the warm-up, so the run ends at warmup_min_lr, not at 0."""
    lrs = _lrs({"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 2,
        "total_num_steps": 6, "warmup_type": "linear"}}, 9)
    assert lrs == pytest.approx([0.01, 0.01, 0.055, 0.1, 0.0775, 0.055, 0.0325, 0.01, 0.01])


def test_warmup_cosine_as_deepspeed() -> None:
    """DeepSpeed's WarmupCosineLR: a warm-up of 1 step is made 2, and the cosine's progress at
    step i is (i - warmup + 1) / (total - warmup), capped at 1."""
    lrs = _lrs({"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 1, "total_num_steps": 11, "cos_min_ratio": 0.1,
        "warmup_type": "linear", "warmup_min_ratio": 0.2}}, 14, lr=2.0)

    def cosine(progress: float) -> float:
        return 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    assert lrs[0] == 0.0                      # DeepSpeed's WarmupCosineLR before it has started
    assert lrs[1] == pytest.approx(0.4) and lrs[2] == pytest.approx(2.0 * (0.2 + 0.8 * 0.5))
    assert lrs[3] == pytest.approx(cosine(1 / 9))
    assert lrs[7] == pytest.approx(cosine(5 / 9))
    assert lrs[11] == pytest.approx(0.2) and lrs[13] == pytest.approx(0.2)


def test_a_one_step_warmup_is_two_steps_as_deepspeed() -> None:
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                               "warmup_num_steps": 1, "warmup_type": "linear"}}, 4)
    assert lrs == pytest.approx([0.0, 0.0, 0.05, 0.1])


def test_decay_without_total_steps_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="total_num_steps"):
        _lrs({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2}}, 1)


def test_one_cycle_up_down_then_decay_with_momentum() -> None:
    """Up over cycle_first_step_size, down over the second half, then lr = min / (1 + rate * k /
    decay_step_size); beta1 runs the other way and beta2 is set to 0.99, as DeepSpeed does."""
    seq = _run({"type": "OneCycle", "params": {
        "cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_first_step_size": 4,
        "cycle_second_step_size": 2, "decay_lr_rate": 1.0, "decay_step_size": 2,
        "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.05}}, 12)
    lrs = [lr for lr, _ in seq]
    beta1 = [b[0] for _, b in seq]
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.3, 0.1,
                                 0.1 / 1.5, 0.1 / 2.0, 0.1 / 2.5, 0.1 / 3.0, 0.1 / 3.5])
    assert beta1 == pytest.approx([0.8, 0.875, 0.85, 0.825, 0.8, 0.85, 0.9,
                                   0.9 * 1.025, 0.9 * 1.05, 0.9 * 1.075, 0.9 * 1.1, 0.9 * 1.125])
    assert {b[1] for _, b in seq} == {0.99}


def test_one_cycle_stairs_and_no_momentum() -> None:
    seq = _run({"type": "OneCycle", "params": {
        "cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
        "cycle_first_stair_count": 2, "cycle_momentum": False}}, 10, lr=0.3)
    assert [lr for lr, _ in seq] == pytest.approx([0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    assert {b for _, b in seq} == {(0.9, 0.999)}    # betas left as the optimizer had them


def test_lr_range_test_continuous_and_staircase() -> None:
    params = {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2,
              "lr_range_test_step_rate": 3.0}
    ramp = _lrs({"type": "LRRangeTest", "params": params}, 5)
    assert ramp == pytest.approx([0.01, 0.01 * 2.5, 0.01 * 4.0, 0.01 * 5.5, 0.01 * 7.0])
    stairs = _lrs({"type": "LRRangeTest", "params": {**params, "lr_range_test_staircase": True}}, 5)
    assert stairs == pytest.approx([0.01, 0.01, 0.01 * 4.0, 0.01 * 4.0, 0.01 * 7.0])


def test_one_cycle_without_its_lrs_is_a_config_error() -> None:
    from infinity.config import ConfigError
    with pytest.raises(ConfigError, match="cycle_max_lr"):
        InfinityConfig.from_dict({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}})


def test_state_dict_round_trip_and_the_older_lambdalr_form() -> None:
    section = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                              "warmup_num_steps": 4, "warmup_type": "linear"}}
    cfg = InfinityConfig.from_dict({"scheduler": section})
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = build_scheduler(cfg, opt, None)
    for _ in range(3):
        sched.step()
    assert sched.state_dict() == {"last_batch_iteration": 2}
    other = build_scheduler(cfg, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1), None)
    other.load_state_dict(sched.state_dict())
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(0.05) == sched.get_last_lr()[0]
    other.load_state_dict({"last_epoch": 3, "base_lrs": [0.1]})     # a checkpoint of before
    assert other.last_batch_iteration == 2


DEEPSPEED_CASES = {
    "WarmupLR": {"warmup_min_lr": 1e-5, "warmup_num_steps": 7},
    "WarmupDecayLR": {"total_num_steps": 25, "warmup_min_lr": 1e-6, "warmup_num_steps": 1},
    "WarmupCosineLR": {"total_num_steps": 20, "warmup_min_ratio": 0.05, "warmup_num_steps": 6},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 7,
                 "cycle_second_step_size": 11, "cycle_first_stair_count": 3,
                 "cycle_second_stair_count": 4, "decay_lr_rate": 0.3, "decay_step_size": 3,
                 "decay_mom_rate": 0.01},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 3,
                    "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True},
}


@pytest.mark.parametrize("kind", sorted(DEEPSPEED_CASES))
def test_matches_deepspeed(kind: str) -> None:
    """Where deepspeed is installed: its scheduler class, driven as its engine drives it, gives
    the same (lr, betas) at each of 40 steps, for two param groups of different lr."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    params = DEEPSPEED_CASES[kind]

    def groups() -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1e-3},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 5e-4}])

    theirs_opt, ours_opt = groups(), groups()
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    cfg = InfinityConfig.from_dict({"scheduler": {"type": kind, "params": params}})
    ours = build_scheduler(cfg, ours_opt, None)
    for step in range(40):
        for a, b in zip(ours_opt.param_groups, theirs_opt.param_groups):
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-15), (kind, step)
            assert tuple(a["betas"]) == pytest.approx(tuple(b["betas"]), rel=1e-12), (kind, step)
        theirs.step()
        ours.step()


def test_a_schedule_shorter_than_its_warm_up_is_warned_and_runs(infinity_log) -> None:
    """DeepSpeed warns (a smoke run of a long config) where this used to be a ConfigError: the
    warm-up is cut short and the decay reaches warmup_min_lr at total_num_steps."""
    import logging
    with infinity_log.at_level(logging.WARNING):
        lrs = _lrs({"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10,
            "total_num_steps": 4, "warmup_type": "linear"}}, 7)
    assert "total_num_steps = 4 is smaller than scheduler.params.warmup_num_steps = 10" in \
        infinity_log.text
    assert lrs == pytest.approx([0.0, 0.0, 0.01, 0.02, 0.03, 0.04, 0.05])


def test_a_schedule_built_past_its_start_leaves_the_first_step_alone() -> None:
    """As DeepSpeed's: built with last_batch_iteration other than -1, the first step runs at
    the optimizer's own lr, and the schedule takes over at its first step()."""
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                               "warmup_num_steps": 4, "warmup_type": "linear",
                                               "last_batch_iteration": 1}}, 4, lr=0.5)
    assert lrs == pytest.approx([0.5, 0.05, 0.075, 0.1])


def test_warm_up_bounds_may_be_given_per_param_group() -> None:
    """DeepSpeed's schedules take warmup_min_lr / warmup_max_lr as one number or a list of
    one per group (the list was refused); a list of the wrong length says what is wrong."""
    section = {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.01],
                                              "warmup_max_lr": [0.1, 0.2],
                                              "warmup_num_steps": 4, "warmup_type": "linear"}}
    cfg = InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
                                    "scheduler": section})
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]},
              {"params": [torch.nn.Parameter(torch.zeros(1))]}]
    opt = torch.optim.AdamW(groups, lr=1.0)
    sched = build_scheduler(cfg, opt, None)
    seen = []
    for _ in range(6):
        seen.append([g["lr"] for g in opt.param_groups])
        sched.step()
    expected = [[0.0, 0.01], [0.0, 0.01], [0.025, 0.0575], [0.05, 0.105], [0.075, 0.1525],
                [0.1, 0.2]]
    assert [lr for step in seen for lr in step] == pytest.approx(
        [lr for step in expected for lr in step])
    three = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(3)])
    with pytest.raises(ValueError, match="warmup_min_lr has 2 values but the optimizer has 3"):
        build_scheduler(cfg, three, None)
