"""DeepSpeed's LR schedules: the lr (and betas) each optimizer step runs at, as DeepSpeed 0.19.8's
engine gives them (checked against it in test_matches_deepspeed when deepspeed is installed);
explicit step positions, boundary cases of the decays (a decay of one step, one stair, a decay rate
of 1), the defaults each schedule falls back to, and how a user's scheduler or factory is taken."""
from __future__ import annotations

import math

import pytest
import torch

from infinity.config import InfinityConfig
from infinity.optim.schedules import DeepSpeedSchedule, build_scheduler, check_user_scheduler


# -- each schedule run step by step, as DeepSpeed runs it ----------------------------------------

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


def test_the_range_tests_start_may_be_given_per_param_group() -> None:
    """DeepSpeed's LRRangeTest takes lr_range_test_min_lr as a list of one per group (refused
    here as "expected a finite number")."""
    section = {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": [0.01, 0.1],
                                                 "lr_range_test_step_size": 2,
                                                 "lr_range_test_step_rate": 3.0}}
    cfg = InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
                                    "scheduler": section})
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(2)])
    sched = build_scheduler(cfg, opt, None)
    seen = []
    for _ in range(3):
        seen.append([g["lr"] for g in opt.param_groups])
        sched.step()
    assert [lr for step in seen for lr in step] == pytest.approx(
        [0.01, 0.1, 0.025, 0.25, 0.04, 0.4])


# -- helpers of the sections below: a schedule stepped to a given iteration ----------------------

def _opt(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, lr=lrs[0])


def _sched(section: dict, *lrs: float) -> tuple[DeepSpeedSchedule, torch.optim.Optimizer]:
    lrs = lrs or (1.0,)
    cfg = InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": lrs[0]}},
                                    "scheduler": section})
    opt = _opt(*lrs)
    return build_scheduler(cfg, opt, None), opt


def _config(section: dict):
    """The SchedulerConfig of a ds_config's scheduler section."""
    return InfinityConfig.from_dict({"scheduler": section}).scheduler


def _lr_at(sched: DeepSpeedSchedule, opt: torch.optim.Optimizer, it: int, group: int = 0) -> float:
    sched.step(it)
    return opt.param_groups[group]["lr"]


# -- DeepSpeedSchedule ------------------------------------------------------------------------------

def test_step_to_an_explicit_iteration_jumps_there() -> None:
    sched, opt = _sched({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                        "warmup_num_steps": 10,
                                                        "warmup_type": "linear"}})
    sched.step(5)
    assert sched.last_batch_iteration == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sched.step()  # and counts on from there
    assert sched.last_batch_iteration == 6
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6)
    assert sched.state_dict() == {"last_batch_iteration": 6}


def test_a_state_without_a_position_is_refused_naming_what_is_missing() -> None:
    sched, _ = _sched({"type": "WarmupLR", "params": {"warmup_max_lr": 1.0}})
    with pytest.raises(ValueError, match=r"\['step_count'\] has no last_batch_iteration"):
        sched.load_state_dict({"step_count": 3})


@pytest.mark.parametrize("state,ok", [
    ({"last_batch_iteration": 3}, True),
    ({"last_epoch": 4}, True),                       # the LambdaLR form of older checkpoints
    ({"last_batch_iteration": 3, "last_epoch": 4}, True),
    ({}, False),
    ({"step_count": 3}, False),
    (["last_batch_iteration"], False),               # not a state dict at all
    (None, False),
])
def test_accepts_state_takes_either_position_form_only(state, ok: bool) -> None:
    assert DeepSpeedSchedule.accepts_state(state) is ok


# -- _schedule: required settings and unknown types ---------------------------------------------------

@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_decaying_schedules_need_total_num_steps(kind: str) -> None:
    cfg = _config({"type": kind, "params": {"warmup_num_steps": 4}})
    with pytest.raises(ValueError, match=f"scheduler {kind} needs params.total_num_steps"):
        DeepSpeedSchedule(_opt(1.0), cfg)


def test_an_unknown_schedule_type_is_refused_by_name() -> None:
    cfg = _config({"type": "WarmupLR"})
    object.__setattr__(cfg, "type", "StepLR")  # past the config's own check
    with pytest.raises(ValueError, match="scheduler.type 'StepLR' is not supported"):
        DeepSpeedSchedule(_opt(1.0), cfg)


# -- WarmupLR / WarmupDecayLR ------------------------------------------------------------------------

def test_warmup_decay_without_max_lr_climbs_to_deepspeeds_default_for_every_group() -> None:
    sched, opt = _sched({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2,
                                                             "warmup_type": "linear",
                                                             "total_num_steps": 100}}, 0.5, 0.25)
    sched.step(2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.001, 0.001])


def test_warmup_max_lr_of_the_wrong_length_names_the_key() -> None:
    cfg = InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
                                    "scheduler": {"type": "WarmupLR",
                                                  "params": {"warmup_max_lr": [0.1, 0.2, 0.3]}}})
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_max_lr has 3 values .* 2 param"):
        build_scheduler(cfg, _opt(1.0, 1.0), None)


def test_warmup_decay_over_a_single_step_reaches_max_then_min() -> None:
    """total = warm-up + 1: the step after the warm-up is still at the top, the next at the floor."""
    sched, opt = _sched({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 1.0,
                                                             "warmup_num_steps": 4,
                                                             "warmup_type": "linear",
                                                             "total_num_steps": 5}})
    assert _lr_at(sched, opt, 3) == pytest.approx(0.1 + 0.9 * 3 / 4)
    assert _lr_at(sched, opt, 4) == pytest.approx(1.0)
    assert _lr_at(sched, opt, 5) == pytest.approx(0.1)
    assert _lr_at(sched, opt, 50) == pytest.approx(0.1)


# -- WarmupCosineLR ----------------------------------------------------------------------------------

def test_warmup_cosine_log_warmup_follows_the_log_curve() -> None:
    sched, opt = _sched({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 8,
                                                              "warmup_type": "log",
                                                              "warmup_min_ratio": 0.2,
                                                              "total_num_steps": 100}}, 2.0)
    for it in (1, 3, 6):
        expected = 2.0 * (0.2 + 0.8 * math.log(it + 1) / math.log(8))
        assert _lr_at(sched, opt, it) == pytest.approx(expected)


def test_warmup_cosine_over_a_single_step_ends_at_the_floor() -> None:
    sched, opt = _sched({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 4,
                                                              "warmup_type": "linear",
                                                              "cos_min_ratio": 0.1,
                                                              "total_num_steps": 5}}, 2.0)
    assert _lr_at(sched, opt, 4) == pytest.approx(0.2)
    assert _lr_at(sched, opt, 9) == pytest.approx(0.2)


# -- OneCycle ----------------------------------------------------------------------------------------

def _one_cycle(**params) -> tuple[DeepSpeedSchedule, torch.optim.Optimizer]:
    base = {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4}
    return _sched({"type": "OneCycle", "params": {**base, **params}})


def test_one_cycle_falling_half_uses_its_own_stair_count() -> None:
    """4 rising steps in 2 stairs, 4 falling steps continuous (0 stairs)."""
    sched, opt = _one_cycle(cycle_first_stair_count=2, cycle_second_stair_count=0)
    rising = [_lr_at(sched, opt, it) for it in range(0, 4)]   # batches 1..4
    falling = [_lr_at(sched, opt, it) for it in range(4, 7)]  # batches 5..7
    assert rising == pytest.approx([0.0, 0.5, 0.5, 1.0])
    assert falling == pytest.approx([0.75, 0.5, 0.25])


def test_one_cycle_rising_stairs_apply_to_the_rising_half_only() -> None:
    sched, opt = _one_cycle(cycle_first_stair_count=0, cycle_second_stair_count=2)
    rising = [_lr_at(sched, opt, it) for it in range(0, 4)]
    falling = [_lr_at(sched, opt, it) for it in range(4, 7)]
    assert rising == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert falling == pytest.approx([0.5, 0.5, 0.0])


def test_one_cycle_with_one_stair_holds_the_bottom_until_the_top() -> None:
    sched, opt = _one_cycle(cycle_first_stair_count=1)
    assert [_lr_at(sched, opt, it) for it in range(0, 4)] == pytest.approx([0.0, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("step_size,rate", [(1, 0.5), (2, 1.0), (1, 1.0)])
def test_one_cycle_decays_after_the_cycle(step_size: int, rate: float) -> None:
    sched, opt = _one_cycle(cycle_min_lr=0.1, decay_step_size=step_size, decay_lr_rate=rate,
                            decay_mom_rate=rate, cycle_min_mom=0.3, cycle_max_mom=0.4)
    it = 8 + 3  # the cycle is iterations 0..7; the decay counts from the first one after it
    lr = _lr_at(sched, opt, it)
    intervals = (it - 8 + 1) / step_size
    assert lr == pytest.approx(0.1 / (1 + rate * intervals))
    assert opt.param_groups[0]["betas"] == pytest.approx((0.4 * (1 + rate * intervals), 0.99))


def test_one_cycle_rates_without_a_decay_step_size_do_not_decay() -> None:
    """decay_step_size 0 means no decay, whatever the rates say."""
    sched, opt = _one_cycle(cycle_min_lr=0.1, decay_lr_rate=0.5, decay_mom_rate=0.5)
    assert _lr_at(sched, opt, 20) == pytest.approx(0.1)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.9, 0.99))


# -- user schedulers ---------------------------------------------------------------------------------

def test_a_factory_is_called_with_the_engines_optimizer() -> None:
    opt = _opt(1.0)
    seen = []

    def factory(o):
        seen.append(o)
        return torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0)

    sched = build_scheduler(InfinityConfig.from_dict({}), opt, factory)
    assert seen == [opt]
    assert sched.optimizer is opt


def test_a_scheduler_instance_is_used_as_it_is(infinity_log) -> None:
    opt = _opt(1.0)
    instance = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    assert build_scheduler(InfinityConfig.from_dict({}), opt, instance) is instance
    assert "scheduler" not in infinity_log.text


def test_a_users_scheduler_beside_the_configs_is_used_and_the_configs_named(infinity_log) -> None:
    """As DeepSpeed: the scheduler passed to initialize wins; the config's is not silently
    dropped (a user who set warmup there would train without it)."""
    opt = _opt(1.0)
    instance = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    cfg = InfinityConfig.from_dict({"scheduler": {"type": "WarmupLR",
                                                  "params": {"warmup_num_steps": 10}}})
    assert build_scheduler(cfg, opt, instance) is instance
    assert "the ds_config's scheduler (WarmupLR) is not used" in infinity_log.text


def test_check_user_scheduler_refuses_an_instance_bound_to_another_optimizer() -> None:
    instance = torch.optim.lr_scheduler.LambdaLR(_opt(1.0), lambda step: 1.0)
    with pytest.raises(ValueError, match="lr_scheduler is a LambdaLR built on a AdamW"):
        check_user_scheduler(instance)


def test_check_user_scheduler_accepts_none_factories_and_unbound_objects() -> None:
    class Unbound:  # a scheduler-like object that holds no optimizer
        def step(self) -> None:
            pass

    class CallableScheduler:  # callable, but a scheduler (it steps): not a factory
        optimizer = None

        def __call__(self, *a):
            raise AssertionError("not a factory")

        def step(self) -> None:
            pass

    check_user_scheduler(None)
    check_user_scheduler(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    check_user_scheduler(Unbound())
    check_user_scheduler(CallableScheduler())
    opt = _opt(1.0)
    callable_sched = CallableScheduler()
    assert build_scheduler(InfinityConfig.from_dict({}), opt, callable_sched) is callable_sched


def test_check_user_scheduler_refuses_a_callable_scheduler_bound_to_an_optimizer() -> None:
    class Bound:
        def __init__(self, optimizer) -> None:
            self.optimizer = optimizer

        def __call__(self, *a):
            raise AssertionError("not a factory")

        def step(self) -> None:
            pass

    with pytest.raises(ValueError, match="built on a AdamW"):
        check_user_scheduler(Bound(_opt(1.0)))


def test_a_factory_is_never_refused_even_one_holding_an_optimizer_attribute() -> None:
    """Only a scheduler (it has step) bound to an optimizer is refused: a factory object that
    keeps some optimizer reference of its own is still called with the engine's optimizer."""
    class Factory:
        def __init__(self) -> None:
            self.optimizer = _opt(1.0)   # e.g. a template it was configured from

        def __call__(self, opt):
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    check_user_scheduler(Factory())
