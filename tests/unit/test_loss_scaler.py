"""The fp16 loss scale follows DeepSpeed's dynamic rules: growth counted from the very first step
(DeepSpeed's cur_iter 0, last_overflow_iter -1), a window of one step, and the state a checkpoint
keeps."""
from __future__ import annotations

import random

import pytest

from infinity.config import Fp16Config
from infinity.optim.loss_scaler import LossScaler


def test_dynamic_scale_halves_after_hysteresis_and_doubles_after_a_window() -> None:
    scaler = LossScaler(Fp16Config(enabled=True, initial_scale_power=4, loss_scale_window=3,
                                   hysteresis=2, min_loss_scale=4.0))
    assert scaler.scale == 16.0
    scaler.update(True)                     # the first overflow uses up the hysteresis
    assert scaler.scale == 16.0
    scaler.update(True)
    assert scaler.scale == 8.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 8.0              # 3 clean steps after the overflow: not yet
    scaler.update(False)
    assert scaler.scale == 16.0             # the window's worth of stable steps: doubled
    for _ in range(4):
        scaler.update(True)
    assert scaler.scale == 4.0              # never under min_loss_scale


def test_a_static_scale_never_changes() -> None:
    scaler = LossScaler(Fp16Config(enabled=True, loss_scale=128.0))
    for overflow in (True, False, True):
        scaler.update(overflow)
    assert scaler.scale == 128.0 and not scaler.dynamic


def test_consecutive_hysteresis_counts_only_overflows_in_a_row() -> None:
    def run(consecutive: bool) -> float:
        scaler = LossScaler(Fp16Config(enabled=True, initial_scale_power=4, hysteresis=2,
                                       loss_scale_window=100, consecutive_hysteresis=consecutive))
        for overflow in (True, False, True, False):
            scaler.update(overflow)
        return scaler.scale

    assert run(False) == 8.0     # the second overflow, steps later, still halves
    assert run(True) == 16.0     # the clean step between refilled the hysteresis


@pytest.mark.parametrize("consecutive", [False, True])
def test_matches_deepspeed_dynamic_loss_scaler(consecutive: bool, monkeypatch) -> None:
    """Where deepspeed is installed: the same scale as its DynamicLossScaler after every step of
    a random overflow pattern."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)   # it logs on rank 0 only
    theirs = loss_scaler.DynamicLossScaler(init_scale=2.0 ** 10, scale_window=4, min_scale=2.0,
                                           delayed_shift=3, consecutive_hysteresis=consecutive,
                                           raise_error_at_min_scale=False)
    ours = LossScaler(Fp16Config(enabled=True, initial_scale_power=10, loss_scale_window=4,
                                 hysteresis=3, min_loss_scale=2.0,
                                 consecutive_hysteresis=consecutive))
    gen = random.Random(5)
    for step in range(300):
        overflow = gen.random() < 0.3
        theirs.update_scale(overflow)
        ours.update(overflow)
        assert ours.scale == theirs.cur_scale, (step, overflow)


# DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py), written out
# so these run without deepspeed (scale_factor 2, delayed_shift = hysteresis):
#   overflow:  if delayed_shift == 1 or cur_hysteresis == 1:
#                  raise if cur_scale == min_scale (and raise_error_at_min_scale)   -> ours: True
#                  cur_scale = max(cur_scale / 2, min_scale)
#              else: cur_hysteresis -= 1
#              last_overflow_iter = cur_iter
#   clean:     if consecutive_hysteresis: cur_hysteresis = delayed_shift
#              stable = cur_iter - last_overflow_iter - 1
#              if stable > 0 and stable % scale_window == 0:
#                  if not consecutive_hysteresis: cur_hysteresis = delayed_shift
#                  cur_scale *= 2
#   cur_iter += 1
# Each row: (overflow, expected scale, hysteresis left and update()'s return after the update),
# worked out by hand from those rules.

REFILL_AFTER_GROWTH = [   # scale 8, window 2, hysteresis 2, min 2, consecutive_hysteresis off
    (True, 8.0, 1, False),    # iter 0: hysteresis 2 -> 1, scale kept
    (True, 4.0, 1, False),    # iter 1: hysteresis 1: halved
    (False, 4.0, 1, False),   # iter 2: stable 0; no refill without consecutive_hysteresis
    (False, 4.0, 1, False),   # iter 3: stable 1
    (False, 8.0, 2, False),   # iter 4: stable 2 = window: doubled AND hysteresis refilled
    (True, 8.0, 1, False),    # iter 5: the refilled hysteresis absorbs this overflow
    (True, 4.0, 1, False),    # iter 6: halved
    (True, 2.0, 1, False),    # iter 7: halved to min (it was 4: not stuck)
    (True, 2.0, 1, True),     # iter 8: at min, no hysteresis left: stuck (DeepSpeed raises)
]

MIN_SCALE_WITH_HYSTERESIS_LEFT = [   # scale 4, window 2, hysteresis 3, min 2, consecutive on
    (True, 4.0, 2, False),    # iter 0: 3 -> 2
    (True, 4.0, 1, False),    # iter 1: 2 -> 1
    (False, 4.0, 3, False),   # iter 2: a clean step refills (consecutive); stable 0
    (True, 4.0, 2, False),    # iter 3
    (True, 4.0, 1, False),    # iter 4
    (True, 2.0, 1, False),    # iter 5: halved to min
    (False, 2.0, 3, False),   # iter 6: refilled; stable 0
    (True, 2.0, 2, False),    # iter 7: at min but hysteresis left: only counts down, not stuck
    (True, 2.0, 1, False),    # iter 8: the same
    (True, 2.0, 1, True),     # iter 9: at min, none left: stuck
]


@pytest.mark.parametrize("config, events", [
    (dict(initial_scale_power=3, loss_scale_window=2, hysteresis=2, min_loss_scale=2.0,
          consecutive_hysteresis=False), REFILL_AFTER_GROWTH),
    (dict(initial_scale_power=2, loss_scale_window=2, hysteresis=3, min_loss_scale=2.0,
          consecutive_hysteresis=True), MIN_SCALE_WITH_HYSTERESIS_LEFT),
], ids=["refill-after-growth", "min-scale-with-hysteresis-left"])
def test_scale_hysteresis_and_stuck_follow_deepspeeds_rules_step_by_step(config, events) -> None:
    scaler = LossScaler(Fp16Config(enabled=True, **config))
    seen = []
    for overflow, *_ in events:
        stuck = scaler.update(overflow)
        seen.append((overflow, scaler.scale, scaler.state_dict()["hysteresis_left"], stuck))
    assert seen == events


def test_a_static_scale_is_never_stuck() -> None:
    scaler = LossScaler(Fp16Config(enabled=True, loss_scale=1.0, min_loss_scale=1.0))
    assert [scaler.update(True) for _ in range(3)] == [False, False, False]
    assert scaler.scale == 1.0


# -- the first steps, a window of one, the checkpointed state ------------------------------------

def _scaler(**kw) -> LossScaler:
    return LossScaler(Fp16Config(enabled=True, **kw))


def test_a_fresh_scale_grows_after_a_window_of_clean_steps_from_the_start() -> None:
    """DeepSpeed: stable = cur_iter - last_overflow_iter - 1 with last_overflow_iter -1 at the
    start, so with window 3 the scale doubles at the update of iteration 3 (the 4th), then 6."""
    scaler = _scaler(initial_scale_power=4, loss_scale_window=3)
    scales = []
    for _ in range(7):
        scaler.update(False)
        scales.append(scaler.scale)
    assert scales == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0]


def test_a_window_of_one_doubles_from_the_second_clean_step_after_an_overflow() -> None:
    scaler = _scaler(initial_scale_power=4, loss_scale_window=1, hysteresis=1)
    scaler.update(True)
    assert scaler.scale == 8.0
    scaler.update(False)            # stable 0
    assert scaler.scale == 8.0
    scaler.update(False)            # stable 1
    assert scaler.scale == 16.0
    scaler.update(False)
    assert scaler.scale == 32.0


def test_the_state_a_checkpoint_keeps() -> None:
    scaler = _scaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    for overflow in (False, True, False):
        scaler.update(overflow)
    assert scaler.state_dict() == {"scale": 16.0, "hysteresis_left": 1, "steps": 3,
                                   "last_overflow": 1}


@pytest.mark.parametrize("consecutive", [False, True])
def test_a_loaded_state_goes_on_exactly_as_the_scaler_it_came_from(consecutive: bool) -> None:
    gen = random.Random(7)
    events = [gen.random() < 0.3 for _ in range(200)]
    config = dict(initial_scale_power=8, loss_scale_window=3, hysteresis=2, min_loss_scale=2.0,
                  consecutive_hysteresis=consecutive)
    first = _scaler(**config)
    for overflow in events[:57]:
        first.update(overflow)
    second = _scaler(**config)
    second.load_state_dict(dict(first.state_dict()))
    assert second.state_dict() == first.state_dict()
    for overflow in events[57:]:
        assert second.update(overflow) == first.update(overflow)
        assert second.state_dict() == first.state_dict()


def test_a_state_from_json_numbers_is_taken_as_the_right_types() -> None:
    scaler = _scaler()
    scaler.load_state_dict({"scale": 1024, "hysteresis_left": 2.0, "steps": "5",
                            "last_overflow": -1})
    state = scaler.state_dict()
    assert state == {"scale": 1024.0, "hysteresis_left": 2, "steps": 5, "last_overflow": -1}
    assert type(state["scale"]) is float
    assert all(type(state[k]) is int for k in ("hysteresis_left", "steps", "last_overflow"))


@pytest.mark.parametrize("state", [
    {"scale": 2.0, "hysteresis_left": 1, "steps": 3},                         # incomplete
    {"hysteresis_left": 1, "steps": 3, "last_overflow": 0},
    {"scale": "big", "hysteresis_left": 1, "steps": 3, "last_overflow": 0},   # malformed
    {"scale": 2.0, "hysteresis_left": None, "steps": 3, "last_overflow": 0},
    {"scale": 2.0, "hysteresis_left": 1, "steps": "x", "last_overflow": 0},
    {"scale": 2.0, "hysteresis_left": 1, "steps": 3, "last_overflow": [0]},
])
def test_an_incomplete_or_malformed_state_is_refused_naming_it(state) -> None:
    scaler = _scaler(initial_scale_power=4)
    with pytest.raises(ValueError, match="loss scaler state .* is incomplete or malformed"):
        scaler.load_state_dict(state)


def test_a_static_scale_is_kept_over_a_checkpoints_dynamic_one() -> None:
    """Resuming with fp16.loss_scale 128 took the checkpoint's dynamic 65536 and held it fixed:
    neither what the config said nor what the checkpoint held."""
    dynamic = LossScaler(Fp16Config(enabled=True))
    dynamic.update(False)
    static = LossScaler(Fp16Config(enabled=True, loss_scale=128))
    static.load_state_dict(dynamic.state_dict())
    assert static.scale == 128.0 and not static.dynamic
    again = LossScaler(Fp16Config(enabled=True, initial_scale_power=4))
    again.load_state_dict(dynamic.state_dict())     # a dynamic scale resumes the checkpoint's
    assert again.scale == dynamic.scale == 65536.0


def test_a_minimum_above_the_starting_scale_is_refused() -> None:
    """min_loss_scale 16 over a start of 4: the first overflow "came down" to 16 and the run
    stopped, saying it overflowed at the minimum."""
    from infinity.config.values import ConfigError

    with pytest.raises(ConfigError, match=r"fp16\.min_loss_scale = 16 is above the starting "
                                          r"scale 2\*\*fp16\.initial_scale_power = 4"):
        Fp16Config(enabled=True, initial_scale_power=2, min_loss_scale=16)
    Fp16Config(enabled=True, loss_scale=4, min_loss_scale=16)    # static: no minimum applies
