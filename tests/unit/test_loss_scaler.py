"""The fp16 loss scale follows DeepSpeed's dynamic rules."""
from __future__ import annotations

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
