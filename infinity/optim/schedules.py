"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest),
step for step as DeepSpeed's engine applies them, so a ds_config's schedule trains the same here.

Two DeepSpeed habits are kept on purpose, because a run moved over from DeepSpeed should see the
same learning rates at the same steps:

- The count is ``last_batch_iteration``, -1 when the run starts, and the engine calls ``step()``
  after each optimizer step. The first optimizer step runs at the schedule's value for -1 (the
  warm-up schedules' start value, WarmupCosineLR's 0, OneCycle's and LRRangeTest's minimum), the
  second at the value for 0 -- which is again the start value for the warm-ups -- and step ``k``
  at the value for ``k - 2``.
- OneCycle with ``cycle_momentum`` (its default) sets each group's Adam betas to
  ``(cycled beta1, 0.99)``: beta2 becomes 0.99 whatever the optimizer section said.
- A schedule built with ``last_batch_iteration`` other than -1 leaves the optimizer's lr (and
  betas) as they are for the first step.

WarmupLR without ``warmup_max_lr`` climbs to each param group's own lr, as DeepSpeed does
since 0.19.4 (0.19.0-0.19.3 took the first group's lr as every group's maximum, which gave a
no-decay group of another lr the wrong rate).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from infinity.base.log import get_logger
from infinity.config import SchedulerConfig

log = get_logger("optim")

Betas = tuple[float, float]


class DeepSpeedSchedule:
    """Sets each param group's ``lr`` (and, for OneCycle, ``betas``) from ``last_batch_iteration``.

    The scheduler interface DeepSpeed's schedules have: ``step()``, ``get_lr()``,
    ``get_last_lr()``, ``state_dict()`` / ``load_state_dict()`` (``{"last_batch_iteration": n}``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: SchedulerConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self._lr_at, self._betas_at = _schedule(config, [float(g["lr"]) for g in optimizer.param_groups])
        self.last_batch_iteration = config.last_batch_iteration
        # as DeepSpeed's schedules: built at a later iteration (a run resumed by hand), they
        # leave the optimizer's values for the first step and take over at the first step()
        self._last_lr = self._apply() if self.last_batch_iteration == -1 else \
            [float(g["lr"]) for g in optimizer.param_groups]

    def get_lr(self) -> list[float]:
        """The learning rate of each param group at the current ``last_batch_iteration``."""
        return [self._lr_at(self.last_batch_iteration, i) for i in range(len(self.optimizer.param_groups))]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Called after each optimizer step (the engine does; a step skipped for overflow is not)."""
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else int(last_batch_iteration))
        self._last_lr = self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    @staticmethod
    def accepts_state(state: Any) -> bool:
        """Whether ``load_state_dict`` takes ``state`` (checked before a checkpoint loads)."""
        return isinstance(state, dict) and ("last_batch_iteration" in state or "last_epoch" in state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accepts this class's state, and the ``LambdaLR`` state that infinity's checkpoints held
        before (``last_epoch`` = optimizer steps taken; the same position is ``last_epoch - 1``)."""
        if "last_batch_iteration" in state:
            self.last_batch_iteration = int(state["last_batch_iteration"])
        elif "last_epoch" in state:
            self.last_batch_iteration = int(state["last_epoch"]) - 1
        else:
            raise ValueError(f"LR scheduler state {sorted(state)} has no last_batch_iteration")
        self._last_lr = self._apply()

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for i, (group, lr) in enumerate(zip(self.optimizer.param_groups, lrs)):
            group["lr"] = lr
            betas = self._betas_at(self.last_batch_iteration, i)
            if betas is not None:
                group["betas"] = betas
        return lrs


def _schedule(cfg: SchedulerConfig, group_lrs: list[float]
              ) -> tuple[Callable[[int, int], float], Callable[[int, int], Betas | None]]:
    """``(lr(iteration, group), betas(iteration, group))`` for the config's schedule."""
    kind = cfg.type
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and cfg.total_num_steps is None:
        raise ValueError(f"scheduler {kind} needs params.total_num_steps (it was unset or \"auto\"); "
                         "set it to the number of optimizer steps of the run")
    no_betas: Callable[[int, int], Betas | None] = lambda it, group: None  # noqa: E731
    if kind in ("WarmupLR", "WarmupDecayLR"):
        return _warmup_lr(cfg, group_lrs), no_betas
    if kind == "WarmupCosineLR":
        return _warmup_cosine_lr(cfg, group_lrs), no_betas
    if kind == "LRRangeTest":
        return _range_test_lr(cfg, len(group_lrs)), no_betas
    if kind == "OneCycle":
        cycle = _OneCycle(cfg)
        return (lambda it, group: cycle.lr(it)), (lambda it, group: cycle.betas(it))
    raise ValueError(f"scheduler.type {kind!r} is not supported; use WarmupLR, WarmupDecayLR, "
                     "WarmupCosineLR, OneCycle or LRRangeTest, or pass lr_scheduler= to infinity.initialize")


def _warmup_fraction(it: int, warmup: int, kind: str) -> float:
    """How far the warm-up is at iteration ``it`` (< warmup); ``warmup`` is at least 2, as DeepSpeed
    makes it (its log warm-up divides by log(warmup))."""
    return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup


def _warmup_lr(cfg: SchedulerConfig, group_lrs: list[float]) -> Callable[[int, int], float]:
    """WarmupLR / WarmupDecayLR: min + (max - min) * gamma; the decay falls linearly to
    ``warmup_min_lr`` (not to 0) at ``total_num_steps``."""
    warmup = max(2, cfg.warmup_num_steps)
    groups = len(group_lrs)
    lows = _per_group(cfg.warmup_min_lr, groups, "warmup_min_lr")
    # without warmup_max_lr WarmupLR climbs to each group's lr (see the module docstring),
    # WarmupDecayLR to 0.001 as DeepSpeed's
    highs = _per_group(cfg.warmup_max_lr, groups, "warmup_max_lr") \
        if cfg.warmup_max_lr is not None else \
        (group_lrs if cfg.type == "WarmupLR" else [0.001] * groups)

    def lr(it: int, group: int) -> float:
        lo, hi = lows[group], highs[group]
        if it < 0:
            return lo
        if it < warmup:
            gamma = _warmup_fraction(it, warmup, cfg.warmup_type)
        elif cfg.type == "WarmupDecayLR":
            total = cfg.total_num_steps
            gamma = max(0.0, (total - it) / max(1, total - warmup))
        else:
            gamma = 1.0
        return lo + (hi - lo) * gamma

    return lr


def _per_group(value: float | tuple[float, ...], groups: int, key: str) -> list[float]:
    """A value for every param group: one number for all, or a list of one per group."""
    if not isinstance(value, tuple):
        return [float(value)] * groups
    if len(value) != groups:
        raise ValueError(f"scheduler.params.{key} has {len(value)} values but the optimizer has "
                         f"{groups} param group(s): give one number, or one per group")
    return list(value)


def _warmup_cosine_lr(cfg: SchedulerConfig, group_lrs: list[float]) -> Callable[[int, int], float]:
    """WarmupCosineLR: a ratio of each group's own lr; the cosine's progress at iteration ``it``
    is ``(it - warmup + 1) / (total - warmup)``, capped at 1."""
    warmup = max(2, cfg.warmup_num_steps)
    total = cfg.total_num_steps

    def ratio(it: int) -> float:
        if it < 0:
            return 0.0
        if it < warmup:
            f = _warmup_fraction(it, warmup, cfg.warmup_type)
            return cfg.warmup_min_ratio + (1.0 - cfg.warmup_min_ratio) * f
        progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, cfg.cos_min_ratio + (1.0 - cfg.cos_min_ratio) * cosine)

    return lambda it, group: group_lrs[group] * ratio(it)


def _range_test_lr(cfg: SchedulerConfig, groups: int) -> Callable[[int, int], float]:
    """LRRangeTest: ``min_lr * (1 + rate * (it + 1) / step_size)``, floored to whole intervals
    with ``lr_range_test_staircase``; ``min_lr`` one for all groups or one per group."""
    lows = _per_group(cfg.lr_range_test_min_lr, groups, "lr_range_test_min_lr")

    def lr(it: int, group: int) -> float:
        if it < 0:
            return lows[group]
        intervals = (it + 1) / cfg.lr_range_test_step_size
        if cfg.lr_range_test_staircase:
            intervals = math.floor(intervals)
        return lows[group] * (1 + cfg.lr_range_test_step_rate * intervals)

    return lr


class _OneCycle:
    """One triangle from cycle_min_lr up to cycle_max_lr and back (beta1 the other way), then an
    optional decay; the same value for every group, as DeepSpeed's."""

    BETA2 = 0.99  # DeepSpeed's OneCycle writes this beta2 whenever it cycles momentum

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.first = float(cfg.cycle_first_step_size)
        self.second = float(cfg.cycle_second_step_size if cfg.cycle_second_step_size is not None
                            else cfg.cycle_first_step_size)
        self.total = self.first + self.second
        self.rise = self.first / self.total
        self.first_stairs = cfg.cycle_first_stair_count
        self.second_stairs = (cfg.cycle_first_stair_count if cfg.cycle_second_stair_count is None
                              else cfg.cycle_second_stair_count)
        self.lr_decays = cfg.decay_step_size != 0 and cfg.decay_lr_rate != 0
        self.mom_decays = cfg.decay_step_size != 0 and cfg.decay_mom_rate != 0

    def _height(self, it: int) -> float:
        """Where in the triangle iteration ``it`` is: 0 at the ends, 1 at the top."""
        batch = it + 1
        x = 1.0 + batch / self.total - math.floor(1 + batch / self.total)
        rising = x <= self.rise
        height = x / self.rise if rising else (x - 1) / (self.rise - 1)
        stairs = self.first_stairs if rising else self.second_stairs
        if stairs > 0:
            # whole stairs, from the integer offset into the cycle (a float height can land a
            # hair under a stair boundary and drop a whole stair)
            offset = batch % self.total
            position = (offset * stairs / self.first if offset <= self.first
                        else (self.total - offset) * stairs / self.second)
            height = math.floor(position) / stairs
        return height

    def lr(self, it: int) -> float:
        cfg = self.cfg
        if it < 0:
            return cfg.cycle_min_lr
        if it < self.total:
            return cfg.cycle_min_lr + (cfg.cycle_max_lr - cfg.cycle_min_lr) * self._height(it)
        if not self.lr_decays:
            return cfg.cycle_min_lr
        intervals = (it - self.total + 1) / cfg.decay_step_size
        return cfg.cycle_min_lr / (1 + cfg.decay_lr_rate * intervals)

    def betas(self, it: int) -> Betas | None:
        cfg = self.cfg
        if not cfg.cycle_momentum:
            return None
        if it < 0:
            return (cfg.cycle_min_mom, self.BETA2)
        if it < self.total:
            return (cfg.cycle_max_mom - (cfg.cycle_max_mom - cfg.cycle_min_mom) * self._height(it),
                    self.BETA2)
        if not self.mom_decays:
            return (cfg.cycle_max_mom, self.BETA2)
        intervals = (it - self.total + 1) / cfg.decay_step_size
        return (cfg.cycle_max_mom * (1 + cfg.decay_mom_rate * intervals), self.BETA2)


def build_scheduler(config, optimizer: torch.optim.Optimizer, user: Any):
    """The scheduler: the user's (an instance or a factory taking the optimizer) or the config's.
    Given both, the user's is used, as current DeepSpeed does (older releases took the
    config's), and the config's is named as unused."""
    if user is not None:
        if config.scheduler is not None:
            log.warning("the ds_config's scheduler (%s) is not used: initialize was given "
                        "lr_scheduler, which is used instead (as current DeepSpeed does); "
                        "remove one of them",
                        config.scheduler.type)
        return user(optimizer) if _is_factory(user) else user
    if config.scheduler is None:
        return None
    return DeepSpeedSchedule(optimizer, config.scheduler)


def check_scheduler_builds(config, groups: list[dict], defaults: dict[str, Any],
                           user: Any) -> None:
    """Build the scheduler once on a stand-in optimizer of the run's groups (no parameter
    moved yet), so what only building it finds -- a per-group list of another length, a
    WarmupDecayLR without total_num_steps, a factory's LambdaLR with a lambda per group of
    another count -- is raised before the model's weights are in the engine's stores (at
    stage 3 they were gone, the model to be built again)."""
    if not groups or (user is None and config.scheduler is None) or \
            (user is not None and not _is_factory(user)):
        return
    settings = {k: defaults[k] for k in ("lr", "betas", "eps", "weight_decay") if k in defaults}
    stand_in = torch.optim.AdamW(
        [{**{k: v for k, v in g.items() if k != "params"},
          "params": [torch.zeros(0, requires_grad=True)]} for g in groups], **settings)
    if user is None:
        DeepSpeedSchedule(stand_in, config.scheduler)
        return
    try:
        user(stand_in)
    except TypeError as exc:
        if not isinstance(user, type):
            raise
        raise TypeError(f"lr_scheduler={user.__name__}: a class is called with the optimizer "
                        f"alone, and {user.__name__}(optimizer) failed ({exc}). Pass its other "
                        f"arguments with functools.partial({user.__name__}, ...), or a "
                        "function of the optimizer") from None


def _is_factory(user: Any) -> bool:
    """A callable that builds the scheduler from the optimizer (a class is one: it has a
    ``step`` but is not a scheduler; taken for one, its unbound ``step()`` failed at the first
    optimizer step), not a scheduler object."""
    return isinstance(user, type) or (callable(user) and not hasattr(user, "step"))


def check_user_scheduler(user: Any) -> None:
    """Refuse, before the engine builds anything, a scheduler object already bound to an
    optimizer: the engine's optimizer does not exist before ``initialize``, so stepping that
    scheduler would never change the engine's learning rate."""
    if user is None or _is_factory(user):
        return
    bound = getattr(user, "optimizer", None)
    if bound is not None:
        raise ValueError(
            f"lr_scheduler is a {type(user).__name__} built on a {type(bound).__name__} "
            "that is not the engine's optimizer (initialize creates that one), so stepping it "
            "would never change the engine's learning rate. Pass a factory, which the engine "
            "calls with its own optimizer: lr_scheduler=lambda opt: "
            "torch.optim.lr_scheduler.LambdaLR(opt, ...)")
