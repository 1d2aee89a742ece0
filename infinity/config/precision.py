"""The ``"fp16"`` and ``"bf16"`` sections: mixed precision and the dynamic loss scale."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infinity.config.values import ConfigError, check_bool, check_float, check_int, set_field

COMMUNICATION_DTYPES = ("fp32", "bf16", "fp16")
"""DeepSpeed's ``communication_data_type`` choices (unset: the gradients' own dtype)."""


def check_communication_dtype(value: Any, compute: str) -> str | None:
    """``communication_data_type`` checked against the compute dtype the config declares
    (``compute``: fp32, bf16 or fp16); None stays None (the gradients' own dtype, as
    DeepSpeed). Gradients are reduced in it on a GPU with several ranks (see [Note: gradients
    reduced on the device] in optim/device_gradients.py).

    Refused as meaningless: "fp16" unless the compute is fp16 (only fp16's loss scale keeps a
    gradient inside fp16's range: a bf16 or fp32 gradient above 65504 would reduce to inf and
    one below 6e-8 to zero, with no loss scale to notice or undo it), and "bf16" under fp16
    compute (the same two bytes as the fp16 gradient, with three fewer mantissa bits: it
    saves nothing and only rounds). "bf16" under fp32 compute halves the reduce's bytes with
    fp32's range and is allowed, as is "fp32" under any compute (a wider sum)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.lower()      # "BF16" as DeepSpeed reads it
    if value not in COMMUNICATION_DTYPES:
        raise ConfigError(
            f"communication_data_type = {value!r}: expected one of "
            f"{', '.join(map(repr, COMMUNICATION_DTYPES))}, or leave it unset (the gradients' "
            "own dtype, as DeepSpeed)")
    if value == "fp16" and compute != "fp16":
        raise ConfigError(
            f"communication_data_type = 'fp16' with {compute} compute: without fp16's loss "
            "scale the gradients leave fp16's range (above 65504 they reduce to inf, below "
            "6e-8 to zero); use \"bf16\" (fp32's range in two bytes), \"fp32\", or unset it")
    if value == "bf16" and compute == "fp16":
        raise ConfigError(
            "communication_data_type = 'bf16' with fp16 compute: the fp16 gradients would be "
            "rounded to three fewer mantissa bits in the same two bytes; unset it (fp16) or "
            "use \"fp32\"")
    return value


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
        if self.loss_scale == 0 and self.min_loss_scale > 2.0 ** self.initial_scale_power:
            # the first overflow "came down" to the floor above it and stopped the run
            raise ConfigError(
                f"fp16.min_loss_scale = {self.min_loss_scale:g} is above the starting scale "
                f"2**fp16.initial_scale_power = {2.0 ** self.initial_scale_power:g}: the "
                "dynamic scale never goes below its minimum. Raise initial_scale_power or "
                "lower min_loss_scale")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Bf16Config:
    """``"bf16"`` (alias ``"bfloat16"``): 16-bit compute without loss scaling."""

    enabled: bool | None = None
    """Compute in bf16 (true) or not (false); None where the config does not say. Under
    ``infinity.compute_dtype: "auto"`` a GPU computes in bf16 only where it is true, and a
    CPU-only machine in bf16 where the CPU multiplies it natively unless it is false: a
    DeepSpeed config's explicit false means fp32, as DeepSpeed trains it (it was bf16 here, 0.3
    relative off fp32 torch in ten steps)."""

    def __post_init__(self) -> None:
        if self.enabled is not None:
            check_bool("bf16.enabled", self.enabled)

    def to_dict(self) -> dict[str, Any]:
        return {} if self.enabled is None else {"enabled": self.enabled}


