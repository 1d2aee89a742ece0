"""The ds_config of an ``infinity train`` run: the demo default or ``--config``, plus the flags.

Why a module: the command-line flags (``--micro-batch``, ``--lr``, ``--nvme-path``,
``--host-budget``, ``--steps``) must land in the same DeepSpeed-format dict a user would write, so
that the engine, the torch baseline and the ``--metrics`` file all see one configuration, and a
bad value is reported as the config key it became. The result is checked by
``infinity.config.InfinityConfig`` (a ConfigError is a ValueError: one line, exit code 2).

The demo default is ZeRO stage 3 with parameters and optimizer states on NVMe and a small host
budget, so the run is really out of core.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infinity.config import AutoValueMissing, ConfigError, InfinityConfig
from infinity.config import file as config_file
from infinity.config.values import is_whole
from infinity.base.log import get_logger
from infinity.base.sizes import parse_bytes
from infinity.train.defaults import (DEFAULT_HOST_BUDGET, DEFAULT_LR, DEFAULT_MICRO_BATCH,
                                     DEFAULT_NVME_PATH, DEFAULT_WARMUP_STEPS)

_log = get_logger("train.config")



@dataclass(frozen=True, kw_only=True)
class Overrides:
    """Command-line values that replace keys of the ds_config (``None``: not given)."""

    micro_batch: int | None = None
    """train_micro_batch_size_per_gpu."""
    lr: float | None = None
    """optimizer.params.lr (and the scheduler's warmup_max_lr when it has one)."""
    nvme_path: str | None = None
    """offload_param/offload_optimizer nvme_path of the sections whose device is nvme."""
    host_budget: str | None = None
    """infinity.host_memory_budget."""
    optimizer_moments: str | None = None
    """infinity.optimizer_moments."""
    optimizer_master: str | None = None
    """infinity.optimizer_master."""
    steps: int = 1
    """The run's optimizer steps: fills a scheduler's missing or "auto" total_num_steps."""


def demo_config() -> dict[str, Any]:
    """The ds_config of ``infinity train`` with no --config: stage 3, params and optimizer on NVMe."""
    return {
        "train_micro_batch_size_per_gpu": DEFAULT_MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        # Clipping is what gets this run off the unigram plateau (~3.05 nats) within 60 steps:
        # unclipped, the huge gradients of the first steps dominate Adam's second moment for
        # dozens of steps (measured: still on the plateau at step 49 without it, off it by step
        # ~30 with it). It costs the engine its early step (the global norm comes first).
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": DEFAULT_LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.0}},
        # Linear warm-up, then cosine decay to a tenth over the run (--steps fills the length).
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_min_ratio": 0.0, "warmup_num_steps": DEFAULT_WARMUP_STEPS,
                                 "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": None},
            "offload_optimizer": {"device": "nvme", "nvme_path": None},
        },
        "infinity": {"host_memory_budget": DEFAULT_HOST_BUDGET},
    }


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``--config`` ``path``: the one config reader (``infinity.config.file``,
    the API's too) with ``--config`` in its messages."""
    return config_file.read_config_file(path, "--config")


def build_ds_config(base: dict[str, Any], overrides: Overrides, *,
                    world_size: int = 1) -> tuple[dict[str, Any], InfinityConfig]:
    """Apply ``overrides`` to a copy of ``base``; return the dict and its checked InfinityConfig,
    read for ``world_size`` ranks (``train_batch_size`` = micro x accumulation x world size)."""
    ds = copy.deepcopy(base)
    o = overrides
    if o.micro_batch is not None:
        if o.micro_batch < 1:
            raise ValueError(f"--micro-batch must be at least 1, got {o.micro_batch}")
        _keep_accumulation(ds, world_size)
        ds["train_micro_batch_size_per_gpu"] = o.micro_batch
    if ds.get("optimizer") is None:
        # the library refuses a run without one; the main job says which it uses instead
        ds["optimizer"] = copy.deepcopy(demo_config()["optimizer"])
        ds["optimizer"]["params"]["lr"] = o.lr or DEFAULT_LR
        _log.warning("the config has no \"optimizer\" section: infinity train uses its own, %s "
                     "(set --lr, or the section, to choose)", json.dumps(ds["optimizer"]))
    if o.lr is not None:
        if not o.lr > 0:
            raise ValueError(f"--lr must be positive, got {o.lr}")
        _section(ds, "optimizer").setdefault("params", {})["lr"] = o.lr
        sched = ds.get("scheduler")
        if isinstance(sched, dict) and isinstance(sched.get("params"), dict) \
                and "warmup_max_lr" in sched["params"]:
            sched["params"]["warmup_max_lr"] = o.lr
        else:
            _warn_if_schedule_sets_lr(sched, o.lr)
    if o.host_budget is not None:
        parse_bytes(o.host_budget, what="--host-budget")  # the flag's name in the message
        _section(ds, "infinity")["host_memory_budget"] = o.host_budget
    for key in ("optimizer_moments", "optimizer_master"):
        if getattr(o, key) is not None:
            _section(ds, "infinity")[key] = getattr(o, key)
    _fill_nvme_paths(ds, o.nvme_path)
    _fill_schedule_length(ds, o.steps)
    auto = _auto_values(ds, o, world_size)
    try:
        config = InfinityConfig.from_dict(ds, world_size=world_size,
                                          auto_values={k: v for k, v in auto.items()
                                                       if _is_auto(ds, k)})
    except AutoValueMissing as exc:
        # the library's advice (auto_values=) is for scripts: a CLI user edits the config
        keys = ", ".join(exc.keys)
        raise ConfigError(f"{keys} {'is' if len(exc.keys) == 1 else 'are'} \"auto\" in the "
                          "config (a Hugging Face Trainer config?): infinity train fills "
                          "\"auto\" only for the learning rate and the schedule's peak (--lr), "
                          "the batch sizes and accumulation (--micro-batch) and the schedule's "
                          f"length (--steps); write a value for {keys}") from None
    return ds, config


def _auto_values(ds: dict, o: Any, world_size: int) -> dict[str, Any]:
    """What ``infinity train`` puts where its config says "auto", as the Hugging Face
    integration fills a Trainer's: the lr from --lr (the schedule's peak too, its floor 0), the
    micro-batch from --micro-batch, one micro-batch a step unless the config says otherwise."""
    lr = _lookup(ds, ("optimizer", "params", "lr"))
    lr = lr if isinstance(lr, (int, float)) and not isinstance(lr, bool) else o.lr or DEFAULT_LR
    micro = _lookup(ds, ("train_micro_batch_size_per_gpu",))
    micro = micro if is_whole(micro) else o.micro_batch or 1
    accumulate = _lookup(ds, ("gradient_accumulation_steps",))
    accumulate = accumulate if is_whole(accumulate) else 1
    return {"optimizer.params.lr": lr, "scheduler.params.warmup_max_lr": lr,
            "scheduler.params.warmup_min_lr": 0.0,
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulate,
            "train_batch_size": micro * accumulate * world_size}


def _is_auto(ds: dict, path: str) -> bool:
    return _lookup(ds, tuple(path.split("."))) == "auto"


# schedules whose learning rate comes from their own keys, not the optimizer's lr
_OWN_LR_KEYS = {"OneCycle": "cycle_min_lr / cycle_max_lr",
                "LRRangeTest": "lr_range_test_min_lr",
                "WarmupDecayLR": "warmup_max_lr (0.001 when unset)"}


def _warn_if_schedule_sets_lr(sched: Any, lr: float) -> None:
    kind = sched.get("type") if isinstance(sched, dict) else None
    if kind in _OWN_LR_KEYS:
        _log.warning("--lr %g has no effect on the learning rate: the config's %s schedule sets "
                     "it from its %s; change those in the config", lr, kind, _OWN_LR_KEYS[kind])


def _keep_accumulation(ds: dict[str, Any], world_size: int) -> None:
    """--micro-batch replaces the micro-batch and keeps the accumulation; train_batch_size is
    re-derived (micro x accumulation x world size, DeepSpeed's rule). An accumulation the config
    left to be derived from train_batch_size / (micro-batch x world size) is written out first:
    dropping train_batch_size alone lost it (8 = 2 x 4 became one micro-batch of 2), silently."""
    total = ds.pop("train_batch_size", None)
    micro = ds.get("train_micro_batch_size_per_gpu")
    if ds.get("gradient_accumulation_steps") is None and _plain_int(total) and \
            _plain_int(micro) and micro > 0 and total % (micro * world_size) == 0:
        ds["gradient_accumulation_steps"] = total // (micro * world_size)


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def nvme_paths(ds: dict[str, Any]) -> list[str]:
    """The distinct nvme_path values of the offload sections whose device is nvme."""
    paths: list[str] = []
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        return paths
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            path = section.get("nvme_path")
            if isinstance(path, str) and path not in paths:
                paths.append(path)
    return paths


def _section(ds: dict[str, Any], key: str) -> dict[str, Any]:
    section = ds.setdefault(key, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{key}: expected a JSON object, got {section!r}")
    return section


def _lookup(ds: dict[str, Any], keys: tuple[str, ...]) -> Any:
    node: Any = ds
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _fill_nvme_paths(ds: dict[str, Any], flag: str | None) -> None:
    if flag is not None and not flag.strip():
        raise ConfigError(f"--nvme-path {flag!r}: expected a directory path (the swap files' "
                          f"parent), e.g. --nvme-path /local_nvme; leave it out for "
                          f"{DEFAULT_NVME_PATH}")
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        if flag is not None:
            _log.warning("--nvme-path %s has no effect: the config offloads nothing to nvme", flag)
        return
    used = False
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if not isinstance(section, dict) or section.get("device") != "nvme":
            continue
        if flag is not None:
            section["nvme_path"] = flag
            used = True
        elif not section.get("nvme_path"):
            section["nvme_path"] = DEFAULT_NVME_PATH
    if flag is not None and not used:
        _log.warning("--nvme-path %s has no effect: the config offloads nothing to nvme", flag)


def _fill_schedule_length(ds: dict[str, Any], steps: int) -> None:
    sched = ds.get("scheduler")
    if not isinstance(sched, dict) or sched.get("type") not in ("WarmupDecayLR", "WarmupCosineLR"):
        return
    params = sched.setdefault("params", {})
    if isinstance(params, dict) and params.get("total_num_steps") in (None, "auto"):
        warmup = params.get("warmup_num_steps", 1000)
        params["total_num_steps"] = max(steps, warmup if isinstance(warmup, int) else 1)
