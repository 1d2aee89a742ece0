"""The ``"fp16"`` and ``"bf16"`` sections: mixed precision and the dynamic loss scale."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infinity.config.values import check_bool, check_float, check_int, set_field


@dataclass(frozen=True, kw_only=True)
class Fp16Config:
    """``"fp16"``: 16-bit compute with loss scaling."""

    enabled: bool = False
    """Compute in fp16 (needs loss scaling)."""
    loss_scale: float = 0.0
    """Static loss scale; 0 = dynamic."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic scale."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow, so only overflows in a row count."""
    auto_cast: bool = False
    """Cast floating-point tensors among the forward's inputs to the compute dtype."""

    def __post_init__(self) -> None:
        check_bool("fp16.enabled", self.enabled)
        set_field(self, "loss_scale", check_float("fp16.loss_scale", self.loss_scale, 0.0))
        set_field(self, "initial_scale_power", check_int("fp16.initial_scale_power", self.initial_scale_power, 0, 63))
        set_field(self, "loss_scale_window", check_int("fp16.loss_scale_window", self.loss_scale_window, 1))
        set_field(self, "hysteresis", check_int("fp16.hysteresis", self.hysteresis, 1))
        set_field(self, "min_loss_scale", check_float("fp16.min_loss_scale", self.min_loss_scale, 0.0, lo_open=True))
        check_bool("fp16.consecutive_hysteresis", self.consecutive_hysteresis)
        check_bool("fp16.auto_cast", self.auto_cast)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Bf16Config:
    """``"bf16"`` (alias ``"bfloat16"``): 16-bit compute without loss scaling."""

    enabled: bool = False
    """Compute in bf16 where the device has it (on CPU-only machines see InfinitySection.compute_dtype)."""

    def __post_init__(self) -> None:
        check_bool("bf16.enabled", self.enabled)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled}


