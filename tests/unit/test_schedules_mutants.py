"""LR schedules: behaviours that mutation testing (tools/mutation.py, issue 23) found unchecked --
explicit step positions, boundary cases of the decays (a decay of one step, one stair, a decay rate
of 1), the defaults each schedule falls back to, and how a user's scheduler or factory is taken."""
from __future__ import annotations

import math

import pytest
import torch

from infinity.config import InfinityConfig
from infinity.optim.schedules import DeepSpeedSchedule, build_scheduler, check_user_scheduler


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


def test_a_scheduler_instance_is_used_as_it_is() -> None:
    opt = _opt(1.0)
    instance = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    assert build_scheduler(InfinityConfig.from_dict({}), opt, instance) is instance


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
