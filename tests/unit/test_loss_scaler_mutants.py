"""Loss scaler: behaviours that mutation testing (tools/mutation.py, issue 23) found unchecked by
test_loss_scaler.py -- growth counted from the very first step (DeepSpeed's cur_iter 0,
last_overflow_iter -1), a window of one step, and the state a checkpoint keeps."""
from __future__ import annotations

import random

import pytest

from infinity.config import Fp16Config
from infinity.optim.loss_scaler import LossScaler


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
