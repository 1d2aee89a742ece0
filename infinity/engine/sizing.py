"""The engine's sizes: the planner's derived sizes plus what only the built units can tell.

The planner (``infinity.planner.plan.derive_sizes``) is the one place where "auto" and unset sizes are
derived from the budgets; this module feeds it the real unit sizes and adds the engine's own
numbers (slot counts, where gradients live, how much NVMe to reserve).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from infinity.config import InfinityConfig
from infinity.base.log import get_logger
from infinity.optim.partitioned import accumulate_chunk_numel, step_slot_count
from infinity.planner.plan import (
    PREFETCH_UNITS,
    DerivedSizes,
    ModelStats,
    derive_sizes,
    detect_hardware,
)
from infinity.base.sizes import format_bytes
from infinity.storage.manager import padded_numel
from infinity.storage.preflight import free_bytes
from infinity.storage.tiers import Tier
from infinity.zero.activation_swap import ACTIVATION_STAGING_BYTES
from infinity.zero.partition import UnitSpec
from infinity.zero.unit import PARAM_ALIGN_BYTES, flat_layout

log = get_logger("engine")


@dataclass(frozen=True)
class EngineSizes:
    """Every size the engine allocates by (bytes unless the name says numel)."""

    host_budget: int | None
    device_budget: int | None
    sub_group_numel: int
    fetch_slots: int
    max_unit_bytes: int
    persistence_threshold: int
    prefetch_bucket_numel: int
    max_live_numel: int
    max_reuse_numel: int
    grad_tier: Tier
    nvme_bytes: int


def _stats(specs: list[UnitSpec]) -> ModelStats:
    numels = [p.numel() for spec in specs for _, p in spec.params]
    units = [sum(p.numel() for _, p in spec.params) for spec in specs]
    trainable = sum(p.numel() for spec in specs for _, p in spec.params if p.requires_grad)
    return ModelStats(total_params=sum(numels), trainable_params=trainable,
                      largest_unit_params=max(units, default=0), n_units=len(units),
                      largest_param=max(numels, default=0), param_numels=tuple(numels))


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def derive(cfg: InfinityConfig, specs: list[UnitSpec]) -> DerivedSizes:
    """The planner's sizes (and compute dtype, early-step choice) for these units here."""
    nvme_path = cfg.zero.offload_param.nvme_path or cfg.zero.offload_optimizer.nvme_path
    return derive_sizes(cfg, _stats(specs), detect_hardware(nvme_path))


def _layout_bound(spec: UnitSpec, dtype: torch.dtype) -> tuple[int, int]:
    """An upper bound of the unit's flat numel and trainable numel (zero/unit.py's layout, each
    parameter rounded up to its alignment, so the order of param groups cannot matter)."""
    align = max(1, PARAM_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    items = sorted(((-(-p.numel() // align) * align, p.requires_grad) for _, p in spec.params),
                   key=lambda item: not item[1])
    _, numel, trainable = flat_layout(items, dtype)
    return numel, trainable


def speculation_possible(cfg: InfinityConfig, stage: int, param_tier: Tier,
                         optimizer_tier: Tier, early_step: bool) -> bool:
    """Whether the speculative step applies (see [Note: speculative step] in
    optim/speculation.py): the deferred schedule, with parameters and Adam states on NVMe,
    where second copies cost disk space only. Raises when it is asked for ("on") elsewhere."""
    mode = cfg.infinity.speculative_step
    if mode == "off":
        return False
    blockers = []
    if early_step:
        blockers.append("the early step is in use (it needs no speculation)")
    if stage != 3:
        blockers.append(f"zero_optimization.stage is {stage} (stage 3 only)")
    if param_tier is not Tier.NVME or optimizer_tier is not Tier.NVME:
        blockers.append(f"parameters live on {param_tier.name} and Adam states on "
                        f"{optimizer_tier.name} (both must be on NVMe)")
    if blockers and mode == "on":
        raise ValueError("infinity.speculative_step = 'on' cannot be used: " + "; ".join(blockers)
                         + ". Set it to 'auto' or 'off'")
    return not blockers


def disk_has_room(nvme_path: str | None, nvme_bytes: int, margin: float = 1.05) -> bool:
    """Whether ``nvme_path``'s filesystem has ``nvme_bytes`` (and 5% more) free."""
    if nvme_path is None:
        return False
    try:
        return free_bytes(nvme_path) >= margin * nvme_bytes
    except OSError:
        return True    # the swap-path preflight reports a missing or unreadable path clearly


def resolve_sizes(cfg: InfinityConfig, specs: list[UnitSpec], derived: DerivedSizes,
                  compute_dtype: torch.dtype, param_tier: Tier, optimizer_tier: Tier,
                  master_separate: bool, early_step: bool,
                  direct_fetch: bool = False, speculative: bool = False) -> EngineSizes:
    """Sizes for this model, config and machine (``speculative``: parameters and Adam states
    have second copies on NVMe).

    ``direct_fetch``: NVMe reads land straight in device memory (a CPU device, see
    ``Unit.start_fetch``), so there are no fetch slots; the host they would have taken goes to
    the emulated device pool, where prefetched units now wait (unless the user set its budget).
    """
    nvme_path = cfg.zero.offload_param.nvme_path or cfg.zero.offload_optimizer.nvme_path
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    layouts = [_layout_bound(s, compute_dtype) for s in specs]
    unit_numels = [numel for numel, _ in layouts]
    trainable = [numel for _, numel in layouts]
    max_unit_bytes = max(unit_numels, default=0) * itemsize
    threshold = derived.persistence_threshold
    streamed_units = [n for n in unit_numels if n > threshold] if cfg.zero.stage == 3 else []
    host_budget = derived.host_budget_bytes
    # on a CPU-only machine the planner pays the emulated device pool out of the host budget
    device_budget = derived.device_budget_bytes

    # Host bytes the engine will hold before gradients get a home.
    total_trainable = sum(trainable)
    total_params = sum(unit_numels)
    host = 0
    if param_tier is Tier.HOST:
        host += sum(streamed_units) * itemsize
    if optimizer_tier is Tier.HOST:
        host += total_trainable * 4 * (3 if master_separate else 2)
    fetch_slots = derived.param_buffer_count
    if param_tier is Tier.NVME and direct_fetch:
        moved = fetch_slots * max_unit_bytes
        if cfg.infinity.device_memory_budget is None and host_budget is not None and \
                device_budget is not None:
            moved = min(moved, max(0, host_budget - max_unit_bytes))
            host_budget -= moved
            device_budget += moved
        fetch_slots = 0
    elif param_tier is Tier.NVME:
        host += fetch_slots * max_unit_bytes
    max_reuse = derived.max_reuse_distance
    if direct_fetch and cfg.zero.stage3_max_reuse_distance is None and device_budget is not None:
        # the emulated pool is host memory set aside for units (activations live outside it), and
        # a kept unit never blocks a fetch: keep whatever the pool holds (fewer NVMe reads)
        max_reuse = max(max_reuse, device_budget // itemsize)
    prefetch = derived.prefetch_bucket_size
    max_live = derived.max_live_parameters
    if direct_fetch and device_budget is not None and cfg.zero.stage == 3:
        # the planner sized an automatic prefetch bucket before the fetch slots' memory moved
        # into the emulated pool; with that room, prefetch its PREFETCH_UNITS largest units
        # (the prefetch counts what is already in flight: see choose_prefetch)
        largest = max(unit_numels, default=0)
        if cfg.zero.stage3_prefetch_bucket_size is None:
            prefetch = max(prefetch, min(PREFETCH_UNITS * largest,
                                         (device_budget - 2 * max_unit_bytes) // itemsize))
        if cfg.zero.stage3_max_live_parameters is None:
            max_live = max(max_live, largest + prefetch)
    max_trainable = max(trainable, default=0)
    sub_group = max(1, derived.sub_group_size)
    streamed = optimizer_tier is Tier.NVME or param_tier is Tier.NVME
    grad_tier = Tier.HOST
    if not early_step and host_budget is not None and nvme_path:
        # gradients stay on the host when they fit beside the smallest optimizer slots
        least_slots = step_slot_count(optimizer_tier, param_tier, Tier.HOST, master_separate,
                                      early_step, compute_dtype) * 2048 * 4 if streamed else 0
        if host + total_trainable * 4 + least_slots > host_budget:
            grad_tier = Tier.NVME
    if not early_step and grad_tier is Tier.HOST:
        host += total_trainable * 4              # the gradients' home
    if early_step or grad_tier is Tier.NVME or speculative:
        # flat gradient buffers (GRADS_HELD), or held gradients: the room (HELD_ROOM_UNITS) and
        # the part waiting for it
        host += 2 * max_trainable * 4
    if grad_tier is Tier.NVME and (cfg.gradient_accumulation_steps or 1) > 1:
        host += accumulate_chunk_numel(max_trainable) * 4   # adds the gradient kept at home, chunk by chunk
    if cfg.infinity.offload_activations == "nvme":
        host += ACTIVATION_STAGING_BYTES
    if streamed:
        # The optimizer slots get what the other pools leave of the host budget (the planner
        # sized the sub-group for its own count of slots, which the deferred schedule exceeds).
        slots = step_slot_count(optimizer_tier, param_tier, grad_tier, master_separate,
                                early_step, compute_dtype)
        if host_budget is not None:
            room = int(0.95 * (host_budget - host)) // (slots * 4)
            sub_group = max(2048, min(sub_group, room // 2048 * 2048))
        host += slots * padded_numel(min(sub_group, max(max_trainable, 1)), torch.float32) * 4
    nvme = 0
    copies = 2 if speculative else 1
    if param_tier is Tier.NVME:
        nvme += sum(streamed_units) * itemsize * copies
    if optimizer_tier is Tier.NVME:
        nvme += total_trainable * 4 * (3 if master_separate else 2) * copies
    if grad_tier is Tier.NVME:
        nvme += total_trainable * 4
    del total_params
    return EngineSizes(
        host_budget=host_budget, device_budget=device_budget, sub_group_numel=sub_group,
        fetch_slots=fetch_slots if direct_fetch else max(2, fetch_slots),
        max_unit_bytes=max_unit_bytes,
        persistence_threshold=threshold,
        prefetch_bucket_numel=max(prefetch, max(unit_numels, default=0)),
        max_live_numel=max(max_live, 2 * max(unit_numels, default=0)),
        max_reuse_numel=max_reuse,
        grad_tier=grad_tier, nvme_bytes=nvme)


def host_budget_note(cfg: InfinityConfig, device: torch.device, sizes: EngineSizes) -> str:
    """Where the host budget went when the engine's share is less than the configured one
    (told when it is exceeded): on a CPU-only machine the emulated device pool is host memory
    too."""
    configured = cfg.infinity.host_memory_budget
    if configured is None or cfg.infinity.device_memory_budget is not None or \
            device.type != "cpu" or sizes.host_budget is None or sizes.host_budget >= configured:
        return ""
    return (f"on this CPU-only machine the emulated device pool took "
            f"{format_bytes(configured - sizes.host_budget)} of infinity.host_memory_budget "
            f"{format_bytes(configured)}: raise host_memory_budget, or set "
            "infinity.device_memory_budget to size the pool yourself")


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
