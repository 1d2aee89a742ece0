"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as torch LR schedulers."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch


def _warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    """The warm-up fraction at ``step``; ``warmup_steps`` is already at least 2, as DeepSpeed
    makes it (its log warm-up divides by log(warmup_steps))."""
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


def schedule_lambda(sched, base_lr: float) -> Callable[[int], float]:
    """The multiplier of ``base_lr`` at each step (the count of optimizer steps taken, as
    DeepSpeed's ``last_batch_iteration``) for a config's ``scheduler`` section, with DeepSpeed's
    formulas: WarmupDecayLR decays linearly from max to ``warmup_min_lr`` (not to 0), and
    WarmupCosineLR's cosine starts one step into the decay."""
    kind = sched.type
    warmup = max(2, sched.warmup_num_steps)
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and sched.total_num_steps is None:
        raise ValueError(f"scheduler {kind} needs params.total_num_steps (it was unset or \"auto\"); "
                         "set it to the number of optimizer steps of the run")
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo = sched.warmup_min_lr
        hi = sched.warmup_max_lr if sched.warmup_max_lr is not None else base_lr

        def absolute(step: int) -> float:
            gamma = _warmup_gamma(step, warmup, sched.warmup_type)
            if kind == "WarmupDecayLR" and step >= warmup:
                total = sched.total_num_steps
                gamma = max(0.0, (total - step) / max(1, total - warmup))
            lr = lo + (hi - lo) * gamma
            return lr / base_lr if base_lr else 0.0

        return absolute
    if kind == "WarmupCosineLR":
        total = sched.total_num_steps

        def cosine(step: int) -> float:
            if step < warmup:
                g = _warmup_gamma(step, warmup, sched.warmup_type)
                return sched.warmup_min_ratio + (1 - sched.warmup_min_ratio) * g
            progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
            ratio = (1 + math.cos(math.pi * progress)) / 2
            return max(0.0, sched.cos_min_ratio + (1 - sched.cos_min_ratio) * ratio)

        return cosine
    raise ValueError(f"scheduler.type {kind!r} is not supported; use WarmupLR, WarmupDecayLR or "
                     "WarmupCosineLR, or pass lr_scheduler= to infinity.initialize")


def build_scheduler(config, optimizer: torch.optim.Optimizer, user: Any):
    """The scheduler: the user's (an instance or a factory taking the optimizer) or the config's."""
    if user is not None:
        return user(optimizer) if callable(user) and not hasattr(user, "step") else user
    if config.scheduler is None:
        return None
    lambdas = [schedule_lambda(config.scheduler, float(g["lr"])) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
