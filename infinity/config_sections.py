"""The sections of the run configuration (optimizer, scheduler, fp16/bf16, ZeRO and its offload
sections, aio, our "infinity" section) and the value checks they share.

Each section is a frozen, keyword-only dataclass that validates and normalizes its own values in
``__post_init__``, raising ``ConfigError`` with the key path; ``infinity.config`` assembles them
from the JSON (unknown keys, aliases, "auto") and re-exports them.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from infinity.log import get_logger
from infinity.malloc_tuning import GLIBC_MAX_THRESHOLD
from infinity.sizes import parse_bytes

_AUTO = "auto"
_log = get_logger("config")


class ConfigError(ValueError):
    """A key or value of the configuration that infinity cannot use; the message names its path."""


# ----------------------------------------------------------------------------------------------
# Value checks shared by every section. Each raises ConfigError naming the key path and value.

def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path} = {value!r}: expected true or false")
    return value


INT64_MAX = 2**63 - 1
"""The largest integer a config value may be unless its key says otherwise: values go to C and
torch as int64."""
_EXACT_FLOAT_INT = 2**53
"""Floats up to this are exact integers; a larger one (1e30) names no particular integer."""


def _int(path: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int, or a ConfigError naming ``path``.

    Any integral type is taken (a numpy or torch integer from a config built in Python: they
    are ``numbers.Integral``), and a float that is a whole number up to 2**53 (JSON's ``4.0``,
    ``1e3``); never a bool (``true`` is not a count, though Python calls it 1), a fraction, or a
    float too large to name one integer. Without ``hi`` the range ends at INT64_MAX.
    """
    limit = INT64_MAX if hi is None else hi
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):    # numpy's too
        raise ConfigError(f"{path} = {value!r}: expected an integer{_range(lo, hi)}, not true or "
                          "false")
    if isinstance(value, numbers.Integral):
        value = operator.index(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and \
            float(value).is_integer():
        if abs(value) > _EXACT_FLOAT_INT:
            raise ConfigError(f"{path} = {value!r} is out of range: expected an integer"
                              f"{_range(lo, limit)} (a float this large is no exact integer)")
        value = int(value)
    else:
        raise ConfigError(f"{path} = {value!r}: expected an integer{_range(lo, hi)}")
    if (lo is not None and value < lo) or value > limit:
        raise ConfigError(f"{path} = {value!r} is out of range: expected an integer"
                          f"{_range(lo, limit)}")
    return value


def _float(path: str, value: Any, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path} = {value!r}: expected a finite number{_range(lo, hi, lo_open, hi_open)}")
    value = float(value)
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        raise ConfigError(f"{path} = {value!r} is out of range: expected a number"
                          f"{_range(lo, hi, lo_open, hi_open)}")
    return value


def _float_per_group(path: str, value: Any, lo: float) -> float | tuple[float, ...]:
    """A number, or (as DeepSpeed's schedules take) a list of one number per param group."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{path} = []: expected a number, or one number per param group")
        return tuple(_float(f"{path}[{i}]", v, lo) for i, v in enumerate(value))
    return _float(path, value, lo)


def _choice(path: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{path} = {value!r}: expected one of {', '.join(map(repr, choices))}")
    return value


def _size(path: str, value: Any, lo: int = 0) -> int | None:
    """A size in elements or bytes; ``None`` or ``"auto"`` mean "derive from the budgets"."""
    if value is None or value == _AUTO:
        return None
    try:
        parsed = parse_bytes(value, what=path)
    except ValueError as exc:
        detail = str(exc).removeprefix(f"{path}: ")
        raise ConfigError(f"{path} = {value!r}: {detail} (expected a count or size >= {lo}, "
                          "e.g. 5e8, \"100M\" or \"3GiB\")") from None
    if parsed < lo:
        raise ConfigError(f"{path} = {value!r} is out of range: expected at least {lo}")
    return parsed


def _range(lo: Any, hi: Any, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" {'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f" {'<' if hi_open else '<='} {hi}"
    return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalizing a frozen dataclass in __post_init__


# ----------------------------------------------------------------------------------------------
# Sections.

@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """``"optimizer": {"type": ..., "params": {...}}``: Adam or AdamW, stepped by infinity's CPU Adam."""

    type: Literal["Adam", "AdamW"] = "AdamW"
    """Optimizer name (case-insensitive in the JSON, as in DeepSpeed)."""
    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Weight decay (DeepSpeed's default 0, also for AdamW)."""
    adam_w_mode: bool = True
    """Decoupled weight decay (AdamW). DeepSpeed's rule: always on for AdamW, default on for Adam."""
    bias_correction: bool = True
    """Adam bias correction."""

    def __post_init__(self) -> None:
        p = "optimizer.params"
        names = {"adam": "Adam", "adamw": "AdamW"}
        if not isinstance(self.type, str) or self.type.lower() not in names:
            raise ConfigError(f"optimizer.type = {self.type!r}: infinity supports only 'Adam' and "
                              "'AdamW' (its CPU Adam); remove the optimizer section to use AdamW")
        _set(self, "type", names[self.type.lower()])
        _set(self, "lr", _float(f"{p}.lr", self.lr, 0.0))
        betas = self.betas
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"{p}.betas = {betas!r}: expected two numbers [beta1, beta2] in [0, 1)")
        _set(self, "betas", tuple(_float(f"{p}.betas", b, 0.0, 1.0, hi_open=True) for b in betas))
        _set(self, "eps", _float(f"{p}.eps", self.eps, 0.0, lo_open=True))
        _set(self, "weight_decay", _float(f"{p}.weight_decay", self.weight_decay, 0.0))
        _bool(f"{p}.adam_w_mode", self.adam_w_mode)
        _bool(f"{p}.bias_correction", self.bias_correction)
        if self.type == "AdamW" and not self.adam_w_mode:
            raise ConfigError(f"optimizer.type 'AdamW' with {p}.adam_w_mode false is contradictory: "
                              "use type 'Adam' for L2-style weight decay")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "params": {
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
            "weight_decay": self.weight_decay, "adam_w_mode": self.adam_w_mode,
            "bias_correction": self.bias_correction}}


_SCHEDULER_KEYS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                 "last_batch_iteration"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "total_num_steps", "last_batch_iteration"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "total_num_steps", "last_batch_iteration"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                 "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                 "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
                 "decay_mom_rate", "last_batch_iteration"),
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase", "last_batch_iteration"),
}


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """``"scheduler"``: DeepSpeed's LR schedules, with DeepSpeed's parameter names and defaults."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    """Schedule name."""
    warmup_min_lr: float | tuple[float, ...] = 0.0       # or one per param group
    """LR at step 0 (WarmupLR, WarmupDecayLR)."""
    warmup_max_lr: float | tuple[float, ...] | None = None
    """LR reached after warm-up; None = the optimizer's lr (WarmupLR) or 0.001 (WarmupDecayLR), as
    DeepSpeed's defaults."""
    warmup_num_steps: int = 1000
    """Warm-up length in optimizer steps."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warm-up ramp."""
    total_num_steps: int | None = None
    """Total steps (WarmupDecayLR, WarmupCosineLR); None = given later (HF writes "auto")."""
    warmup_min_ratio: float = 0.0
    """Start LR as a fraction of the optimizer's lr (WarmupCosineLR)."""
    cos_min_ratio: float = 1e-4
    """End LR as a fraction of the optimizer's lr (WarmupCosineLR)."""
    cycle_min_lr: float | None = None
    """OneCycle: LR at the start and end of the cycle (required)."""
    cycle_max_lr: float | None = None
    """OneCycle: LR at the top of the cycle (required)."""
    decay_lr_rate: float = 0.0
    """OneCycle: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size)."""
    cycle_first_step_size: int = 2000
    """OneCycle: steps of the rising half."""
    cycle_second_step_size: int | None = None
    """OneCycle: steps of the falling half; None = cycle_first_step_size."""
    cycle_first_stair_count: int = 0
    """OneCycle: stairs in the rising half (0 = continuous)."""
    cycle_second_stair_count: int | None = None
    """OneCycle: stairs in the falling half; None = cycle_first_stair_count."""
    decay_step_size: int = 0
    """OneCycle: steps per decay interval after the cycle (0 = no decay)."""
    cycle_momentum: bool = True
    """OneCycle: cycle Adam's beta1 inversely to the LR (DeepSpeed then sets beta2 to 0.99)."""
    cycle_min_mom: float = 0.8
    """OneCycle: beta1 at the top of the cycle."""
    cycle_max_mom: float = 0.9
    """OneCycle: beta1 at the start and end of the cycle."""
    decay_mom_rate: float = 0.0
    """OneCycle: after the cycle, beta1 = cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)."""
    lr_range_test_min_lr: float = 1e-3
    """LRRangeTest: the starting LR."""
    lr_range_test_step_size: int = 2000
    """LRRangeTest: steps per interval of increase."""
    lr_range_test_step_rate: float = 1.0
    """LRRangeTest: lr = min_lr * (1 + step_rate * intervals)."""
    lr_range_test_staircase: bool = False
    """LRRangeTest: whole intervals only (a staircase) instead of a continuous ramp."""
    last_batch_iteration: int = -1
    """Index of the last step taken (-1: a fresh run)."""

    def __post_init__(self) -> None:
        p = "scheduler.params"
        _choice("scheduler.type", self.type, tuple(_SCHEDULER_KEYS))
        if self.type == "OneCycle":
            self._check_one_cycle(p)
        if self.type == "LRRangeTest":
            _set(self, "lr_range_test_min_lr",
                 _float(f"{p}.lr_range_test_min_lr", self.lr_range_test_min_lr, 0.0))
            _set(self, "lr_range_test_step_size",
                 _int(f"{p}.lr_range_test_step_size", self.lr_range_test_step_size, 1))
            _set(self, "lr_range_test_step_rate",
                 _float(f"{p}.lr_range_test_step_rate", self.lr_range_test_step_rate, 0.0))
            _bool(f"{p}.lr_range_test_staircase", self.lr_range_test_staircase)
        _set(self, "warmup_min_lr", _float_per_group(f"{p}.warmup_min_lr", self.warmup_min_lr, 0.0))
        if self.warmup_max_lr is not None:
            _set(self, "warmup_max_lr", _float_per_group(f"{p}.warmup_max_lr", self.warmup_max_lr,
                                                         0.0))
        _set(self, "warmup_num_steps", _int(f"{p}.warmup_num_steps", self.warmup_num_steps, 1))
        _choice(f"{p}.warmup_type", self.warmup_type, ("log", "linear"))
        if self.total_num_steps is not None:
            _set(self, "total_num_steps", _int(f"{p}.total_num_steps", self.total_num_steps, 1))
            if self.total_num_steps < self.warmup_num_steps:
                # DeepSpeed warns and runs (a short smoke run of a long config): the schedule
                # decays to its floor once the warm-up is over
                _log.warning("%s.total_num_steps = %d is smaller than %s.warmup_num_steps = %d: "
                             "the warm-up is cut short by the end of the schedule", p,
                             self.total_num_steps, p, self.warmup_num_steps)
        _set(self, "warmup_min_ratio", _float(f"{p}.warmup_min_ratio", self.warmup_min_ratio, 0.0, 1.0))
        _set(self, "cos_min_ratio", _float(f"{p}.cos_min_ratio", self.cos_min_ratio, 0.0, 1.0))
        _set(self, "last_batch_iteration", _int(f"{p}.last_batch_iteration", self.last_batch_iteration, -1))

    def _check_one_cycle(self, p: str) -> None:
        for name in ("cycle_min_lr", "cycle_max_lr"):
            if getattr(self, name) is None:
                raise ConfigError(f"scheduler OneCycle needs {p}.{name} (DeepSpeed has no default "
                                  "for it): set it to a learning rate")
            _set(self, name, _float(f"{p}.{name}", getattr(self, name), 0.0))
        for name in ("decay_lr_rate", "decay_mom_rate"):
            _set(self, name, _float(f"{p}.{name}", getattr(self, name), 0.0))
        _set(self, "cycle_first_step_size", _int(f"{p}.cycle_first_step_size", self.cycle_first_step_size, 1))
        for name in ("cycle_second_step_size", "cycle_second_stair_count"):
            if getattr(self, name) is not None:
                _set(self, name, _int(f"{p}.{name}", getattr(self, name), 0))
        _set(self, "cycle_first_stair_count", _int(f"{p}.cycle_first_stair_count", self.cycle_first_stair_count, 0))
        _set(self, "decay_step_size", _int(f"{p}.decay_step_size", self.decay_step_size, 0))
        _bool(f"{p}.cycle_momentum", self.cycle_momentum)
        for name in ("cycle_min_mom", "cycle_max_mom"):
            _set(self, name, _float(f"{p}.{name}", getattr(self, name), 0.0, 1.0, hi_open=True))
        if self.cycle_second_stair_count and self.cycle_second_step_size == 0:
            raise ConfigError(f"{p}.cycle_second_stair_count = {self.cycle_second_stair_count} "
                              f"needs a falling half: {p}.cycle_second_step_size is 0")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type,
                "params": {k: getattr(self, k) for k in _SCHEDULER_KEYS[self.type]}}


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
        _bool("fp16.enabled", self.enabled)
        _set(self, "loss_scale", _float("fp16.loss_scale", self.loss_scale, 0.0))
        _set(self, "initial_scale_power", _int("fp16.initial_scale_power", self.initial_scale_power, 0, 63))
        _set(self, "loss_scale_window", _int("fp16.loss_scale_window", self.loss_scale_window, 1))
        _set(self, "hysteresis", _int("fp16.hysteresis", self.hysteresis, 1))
        _set(self, "min_loss_scale", _float("fp16.min_loss_scale", self.min_loss_scale, 0.0, lo_open=True))
        _bool("fp16.consecutive_hysteresis", self.consecutive_hysteresis)
        _bool("fp16.auto_cast", self.auto_cast)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Bf16Config:
    """``"bf16"`` (alias ``"bfloat16"``): 16-bit compute without loss scaling."""

    enabled: bool = False
    """Compute in bf16 where the device has it (on CPU-only machines see InfinitySection.compute_dtype)."""

    def __post_init__(self) -> None:
        _bool("bf16.enabled", self.enabled)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled}


OffloadDevice = Literal["none", "cpu", "nvme"]
_OFFLOAD_KEYS = {
    "optimizer": ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size",
                  "pipeline_read", "pipeline_write", "fast_init", "ratio"),
    "param": ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"),
}


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``: the home tier of optimizer states or parameters."""

    kind: Literal["optimizer", "param"] = "optimizer"
    """Which section this is (offload_optimizer or offload_param); decides the keys it takes."""
    device: OffloadDevice = "none"
    """Home tier: "none" (device), "cpu" (pinned host) or "nvme" (swap files at nvme_path)."""
    nvme_path: str | None = None
    """Directory for swap files; required when device is "nvme"."""
    pin_memory: bool = True
    """Page-lock the host buffers (faster device copies, counts as locked memory)."""
    buffer_count: int | None = None
    """Swap buffers in flight; None = derived by the planner (4 for the optimizer)."""
    buffer_size: int | None = None
    """Elements per swap buffer; None = derived (one sub-group / one unit's shard)."""
    max_in_cpu: int | None = None
    """offload_param only: parameter elements cached in host memory when device is "nvme"."""
    pipeline_read: bool = False
    """offload_optimizer only: overlap the swap-in of sub-group i+1 with the step of i."""
    pipeline_write: bool = False
    """offload_optimizer only: overlap the swap-out of sub-group i-1 with the step of i."""
    fast_init: bool = False
    """offload_optimizer only: skip writing initial optimizer states to NVMe one by one."""
    ratio: float = 1.0
    """offload_optimizer only: fraction of the states offloaded; only 1.0 is supported."""

    def __post_init__(self) -> None:
        _choice("offload kind", self.kind, ("optimizer", "param"))
        p = self.path
        _choice(f"{p}.device", self.device, ("none", "cpu", "nvme"))
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, Path)) or not str(self.nvme_path):
                raise ConfigError(f"{p}.nvme_path = {self.nvme_path!r}: expected a directory path")
            _set(self, "nvme_path", str(self.nvme_path))
        if self.device == "nvme" and self.nvme_path is None:
            raise ConfigError(f"{p}.device is \"nvme\" but {p}.nvme_path is not set: set it to a "
                              "directory on a fast local disk (swap files are created there)")
        _bool(f"{p}.pin_memory", self.pin_memory)
        _set(self, "buffer_count", _size(f"{p}.buffer_count", self.buffer_count, lo=1))
        _set(self, "buffer_size", _size(f"{p}.buffer_size", self.buffer_size, lo=1))
        _set(self, "max_in_cpu", _size(f"{p}.max_in_cpu", self.max_in_cpu))
        for name in ("pipeline_read", "pipeline_write", "fast_init"):
            _bool(f"{p}.{name}", getattr(self, name))
        _set(self, "ratio", _float(f"{p}.ratio", self.ratio, 0.0, 1.0))
        if self.ratio != 1.0:
            raise ConfigError(f"{p}.ratio = {self.ratio}: partial offload is not supported; "
                              "use 1.0 (offload all optimizer states) or device \"none\"")
        if self.kind == "param":
            for name, default in (("pipeline_read", False), ("pipeline_write", False),
                                  ("fast_init", False)):
                if getattr(self, name) != default:
                    raise ConfigError(f"{p}.{name} applies only to offload_optimizer")
        elif self.max_in_cpu is not None:
            raise ConfigError(f"{p}.max_in_cpu applies only to offload_param")

    @property
    def path(self) -> str:
        """The key path of this section, for messages."""
        return f"zero_optimization.offload_{self.kind}"

    def to_dict(self) -> dict[str, Any]:
        return {k: _auto_if_none(k, getattr(self, k)) for k in _OFFLOAD_KEYS[self.kind]}


_SIZE_KEYS = frozenset({"buffer_count", "buffer_size", "max_in_cpu", "sub_group_size",
                        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                        "stage3_max_live_parameters", "stage3_max_reuse_distance",
                        "reduce_bucket_size", "allgather_bucket_size"})


def _auto_if_none(key: str, value: Any) -> Any:
    return _AUTO if value is None and key in _SIZE_KEYS else value


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """``"zero_optimization"``: ZeRO stage, home tiers, and the sizes of sub-groups and buckets.

    Sizes count elements; ``None`` (written ``"auto"``) means derived from the memory budgets
    by ``infinity.planner.derive_sizes``.
    """

    stage: int = 0
    """0: replicate all; 1: shard optimizer states; 2: also gradients; 3: also parameters."""
    offload_optimizer: OffloadConfig = field(default_factory=lambda: OffloadConfig(kind="optimizer"))
    """Home tier of fp32 master weights and Adam moments."""
    offload_param: OffloadConfig = field(default_factory=lambda: OffloadConfig(kind="param"))
    """Home tier of parameter shards (stage 3 only)."""
    sub_group_size: int | None = None
    """Elements of optimizer state stepped (and swapped) at once."""
    stage3_prefetch_bucket_size: int | None = None
    """Parameter elements fetched ahead of use."""
    stage3_param_persistence_threshold: int | None = None
    """Parameters with fewer elements stay on the device (never released)."""
    stage3_max_live_parameters: int | None = None
    """Most parameter elements fetched on the device at once."""
    stage3_max_reuse_distance: int | None = None
    """A released parameter reused within this many elements is kept instead."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Gather full weights into one state dict when saving."""
    overlap_comm: bool | None = None
    """Overlap collectives with compute; None = on for stage 3 (DeepSpeed's rule)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_bucket_size: int | None = None
    """Gradient elements reduced at once."""
    allgather_bucket_size: int | None = None
    """Parameter elements all-gathered at once (stages 1-2)."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter instead of all-reduce."""
    round_robin_gradients: bool = False
    """Stage 1-2 with offload: spread gradient copies over ranks round-robin."""

    def __post_init__(self) -> None:
        p = "zero_optimization"
        _set(self, "stage", _int(f"{p}.stage", self.stage, 0, 3))
        for name, kind in (("offload_optimizer", "optimizer"), ("offload_param", "param")):
            section = getattr(self, name)
            if not isinstance(section, OffloadConfig) or section.kind != kind:
                raise ConfigError(f"{p}.{name}: expected OffloadConfig(kind={kind!r}), got {section!r}")
        if self.sub_group_size == 0 and not isinstance(self.sub_group_size, bool):
            # DeepSpeed reads 0 as a sub-group per parameter; here sub-groups follow the units
            _log.info("%s.sub_group_size = 0 (DeepSpeed: a sub-group per parameter) is taken as "
                      "\"auto\" (sub-groups follow the units)", p)
            _set(self, "sub_group_size", None)
        for name in ("sub_group_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                     "stage3_max_reuse_distance", "reduce_bucket_size", "allgather_bucket_size"):
            lo = 1 if name in ("sub_group_size", "reduce_bucket_size") else 0
            _set(self, name, _size(f"{p}.{name}", getattr(self, name), lo=lo))
        for name in ("stage3_gather_16bit_weights_on_model_save", "contiguous_gradients",
                     "reduce_scatter", "round_robin_gradients"):
            _bool(f"{p}.{name}", getattr(self, name))
        if self.overlap_comm is None:
            _set(self, "overlap_comm", self.stage == 3)
        _bool(f"{p}.overlap_comm", self.overlap_comm)
        if self.offload_param.device != "none" and self.stage < 3:
            raise ConfigError(f"{p}.offload_param.device = {self.offload_param.device!r} needs "
                              f"ZeRO stage 3 but {p}.stage = {self.stage}: set \"stage\": 3")
        if self.offload_optimizer.device != "none" and self.stage < 1:
            raise ConfigError(f"{p}.offload_optimizer.device = {self.offload_optimizer.device!r} "
                              f"needs ZeRO stage 1, 2 or 3 but {p}.stage = 0: set \"stage\" (3 for "
                              "the most memory savings)")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, OffloadConfig) else _auto_if_none(f.name, value)
        return out


@dataclass(frozen=True, kw_only=True)
class AioSection:
    """``"aio"``: the native async I/O engine that moves swap-file extents (DeepSpeed's keys)."""

    block_size: int = 1 << 20
    """Bytes per I/O request (a multiple of 4096 for O_DIRECT)."""
    queue_depth: int = 32
    """Requests in flight per thread (DeepSpeed's default is 8; 32 reads faster here, peers/RESULTS.md)."""
    thread_count: int = 1
    """I/O threads per request (DeepSpeed's intra_op_parallelism)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Submit new requests while completions are reaped."""
    use_gds: bool = False
    """GPUDirect Storage; not supported (must be false)."""
    backend: Literal["auto", "io_uring", "libaio", "threads", "mmap"] = "auto"
    """I/O backend; "auto" tries io_uring, then libaio, then threads."""

    def __post_init__(self) -> None:
        _set(self, "block_size", _size("aio.block_size", self.block_size, lo=4096))
        if self.block_size is None or self.block_size % 4096:
            raise ConfigError(f"aio.block_size = {self.block_size!r}: expected a multiple of 4096 "
                              "bytes (O_DIRECT alignment), e.g. 1MiB")
        _set(self, "queue_depth", _int("aio.queue_depth", self.queue_depth, 1, 4096))
        _set(self, "thread_count", _int("aio.thread_count", self.thread_count, 1, 256))
        _bool("aio.single_submit", self.single_submit)
        _bool("aio.overlap_events", self.overlap_events)
        _bool("aio.use_gds", self.use_gds)
        if self.use_gds:
            raise ConfigError("aio.use_gds = true: GPUDirect Storage is not supported by infinity; "
                              "set it to false (swap-ins go through pinned host buffers)")
        _choice("aio.backend", self.backend, ("auto", "io_uring", "libaio", "threads", "mmap"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class InfinitySection:
    """``"infinity"``: our own keys: memory budgets and compute choices."""

    host_memory_budget: int | None = None
    """Bytes of host memory for the HOST tier and buffers; None = 80% of MemAvailable at start."""
    device_memory_budget: int | None = None
    """Bytes for the DEVICE tier; None = the GPU's free memory (CPU-only: the planner's choice)."""
    early_step: Literal["auto", "on", "off"] = "auto"
    """Step a unit's offloaded optimizer as soon as its gradient arrives; "auto" = when correctness allows."""
    speculative_step: Literal["auto", "on", "off"] = "auto"
    """Where the early step is not exact (clipping, fp16 loss scaling, accumulation), step each
    unit during backward anyway into second copies of its NVMe states, and keep them when the
    step needs no clipping and no skip (else redo the step from the first copies). Doubles the
    NVMe space of parameters and Adam states; "auto" = on at stage 3 with both on NVMe when the
    disk has room, and for a step only while the last step kept its speculation."""
    unit_modules: tuple[str, ...] | None = None
    """Class names of modules that form units; None = detect the repeated blocks."""
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Forward/backward dtype; "auto" = fp32 on CPU-only machines, else from bf16/fp16.enabled."""
    malloc_mmap_threshold: int | None = 4 * 1024 * 1024
    """glibc: host allocations of at least this size are mapped and unmapped on their own (and
    the heap is trimmed after each step), so freed gradients and activations go back to the
    system instead of fragmenting the heap (peak RSS); None = leave malloc alone."""
    offload_activations: Literal["none", "nvme"] = "none"
    """"nvme": tensors the training forward saves for backward go to the swap space and are read
    back (ahead) in backward, so memory stops growing with depth; "none" keeps them in memory."""
    activation_min_bytes: int = 256 * 1024
    """Saved tensors smaller than this stay in memory (offload_activations "nvme")."""
    activation_window: int = 64 * 1024 * 1024
    """Bytes of swapped activations in memory at a time (offload_activations "nvme"): the newest
    ones are held at the end of the forward, then reads run this far ahead of backward."""

    @property
    def mmap_threshold_in_use(self) -> int | None:
        """The malloc threshold the engine sets: with activations offloaded, at most
        ``activation_min_bytes``, so the memory of tensors that leave for NVMe goes back to
        the system instead of staying in the heap (peak RSS grew ~11 MB a layer without)."""
        threshold = self.malloc_mmap_threshold
        if threshold is not None and self.offload_activations == "nvme":
            return min(threshold, self.activation_min_bytes)
        return threshold

    def __post_init__(self) -> None:
        p = "infinity"
        _set(self, "host_memory_budget", _size(f"{p}.host_memory_budget", self.host_memory_budget))
        _set(self, "malloc_mmap_threshold",
             _size(f"{p}.malloc_mmap_threshold", self.malloc_mmap_threshold, lo=1))
        if self.malloc_mmap_threshold is not None and \
                self.malloc_mmap_threshold > GLIBC_MAX_THRESHOLD:
            raise ConfigError(f"{p}.malloc_mmap_threshold = {self.malloc_mmap_threshold}: glibc "
                              f"accepts at most 32 MiB ({GLIBC_MAX_THRESHOLD}); use null to leave "
                              "malloc alone")
        _set(self, "device_memory_budget", _size(f"{p}.device_memory_budget", self.device_memory_budget))
        _choice(f"{p}.early_step", self.early_step, ("auto", "on", "off"))
        _choice(f"{p}.speculative_step", self.speculative_step, ("auto", "on", "off"))
        if self.unit_modules is not None:
            names = self.unit_modules
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names or \
                    not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"{p}.unit_modules = {names!r}: expected a non-empty list of "
                                  "module class names, e.g. [\"LlamaDecoderLayer\"]")
            _set(self, "unit_modules", tuple(names))
        _choice(f"{p}.compute_dtype", self.compute_dtype, ("auto", "fp32", "bf16", "fp16"))
        _choice(f"{p}.offload_activations", self.offload_activations, ("none", "nvme"))
        for name, lo in (("activation_min_bytes", 1), ("activation_window", 0)):
            value = _size(f"{p}.{name}", getattr(self, name), lo=lo)
            if value is None:
                raise ConfigError(f"{p}.{name} needs a size (e.g. \"1MiB\"), got "
                                  f"{getattr(self, name)!r}")
            _set(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.unit_modules is not None:
            out["unit_modules"] = list(self.unit_modules)
        return out
