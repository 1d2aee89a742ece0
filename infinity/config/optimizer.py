"""The ``"optimizer"`` and ``"scheduler"`` sections (DeepSpeed's keys and defaults)."""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Literal

from infinity.config.values import (
    ConfigError,
    check_bool,
    check_choice,
    check_float,
    check_float_per_group,
    check_int,
    log,
    set_field,
)


MISSING_OPTIMIZER = (
    "the config has no \"optimizer\" section and no optimizer was passed, so there is nothing "
    "to say how to train: add one to the config, e.g. \"optimizer\": {{\"type\": \"AdamW\", "
    "\"params\": {{\"lr\": 1e-4, \"weight_decay\": 0.01}}}}, or pass {call} a "
    "torch.optim.AdamW(model.parameters(), lr=...) whose settings the engine takes over (an "
    "engine for forwards alone -- a frozen teacher, an evaluation -- needs none: freeze every "
    "parameter first, model.requires_grad_(False))")
"""The error of a run without an optimizer (``{call}`` names where to pass one)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """``"optimizer": {"type": ..., "params": {...}}``: Adam or AdamW, stepped by infinity's CPU Adam.
    Without the section, ``initialize`` needs ``optimizer=`` a torch Adam or AdamW to take over."""

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
            close = difflib.get_close_matches(str(self.type).lower(), list(names), n=1,
                                              cutoff=0.75)
            raise ConfigError(f"optimizer.type = {self.type!r}: infinity supports only 'Adam' and "
                              "'AdamW' (its CPU Adam)"
                              + (f": did you mean {names[close[0]]!r}?" if close else ""))
        set_field(self, "type", names[self.type.lower()])
        set_field(self, "lr", check_float(f"{p}.lr", self.lr, 0.0))
        betas = self.betas
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"{p}.betas = {betas!r}: expected two numbers [beta1, beta2] in [0, 1)")
        set_field(self, "betas", tuple(check_float(f"{p}.betas", b, 0.0, 1.0, hi_open=True) for b in betas))
        set_field(self, "eps", check_float(f"{p}.eps", self.eps, 0.0, lo_open=True))
        set_field(self, "weight_decay", check_float(f"{p}.weight_decay", self.weight_decay, 0.0))
        check_bool(f"{p}.adam_w_mode", self.adam_w_mode)
        check_bool(f"{p}.bias_correction", self.bias_correction)
        if self.type == "AdamW" and not self.adam_w_mode:
            raise ConfigError(f"optimizer.type 'AdamW' with {p}.adam_w_mode false is contradictory "
                              "(DeepSpeed runs type 'AdamW' with decoupled weight decay whatever "
                              "adam_w_mode says): remove adam_w_mode to run what DeepSpeed ran, "
                              "or use type 'Adam' with adam_w_mode false for L2-style decay")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "params": {
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
            "weight_decay": self.weight_decay, "adam_w_mode": self.adam_w_mode,
            "bias_correction": self.bias_correction}}


SCHEDULER_KEYS: dict[str, tuple[str, ...]] = {
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
    lr_range_test_min_lr: float | tuple[float, ...] = 1e-3
    """LRRangeTest: the starting LR (or one per param group, as DeepSpeed takes it)."""
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
        check_choice("scheduler.type", self.type, tuple(SCHEDULER_KEYS))
        if self.type == "OneCycle":
            self._check_one_cycle(p)
        if self.type == "LRRangeTest":
            set_field(self, "lr_range_test_min_lr", check_float_per_group(
                f"{p}.lr_range_test_min_lr", self.lr_range_test_min_lr, 0.0))
            set_field(self, "lr_range_test_step_size",
                 check_int(f"{p}.lr_range_test_step_size", self.lr_range_test_step_size, 1))
            set_field(self, "lr_range_test_step_rate",
                 check_float(f"{p}.lr_range_test_step_rate", self.lr_range_test_step_rate, 0.0))
            check_bool(f"{p}.lr_range_test_staircase", self.lr_range_test_staircase)
        set_field(self, "warmup_min_lr", check_float_per_group(f"{p}.warmup_min_lr", self.warmup_min_lr, 0.0))
        if self.warmup_max_lr is not None:
            set_field(self, "warmup_max_lr", check_float_per_group(f"{p}.warmup_max_lr", self.warmup_max_lr,
                                                         0.0))
        set_field(self, "warmup_num_steps", check_int(f"{p}.warmup_num_steps", self.warmup_num_steps, 1))
        check_choice(f"{p}.warmup_type", self.warmup_type, ("log", "linear"))
        if self.total_num_steps is not None:
            set_field(self, "total_num_steps", check_int(f"{p}.total_num_steps", self.total_num_steps, 1))
            if self.total_num_steps < self.warmup_num_steps:
                # DeepSpeed warns and runs (a short smoke run of a long config): the schedule
                # decays to its floor once the warm-up is over
                log.warning("%s.total_num_steps = %d is smaller than %s.warmup_num_steps = %d: "
                             "the warm-up is cut short by the end of the schedule", p,
                             self.total_num_steps, p, self.warmup_num_steps)
        set_field(self, "warmup_min_ratio", check_float(f"{p}.warmup_min_ratio", self.warmup_min_ratio, 0.0, 1.0))
        set_field(self, "cos_min_ratio", check_float(f"{p}.cos_min_ratio", self.cos_min_ratio, 0.0, 1.0))
        set_field(self, "last_batch_iteration", check_int(f"{p}.last_batch_iteration", self.last_batch_iteration, -1))

    def _check_one_cycle(self, p: str) -> None:
        for name in ("cycle_min_lr", "cycle_max_lr"):
            if getattr(self, name) is None:
                raise ConfigError(f"scheduler OneCycle needs {p}.{name} (DeepSpeed has no default "
                                  "for it): set it to a learning rate")
            set_field(self, name, check_float(f"{p}.{name}", getattr(self, name), 0.0))
        for name in ("decay_lr_rate", "decay_mom_rate"):
            set_field(self, name, check_float(f"{p}.{name}", getattr(self, name), 0.0))
        set_field(self, "cycle_first_step_size", check_int(f"{p}.cycle_first_step_size", self.cycle_first_step_size, 1))
        for name in ("cycle_second_step_size", "cycle_second_stair_count"):
            if getattr(self, name) is not None:
                set_field(self, name, check_int(f"{p}.{name}", getattr(self, name), 0))
        set_field(self, "cycle_first_stair_count", check_int(f"{p}.cycle_first_stair_count", self.cycle_first_stair_count, 0))
        set_field(self, "decay_step_size", check_int(f"{p}.decay_step_size", self.decay_step_size, 0))
        check_bool(f"{p}.cycle_momentum", self.cycle_momentum)
        for name in ("cycle_min_mom", "cycle_max_mom"):
            set_field(self, name, check_float(f"{p}.{name}", getattr(self, name), 0.0, 1.0, hi_open=True))
        if self.cycle_momentum and self.decay_mom_rate > 0 and self.decay_step_size > 0:
            # DeepSpeed's formula has no bound: beta1 passes 1, and the step that would take
            # it is refused (the engine's check) -- said now, with the step it comes at
            cycle = self.cycle_first_step_size + (self.cycle_second_step_size
                                                  if self.cycle_second_step_size is not None
                                                  else self.cycle_first_step_size)
            past = cycle + math.ceil((1.0 / self.cycle_max_mom - 1.0) / self.decay_mom_rate
                                     * self.decay_step_size)
            log.warning("%s.decay_mom_rate = %g: after the cycle beta1 = cycle_max_mom * (1 + "
                        "decay_mom_rate * intervals) reaches 1 at about step %d, where the run "
                        "stops (Adam needs beta1 < 1); lower decay_mom_rate or set it to 0 "
                        "for a longer run", p, self.decay_mom_rate, past)
        if self.cycle_second_stair_count and self.cycle_second_step_size == 0:
            raise ConfigError(f"{p}.cycle_second_stair_count = {self.cycle_second_stair_count} "
                              f"needs a falling half: {p}.cycle_second_step_size is 0")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type,
                "params": {k: getattr(self, k) for k in SCHEDULER_KEYS[self.type]}}


