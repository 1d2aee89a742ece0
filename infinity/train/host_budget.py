"""The host memory budget of an ``infinity train`` run, checked before the engine starts.

Why: a budget too small for the run used to fail inside the engine's start, after the swap files
were preallocated (21 GiB and half a minute for the 1B preset), with a message that named the
share left to one pool ("gradient slot 0 needs 164 KiB ... only 0 B of the 0 B host budget is
free", for ``--host-budget 1B``), not the budget the user gave. The planner, which sizes the
engine's pools from the same budget, says up front what the least budget is; the message names
the value as the user wrote it, where it came from, and that minimum.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from infinity.base.budget import BudgetExceededError
from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.activations import activation_shape_from_hf_config, reserve_to_keep
from infinity.planner.inputs import Hardware, ModelStats, detect_hardware
from infinity.planner.plan import budget_need, host_budget_shortfall

_log = get_logger("train")


def describe_budget(given: Any, flag: str | None, config_file: str | None) -> str:
    """The budget as the user wrote it and where: ``1B (--host-budget)``,
    ``1 (= 1 B, infinity.host_memory_budget in ds.json)``, ``512MiB (the demo's default)``."""
    if flag is not None:
        return f"{flag} (--host-budget)"
    where = (f"infinity.host_memory_budget in {config_file}" if config_file is not None
             else "the demo's default")
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        return f"{given} (= {format_bytes(given)}, {where})"
    return f"{given} ({where})"


def check_host_budget(config: InfinityConfig, stats: ModelStats, described: str) -> None:
    """Raise ValueError when the host budget is clearly too small for this run (under half the
    planner's least budget); warn when it is under that least budget but could still work."""
    shortfall = host_budget_shortfall(config, stats, _machine(config))
    if shortfall is None:
        return
    refuse, least = shortfall
    if not refuse:
        _log.warning("the host memory budget %s is under the planner's estimate for this "
                     "model and config (%s); trying anyway, the engine will say if it does "
                     "not fit", described, format_bytes(least))
        return
    raise ValueError(f"the host memory budget {described} is too small for this model and "
                     f"config: {budget_need(least, 'pass --host-budget {}MiB or more')}")


def state_bytes(config: InfinityConfig, stats: ModelStats) -> tuple[int, int]:
    """(bytes of the model states on every tier, swap space the engine will take) for this
    model and config, from the run plan: states in their formats (the Adam state formats and a
    bf16 master change them), second copies where the speculative step takes them."""
    from infinity.planner.placement import resident_bytes
    from infinity.planner.run_plan import plan_run

    plan = plan_run(config, _machine(config), stats=stats)
    return sum(resident_bytes(plan.placement).values()), plan.sizes.nvme_bytes


def explain(exc: BudgetExceededError, described: str) -> BudgetExceededError:
    """The engine's own "host budget" error (a share of the budget, after its pools), with the
    budget the user gave: for the rare run the planner thought would fit."""
    return BudgetExceededError(f"{exc} (that share is what is left of {described} after the "
                               "engine's other pools: raise the budget)")


def keep_activations(config: InfinityConfig, ds: dict[str, Any], stats: ModelStats,
                     model_config: Any, seq_len: int) -> InfinityConfig:
    """``config`` with ``infinity.activation_reserve`` set (in ``ds`` too, which the engine
    reads) to what this run's step keeps in memory, where keeping its activations within the
    host budget beats offloading them ([Note: keeping activations within the host budget] in
    planner/activations.py); unchanged where the config sets the reserve or
    ``offload_activations`` itself, has no host budget, the model's activations cannot be
    predicted, the activations live in a GPU's memory, or the reserve does not fit."""
    from infinity.planner.run_plan import plan_run

    section = config.infinity
    shape = activation_shape_from_hf_config(model_config)
    if section.activation_reserve is not None or section.offload_activations != "auto" or \
            section.host_memory_budget is None or shape is None:
        return config
    hw = _machine(config)
    if hw.has_gpu:
        return config
    plain = plan_run(config, hw, stats=stats)
    reserve = reserve_to_keep(shape, config.train_micro_batch_size_per_gpu, seq_len,
                              plain.placement.c, stats.largest_unit_params,
                              section.activation_window, plain.sizes.activation_staging)
    if reserve is None:
        return config
    kept = dataclasses.replace(config, infinity=dataclasses.replace(
        section, activation_reserve=reserve))
    try:
        plan_run(kept, hw, stats=stats)
    except ValueError as exc:
        _log.info("the step's activations are not kept within the host budget: %s", exc)
        return config
    ds.setdefault("infinity", {})["activation_reserve"] = reserve
    _log.info("infinity.activation_reserve %s: this batch's activations (%d x %d) and the "
              "step's working bytes, kept in memory within the host budget",
              format_bytes(reserve), config.train_micro_batch_size_per_gpu, seq_len)
    return kept


def _machine(config: InfinityConfig) -> Hardware:
    """This machine as the planner sees it, its disk the config's swap path's."""
    return detect_hardware(config.zero.swap_path)
