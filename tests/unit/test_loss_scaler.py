"""The fp16 loss scale follows DeepSpeed's dynamic rules."""
from __future__ import annotations

import random

import pytest

from infinity.config_sections import Fp16Config
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
