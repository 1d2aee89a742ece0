"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as torch LR schedulers."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch


def _warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    if warmup_steps <= 1 or step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


def schedule_lambda(sched, base_lr: float) -> Callable[[int], float]:
    """The multiplier of ``base_lr`` at each step for a config's ``scheduler`` section."""
    kind = sched.type
    warmup = sched.warmup_num_steps
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and sched.total_num_steps is None:
        raise ValueError(f"scheduler {kind} needs params.total_num_steps (it was unset or \"auto\"); "
                         "set it to the number of optimizer steps of the run")
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo = sched.warmup_min_lr
        hi = sched.warmup_max_lr if sched.warmup_max_lr is not None else base_lr

        def absolute(step: int) -> float:
            lr = lo + (hi - lo) * _warmup_gamma(step, warmup, sched.warmup_type)
            if kind == "WarmupDecayLR" and step >= warmup:
                total = sched.total_num_steps
                lr = hi * max(0.0, (total - step) / max(1, total - warmup))
            return lr / base_lr if base_lr else 0.0

        return absolute
    if kind == "WarmupCosineLR":
        total = sched.total_num_steps

        def cosine(step: int) -> float:
            if step < warmup:
                g = _warmup_gamma(step, warmup, sched.warmup_type)
                return sched.warmup_min_ratio + (1 - sched.warmup_min_ratio) * g
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return sched.cos_min_ratio + (1 - sched.cos_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

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
