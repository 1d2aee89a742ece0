"""The engine's sizes: what the planner derives, for the built units on this machine.

The planner is the one place sizes are computed: ``infinity.planner.sizes.derive_sizes`` derives
"auto" and unset sizes from the budgets, ``infinity.planner.engine_sizes.engine_sizes`` adds the
engine's own numbers (slot counts, where gradients live, how much NVMe to reserve). This module
only feeds them what needs the live model and machine: the units' parameter counts, the
hardware, free disk space.
"""
from __future__ import annotations

import dataclasses

from typing import Any
from pathlib import Path

import torch

from infinity.base.budget import BudgetExceededError
from infinity.base.log import get_logger
from infinity.base.native_info import record_in_use
from infinity.base.sizes import format_bytes
from infinity.comm.collectives import Collectives
from infinity.config import InfinityConfig
from infinity.optim.gradients import gradients_held
from infinity.planner.engine_sizes import EngineSizes
from infinity.planner.inputs import ModelStats, agreed_hardware, detect_hardware
from infinity.planner.plan import budget_need, host_budget_shortfall
from infinity.planner.run_plan import (
    RunPlan,
    UnitParams,
    plan_run,
    speculation_blockers,
    stats_of_units,
)
from infinity.planner.sizes import host_allowed
from infinity.storage.device_cache import DeviceMemoryCache
from infinity.storage.tiers import Tier
from infinity.zero.partition import UnitSpec

__all__ = ["COMPUTE_DTYPES", "EngineSizes", "engine_plan", "gradient_home_dtype", "unit_params",
           "param_group_of", "grouped_params", "host_budget_note", "warn_second_nvme_path"]

log = get_logger("engine")


def unit_params(specs: list[UnitSpec], groups: list[dict]) -> list[UnitParams]:
    """Each unit's parameters as the run plan takes them, in the flat order ``Unit`` lays them
    out (trainable ones first, by param group; see ``param_group_of``), so the plan's pools are
    the units' own sizes."""
    group_of = param_group_of(groups)
    out = []
    for spec in specs:
        pairs = [(group, p.numel()) for _, p, group in grouped_params(spec.params, group_of)]
        pairs.sort(key=lambda pair: (pair[0] < 0, pair[0]))     # stable, as Unit sorts
        out.append(UnitParams(tuple((numel, group >= 0) for group, numel in pairs), ordered=True))
    return out


def param_group_of(groups: list[dict]) -> dict:
    """{parameter: the index of its optimizer param group}."""
    group_of = {}
    for index, group in enumerate(groups):
        for p in group["params"]:
            group_of[p] = index
    return group_of


def grouped_params(params: list[tuple[str, Any]], group_of: dict) -> list[tuple[str, Any, int]]:
    """(name, parameter, param group index) as ``Unit`` takes them: -1 (frozen) for one that
    needs no gradient, has no elements (nothing to step) or is in no group."""
    return [(n, p, group_of.get(p, -1) if p.requires_grad and p.numel() else -1)
            for n, p in params]


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gradient_home_dtype(sizes: EngineSizes, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the gradients' home these sizes budgeted (the engine's and the dry run's):
    the compute dtype where it never sums, else float32 (see [Note: the gradient home in the
    compute dtype] in planner/placement.py)."""
    return compute_dtype if sizes.grad_home_itemsize < 4 else torch.float32


def engine_plan(cfg: InfinityConfig, specs: list[UnitSpec], groups: list[dict],
                device: torch.device, comm: Collectives | None = None) -> RunPlan:
    """The run plan (``infinity.planner.run_plan``) for these units on this machine and
    ``device``: the one place the engine's decisions and sizes come from. With several ranks,
    for the most constrained rank's machine, the same on every rank ([Note: one machine for
    every rank's plan] in planner/inputs.py; "auto" picks bf16 on CPUs only where every
    rank's CPU has it natively). The compute dtype and why it was chosen are logged and
    recorded for ``native_info()``. A host budget clearly too small is refused here, before
    anything is allocated."""
    nvme_path = cfg.zero.swap_path
    hw = detect_hardware(nvme_path)
    if comm is not None and comm.active:
        # every rank plans the same run, for the most constrained machine ([Note: one machine
        # for every rank's plan] in planner/inputs.py): one dtype (the flat shards and
        # collectives are in it), one persistence threshold (the order of collectives)
        own = hw
        hw = agreed_hardware(comm.all_gather_objects(hw), comm.rank)
        share = own.host_available_bytes / max(1, own.ranks_per_node)
        if share > 1.1 * hw.host_available_bytes / max(1, hw.ranks_per_node) or \
                (own.gpu_free_bytes or 0) > 1.1 * (hw.gpu_free_bytes or 0):
            log.info("planned for the most constrained rank: %s of host memory available to "
                     "%d rank(s) (this rank's node: %s to %d)%s",
                     format_bytes(hw.host_available_bytes), hw.ranks_per_node,
                     format_bytes(own.host_available_bytes), own.ranks_per_node,
                     f", {format_bytes(hw.gpu_free_bytes)} free on the GPU (this rank has "
                     f"{format_bytes(own.gpu_free_bytes)})" if hw.gpu_free_bytes else "")
    # the counts of the units as the plan takes them (a parameter in no param group has no
    # optimizer state: it is not trainable here, whatever its requires_grad)
    units = unit_params(specs, groups)
    stats = stats_of_units(units)
    least = _refuse_a_host_budget_too_small(cfg, stats, hw)
    plan = plan_run(cfg, hw, stats=stats, units=units,
                    device_is_cpu=device.type == "cpu",
                    direct_reads=DeviceMemoryCache.supported(device),
                    keeps_gradients=gradients_held(device),
                    rank=comm.rank if comm is not None and comm.active else 0)
    plan = dataclasses.replace(plan, least_host_budget=least)
    record_in_use("compute_dtype", f"{plan.compute_dtype} ({plan.compute_dtype_reason})")
    log.info("compute dtype %s: %s", plan.compute_dtype, plan.compute_dtype_reason)
    # [Note: room for the optimizer] in planner/optimizer_room.py: the plan's sizes already
    # are the ones it chose; say what it gave up, or which of the user's keys it kept
    for line in plan.room.changes:
        log.info("optimizer room: %s", line)
    for line in plan.room.warnings:
        log.warning("slow optimizer step: %s", line)
    if plan.derived.device_room_warning:
        # a gradient buffer taken at the first backward may find the prefetched units holding
        # the device budget (see [Note: gradients reduced on the device])
        log.warning("device memory: %s", plan.derived.device_room_warning)
    if cfg.infinity.speculative_step == "auto" and not plan.speculative and \
            cfg.world_size == 1 and not speculation_blockers(cfg, plan.placement):
        log.info("speculative step off: %s", plan.speculative_reason)
    resident = resident_bytes()
    if resident is not None:
        # [Note: the host budget and activations] in engine/activation_policy.py
        log.info("host budget %s: the engine's pools and the activations it keeps in memory; "
                 "outside it, the %s this process already holds (the interpreter, torch and "
                 "its libraries, the model as built) and autograd's temporaries",
                 format_bytes(host_allowed(cfg, hw)), format_bytes(resident))
    return plan


ENGINE_REFUSES_BELOW = 1 / 8
"""The engine refuses a host budget under this share of the planner's least one: the planner
errs on the safe side, most for small models (a 2-layer, 256-wide Llama at stage 3 on NVMe ran
under 8 MiB and not under 6 MiB, where it plans 20 MiB), and a budget that runs must not be
refused."""


def _refuse_a_host_budget_too_small(cfg: InfinityConfig, stats: ModelStats, hw) -> int | None:
    """A host budget clearly too small for this model is refused before anything is allocated,
    naming the least budget the planner finds (the engine's own error, from the first pool
    that did not fit, named that pool's share: "optimizer slot 0 needs 8 KiB ... 0 B free",
    for a model that needs ~8 MiB); one under the planner's estimate but near it is tried."""
    shortfall = host_budget_shortfall(cfg, stats, hw, refuse_below=ENGINE_REFUSES_BELOW)
    if shortfall is None:
        return None
    refuse, least = shortfall
    given = format_bytes(cfg.infinity.host_memory_budget)
    if refuse:
        raise BudgetExceededError(
            f"the host budget {given} (infinity.host_memory_budget) is too small for this model "
            f"and config: {budget_need(least, 'set infinity.host_memory_budget to {}MiB or more')}")
    log.warning("the host budget %s is under the planner's estimate for this model and config "
                "(%s); trying anyway (where a pool does not fit, set "
                "infinity.host_memory_budget to that estimate)", given, format_bytes(least))
    return least


def resident_bytes() -> int | None:
    """This process's resident memory now (VmRSS), None where /proc does not tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_budget_note(cfg: InfinityConfig, device: torch.device, sizes: EngineSizes,
                     least: int | None = None) -> str:
    """What to tell when the host budget is exceeded: the least budget the planner found, where
    the one given is under it (the error named a pool's share, never that number), and where
    the budget went when the engine's share is less than the configured one (on a CPU-only
    machine the emulated device pool is host memory too)."""
    said = "" if least is None else "this model and config: " + budget_need(
        least, "set infinity.host_memory_budget to {}MiB or more")
    configured = cfg.infinity.host_memory_budget
    if configured is None or cfg.infinity.device_memory_budget is not None or \
            device.type != "cpu" or sizes.host_budget is None or sizes.host_budget >= configured:
        return said
    pool = (f"on this CPU-only machine the emulated device pool took "
            f"{format_bytes(configured - sizes.host_budget)} of infinity.host_memory_budget "
            f"{format_bytes(configured)}: raise host_memory_budget, or set "
            "infinity.device_memory_budget to size the pool yourself")
    return f"{said}; {pool}" if said else pool


def warn_second_nvme_path(config: InfinityConfig, used: str | None, param_tier: Tier,
                           optimizer_tier: Tier) -> None:
    """One swap directory per rank holds every NVMe state: say so when the config names two."""
    paths = set()
    if param_tier is Tier.NVME and config.zero.offload_param.device == "nvme":
        paths.add(config.zero.offload_param.nvme_path)
    if optimizer_tier is Tier.NVME:
        paths.add(config.zero.offload_optimizer.nvme_path)
    other = sorted(p for p in paths - {used, None})
    if used is not None and other:
        missing = "" if Path(other[0]).is_dir() else " (it does not exist)"
        log.warning("offload_param.nvme_path and offload_optimizer.nvme_path differ: every "
                    "NVMe state goes to one swap directory under %s; %s is not used%s. Set both "
                    "to the same path to silence this", used, other[0], missing)
