"""The run plan: every decision the engine takes from the config and the machine, made once.

Why one object: the engine, the dry run and ``infinity plan`` each used to assemble the same
decisions from the same helpers in their own order (the compute dtype, where states live,
whether the master is separate, the schedule, the speculative copies, the direct fetch, where
gradients live, and every host pool's count and slot size), and each copy could drift from the
others -- a plan could then promise bytes the engine did not allocate. ``plan_run`` makes those
decisions once, into a frozen ``RunPlan``; the engine builds its parts from it, the dry run
simulates it, ``infinity plan`` prints it. A second place that re-derives a tier or a pool size
is a bug waiting to disagree.

Pure: it takes the model as each unit's (numel, trainable) parameters and the machine as a
``Hardware`` (detected, or a described target); nothing here touches memory or disks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from infinity.config import InfinityConfig
from infinity.planner.alignment import (first_rank_range, flat_layout, shard_numel,
                                         unit_layout_bound)
from infinity.planner.engine_sizes import (
    ACTIVATION_STAGING_BYTES,
    GRADS_HELD,
    EngineSizes,
    engine_sizes,
    gradient_pool_needed,
    held_room_bytes,
    step_slot_count,
    stepped_sub_group,
)
from infinity.planner.inputs import Hardware, ModelStats
from infinity.planner.optimizer_room import NO_ROOM_NEEDED, OptimizerRoom, make_room
from infinity.planner.placement import Placement, compute_dtype_choice, place, state_bytes
from infinity.planner.sizes import DEVICE_GRAD_BUFFERS, DerivedSizes, counted_units, derive_sizes
from infinity.planner.state_format import (MIN_INT8_NUMEL, Int8SubGroupError,
                                            int8_sub_group_refusal)
from infinity.planner.tiers import Tier

__all__ = ["PoolPlan", "OptimizerPools", "UnitParams", "RunPlan", "plan_run", "optimizer_pools",
           "speculation_blockers", "check_state_format", "state_format_refusal", "units_of_stats",
           "stats_of_units", "SPECULATION_DISK_MARGIN"]

SPECULATION_DISK_MARGIN = 1.05
"""The speculative step's second copies are taken ("auto") only where the swap path's
filesystem has this many times the NVMe bytes they need free."""


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """A pool of equal host slots (``storage.buffer_pool.BufferPool``): how many, how large."""

    name: str
    count: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return self.count * self.slot_bytes


@dataclass(frozen=True, kw_only=True)
class OptimizerPools:
    """The partitioned optimizer's host pools and rooms, as it allocates them."""

    sub_group_numel: int
    """Elements the step stream steps at once (a multiple of 2048, no larger than the largest
    range a rank steps)."""
    gradient: PoolPlan | None
    """GRADS_HELD flat float32 buffers, each one unit's gradient on its way to the step (see
    ``gradient_pool_needed``); None where gradients go straight to their home."""
    step: PoolPlan | None
    """The step stream's float32 slots, a sub-group each; None where no state streams from
    NVMe."""
    held_room_bytes: int
    """Bytes of autograd gradients the backward may hold before it waits for a step (see
    [Note: held gradients] in optim/gradients.py)."""
    holds_grads: bool
    """The early (or speculative) step keeps autograd's gradients as they are: one rank on a
    CPU device."""
    device_grad_buffers: int = DEVICE_GRAD_BUFFERS
    """Device buffers gradients are reduced in with several ranks on a GPU (``DerivedSizes.
    device_grad_buffers``)."""
    device_grad_dtype: str = "fp32"
    """Their dtype, the collective's and the shard's copy to the host (``DerivedSizes.
    device_grad_dtype``: ``communication_data_type``, unset the compute dtype)."""


@dataclass(frozen=True)
class UnitParams:
    """One unit's parameters as (numel, trainable) pairs. ``ordered``: in the unit's flat order
    (``zero.unit.Unit``: trainable ones first, by param group), so its layout is exact; else the
    layout is bounded (``unit_layout_bound``), as for a model known only by its counts."""

    params: tuple[tuple[int, bool], ...]
    ordered: bool = False

    def layout(self, itemsize: int) -> tuple[int, int]:
        """(flat numel, trainable numel) of the unit's flat buffer in ``itemsize`` elements."""
        if self.ordered:
            _, numel, trainable = flat_layout(self.params, itemsize)
            return numel, trainable
        return unit_layout_bound(self.params, itemsize)


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What the engine will build for a config on a machine, decided once (see the module
    docstring). Frozen: the parts read it; none of them re-derives any of it."""

    config: InfinityConfig
    """The config as given (its "auto" sizes unresolved: ``derived`` resolves them)."""
    placement: Placement
    """Where each state lives (its gradients' home as ``sizes`` decided it), the compute dtype,
    single copy or separate master, the early step."""
    derived: DerivedSizes
    """The config's sizes resolved from the budgets."""
    sizes: EngineSizes
    """The engine's sizes for these units: budgets, fetch slots, sub-group, prefetch, NVMe."""
    compute_dtype_reason: str
    """Why the compute dtype is what it is (logged, shown by ``infinity plan``)."""
    device_is_cpu: bool
    """The device is the CPU (an emulated pool in host memory), not a GPU."""
    direct_fetch: bool
    """NVMe reads land straight in device memory (a CPU device): no fetch slots."""
    speculative: bool
    """The speculative step keeps second copies of the NVMe parameters and Adam states."""
    speculative_reason: str
    """Why ``speculative`` is what it is."""
    speculation_possible: bool
    """The config and placement allow the speculative step (one rank, stage 3, parameters and
    Adam states on NVMe, the deferred schedule): ``speculative`` False then means the disk
    lacks the room for the second copies, or it was not asked for."""
    fetch_pool: PoolPlan | None
    """The host slots parameters are read into from NVMe before their device copy."""
    optimizer: OptimizerPools
    """The optimizer's pools."""
    activation_staging_bytes: int
    """Host bytes of the activation swapper's staging (0 when none is taken)."""
    least_host_budget: int | None = None
    """The planner's least host budget for this model and config, where the one given is under
    it and the engine tries anyway (told if a pool then does not fit); None otherwise."""
    room: OptimizerRoom = NO_ROOM_NEEDED
    """What the plan gave up of the config's unset sizes for a useful optimizer sub-group, and
    why (see [Note: room for the optimizer] in planner/optimizer_room.py); ``derived`` and
    ``sizes`` are already the sizes it chose."""

    # -- the decisions, by name ----------------------------------------------------------
    @property
    def compute_dtype(self) -> str:
        return self.placement.compute_dtype

    @property
    def stage(self) -> int:
        return self.placement.stage

    @property
    def param_tier(self) -> Tier:
        return self.placement.param_tier

    @property
    def optimizer_tier(self) -> Tier:
        return self.placement.opt_tier

    @property
    def master_separate(self) -> bool:
        return not self.placement.single_copy

    @property
    def early_step(self) -> bool:
        return self.placement.early_step

    @property
    def boundary_steps(self) -> bool:
        """The last micro-batch's backward steps each unit (optim/boundary_steps.py); not with
        the speculative step, which steps that backward's units its own way, nor where the
        gradients' home is on NVMe (the host budget cannot hold it): the backward would write
        a home the step reads back, so every unit waits for ``step()``."""
        return self.placement.boundary_steps and not self.speculative and \
            self.grad_tier == Tier.HOST

    @property
    def grad_tier(self) -> Tier:
        return self.sizes.grad_tier

    @property
    def pools(self) -> tuple[PoolPlan, ...]:
        """Every host pool the engine allocates, in the order it allocates them."""
        return tuple(p for p in (self.fetch_pool, self.optimizer.gradient, self.optimizer.step)
                     if p is not None)


def units_of_stats(stats: ModelStats) -> list[UnitParams]:
    """The units of a model known by its counts (planner/sizes.py ``counted_units``, cached
    there): one (numel, trainable) entry per parameter where the stats list them unit by unit,
    else one per unit; the frozen elements taken from the first units."""
    return [UnitParams(params) for params in counted_units(stats)]


def stats_of_units(units: Sequence[UnitParams]) -> ModelStats:
    """The planner's counts of a model whose units are known parameter by parameter."""
    numels = [numel for unit in units for numel, _ in unit.params]
    sizes = [sum(numel for numel, _ in unit.params) for unit in units]
    trainable = sum(numel for unit in units for numel, t in unit.params if t)
    return ModelStats(total_params=sum(numels), trainable_params=trainable,
                      largest_unit_params=max(sizes, default=0), n_units=len(sizes),
                      largest_param=max(numels, default=0), param_numels=tuple(numels))


def speculation_blockers(cfg: InfinityConfig, placement: Placement) -> list[str]:
    """Why the speculative step cannot run under ``cfg`` (empty: it can; see [Note: speculative
    step] in optim/speculation.py): the deferred schedule at stage 3, with parameters and Adam
    states on NVMe, where second copies cost disk space only."""
    blockers = []
    if placement.early_step:
        blockers.append("the early step is in use (it needs no speculation)")
    if placement.stage != 3:
        blockers.append(f"zero_optimization.stage is {placement.stage} (stage 3 only)")
    if placement.param_tier is not Tier.NVME or placement.opt_tier is not Tier.NVME:
        blockers.append(f"parameters live on {placement.param_tier.name} and Adam states on "
                        f"{placement.opt_tier.name} (both must be on NVMe)")
    if not placement.state_format.is_default:
        blockers.append(f"the Adam states are stored as {placement.state_format.describe()} "
                        "(the speculative step's redo reads fp32 states)")
    return blockers


def state_format_refusal(cfg: InfinityConfig, placement: Placement, device_is_cpu: bool, *,
                         project_gpu_master: bool = False) -> tuple[str, str] | None:
    """Why the engine cannot run the placement's state format on this machine, as (a few
    words for a table, the whole message), or None where it can (``check_state_format``)."""
    fmt = placement.state_format
    if fmt.master == "bf16":
        if fmt.moments == "fp32":
            return "a bf16 master needs bf16 or int8 moments", (
                "infinity.optimizer_master = \"bf16\" with optimizer_moments \"fp32\": the "
                "stochastically rounded bf16 master is updated by the fused kernels of the bf16 "
                "and int8 moments only. Set optimizer_moments to \"bf16\" or \"int8\", or keep "
                "optimizer_master \"fp32\"")
        if placement.compute_dtype != "bf16":
            return f"a bf16 master needs bf16 compute (here {placement.compute_dtype})", (
                f"infinity.optimizer_master = \"bf16\" makes the bf16 parameter its own master, "
                f"but the compute dtype is {placement.compute_dtype}: set "
                "infinity.compute_dtype to \"bf16\" (on a CPU that multiplies bf16 natively), or "
                "keep optimizer_master \"fp32\"")
        if not device_is_cpu and not project_gpu_master:
            return "not available on GPUs yet", (
                "infinity.optimizer_master = \"bf16\" runs on a CPU device only for now (the "
                "step updates the host copy of the bf16 parameters in place; on a GPU it would "
                "step through the parameters' home, which is not built yet): keep "
                "optimizer_master \"fp32\" on a GPU (optimizer_moments still applies)")
    if not fmt.is_default and not device_is_cpu and placement.opt_tier is Tier.DEVICE:
        return "the optimizer is on the GPU (formats need it offloaded)", (
            f"infinity.optimizer_moments = {fmt.moments!r} / optimizer_master = {fmt.master!r} "
            "with the optimizer on the GPU (zero_optimization.offload_optimizer.device \"none\"):"
            " the formats are stepped by the CPU Adam, on offloaded states. Offload the "
            "optimizer (\"cpu\" or \"nvme\"), or keep the fp32 formats")
    return None


def check_state_format(cfg: InfinityConfig, placement: Placement, device_is_cpu: bool, *,
                       project_gpu_master: bool = False) -> None:
    """Refuse a state format the engine cannot run on this machine, before anything is built
    (see planner/state_format.py). ``project_gpu_master``: let a bf16 master on a GPU through
    (the planner's projection of what it would take; the engine never passes it)."""
    refusal = state_format_refusal(cfg, placement, device_is_cpu,
                                   project_gpu_master=project_gpu_master)
    if refusal is not None:
        raise ValueError(refusal[1])


def _speculation(cfg: InfinityConfig, placement: Placement) -> tuple[bool, str]:
    """Whether the speculative step is possible at all (before the disk's room is known)."""
    mode = cfg.infinity.speculative_step
    if mode == "off":
        return False, "infinity.speculative_step is \"off\""
    blockers = speculation_blockers(cfg, placement)
    if blockers and mode == "on":
        raise ValueError("infinity.speculative_step = 'on' cannot be used: " + "; ".join(blockers)
                         + ". Set it to 'auto' or 'off'")
    if blockers:
        return False, "; ".join(blockers)
    if cfg.world_size > 1:
        # a redo would need the other ranks' gradients (see PartitionedOptimizer)
        return False, f"{cfg.world_size} ranks (one rank only)"
    return True, f"speculative_step {mode!r}, stage 3 with parameters and Adam states on NVMe"


def optimizer_pools(units: Sequence[tuple[int, int]], *, world_size: int, rank: int,
                    shard_states: bool, sub_group_numel: int, optimizer_tier: Tier,
                    param_tier: Tier, streamed: Sequence[bool], grad_tier: Tier,
                    master_separate: bool, early_step: bool, speculative: bool,
                    keeps_gradients: bool, held_room_off: bool = False,
                    reduces_on_device: bool = False,
                    device_grad_buffers: int = DEVICE_GRAD_BUFFERS,
                    device_grad_dtype: str = "fp32") -> OptimizerPools:
    """The optimizer's pools for ``units``' (flat numel, trainable numel) layouts on ``rank``
    of ``world_size`` (``shard_states``: each rank steps its shard, stages 1-3). ``streamed``:
    per unit, whether its parameters have a home store (stage 3 above the persistence
    threshold), in ``param_tier``. ``keeps_gradients``: the device lets the early step keep
    autograd's gradients (a CPU device). ``held_room_off``: held gradients get no room beside
    the unit being stepped (see [Note: room for the optimizer] in planner/optimizer_room.py).
    ``reduces_on_device``: with several ranks each unit's gradient is reduced on the device and
    only the own range reaches a host gradient buffer (a GPU; see [Note: gradients reduced on
    the device] in optim/device_gradients.py), so a buffer holds that range, not the unit."""
    ranks_active = world_size > 1
    sharded = shard_states and ranks_active
    trainable = [(numel, t, s) for (numel, t), s in zip(units, streamed) if t > 0]
    max_trainable = max((t for _, t, _ in trainable), default=0)
    collect = []
    first_ranges = []       # rank 0's, the largest: the same on every rank
    for numel, t, _ in trainable:
        if sharded:
            shard = shard_numel(numel, world_size)
            own = min(rank * shard + shard, t) - min(rank * shard, t)
            collect.append(own if reduces_on_device else world_size * shard)
        else:
            collect.append(t)
        first_ranges.append(first_rank_range(numel, t, world_size if sharded else 1))
    # one sub-group on every rank: a unit's state format is checked against it on each (int8
    # needs a whole chunk where the range has one), and a rank whose last shards are short
    # (3 ranks, a small unit) must answer as the others do, or it alone refuses and the rest
    # wait at their first collective
    sub_group = stepped_sub_group(sub_group_numel, max(first_ranges, default=0))
    speculates = speculative and not early_step and not ranks_active
    holds = (early_step or speculates) and keeps_gradients and not ranks_active
    gradient = None
    if max_trainable and gradient_pool_needed(early_step, holds, grad_tier, ranks_active):
        gradient = PoolPlan(name="gradient", count=GRADS_HELD, slot_bytes=max(collect) * 4)
    params_streamed = any(s for _, _, s in trainable)
    step = None
    if max_trainable and (optimizer_tier is Tier.NVME or grad_tier is Tier.NVME
                          or (params_streamed and param_tier is Tier.NVME)):
        count = step_slot_count(optimizer_tier, param_tier if params_streamed else Tier.DEVICE,
                                grad_tier, master_separate, early_step)
        step = PoolPlan(name="optimizer", count=count, slot_bytes=sub_group * 4)
    return OptimizerPools(sub_group_numel=sub_group, gradient=gradient, step=step,
                          held_room_bytes=0 if held_room_off and holds
                          else held_room_bytes(max_trainable), holds_grads=holds,
                          device_grad_buffers=device_grad_buffers,
                          device_grad_dtype=device_grad_dtype)


def plan_run(cfg: InfinityConfig, hw: Hardware, *, stats: ModelStats | None = None,
             units: Sequence[UnitParams] | None = None, device_is_cpu: bool | None = None,
             direct_reads: bool | None = None, keeps_gradients: bool | None = None,
             rank: int = 0, speculative: bool | None = None,
             derived: DerivedSizes | None = None, project_gpu_master: bool = False) -> RunPlan:
    """The run plan of ``cfg`` for a model on ``hw``: the model as its ``units`` (exact, from
    the engine's partition) or its ``stats`` (counts: the units are bounded), one at least.

    ``device_is_cpu`` None: the device is a GPU where ``hw`` has one. ``direct_reads``: the
    device's memory can take NVMe reads itself (a CPU device whose memory cache gives units
    page-aligned blocks, ``storage.device_cache.DeviceMemoryCache.supported``); None: where the
    device is the CPU. ``keeps_gradients``: the early step may keep autograd's gradients as
    they are instead of copying them to host buffers (``optim.gradients.gradients_held``: a CPU
    device); None: where the device is the CPU. ``rank``: the rank whose
    pools are planned (rank 0 steps the largest shard). ``speculative`` None: as the engine
    decides (possible, and the disk has room for the second copies); True/False forces it
    (the planner's "what if"). ``derived``: the resolved sizes, where the caller has them.
    ``project_gpu_master``: plan a bf16 master on a GPU, which the engine refuses for now (the
    planner's projection; see ``check_state_format``)."""
    if units is None and stats is None:
        raise ValueError("plan_run needs the model's units or its stats")
    if units is None:
        units = units_of_stats(stats)
    if stats is None:
        stats = stats_of_units(units)
    cpu = not hw.has_gpu if device_is_cpu is None else device_is_cpu
    # a model left on a GPU machine's CPU: its states are placed for the CPU it computes on;
    # the compute dtype and the derived sizes follow the machine, as before the run plan
    placement = place(cfg, stats, hw, cpu_device=cpu)
    check_state_format(cfg, placement, cpu, project_gpu_master=project_gpu_master)
    _, reason = compute_dtype_choice(cfg, hw)
    pairs = [unit.params for unit in units]
    # the derived sizes count the device gradient buffers from these units' layouts, as
    # engine_sizes reserves them
    derived = derived or derive_sizes(cfg, stats, hw, units=pairs)
    itemsize = placement.c
    direct = placement.param_tier is Tier.NVME and (cpu if direct_reads is None else direct_reads)

    def sized(config: InfinityConfig, spec: bool, held_room_off: bool = False,
              resolved: DerivedSizes | None = None) -> tuple[DerivedSizes, EngineSizes]:
        resolved = resolved or derive_sizes(config, stats, hw, units=pairs)
        return resolved, engine_sizes(
            config, pairs, resolved, itemsize, placement.param_tier, placement.opt_tier,
            not placement.single_copy, placement.early_step, direct_fetch=direct,
            speculative=spec, host_activations=cpu, state_format=placement.state_format,
            held_room_off=held_room_off, device_reduce=not cpu and cfg.world_size > 1)

    def sizes_for(spec: bool) -> EngineSizes:
        return sized(cfg, spec, resolved=derived)[1]

    possible, spec_reason = _speculation(cfg, placement)
    if speculative is None:
        speculative = possible
        if possible and cfg.infinity.speculative_step == "auto" and hw.disk_free_bytes is not None:
            need = sizes_for(True).nvme_bytes
            if hw.disk_free_bytes < SPECULATION_DISK_MARGIN * need:
                speculative = False
                spec_reason = (f"the swap path's filesystem has {hw.disk_free_bytes:,} bytes "
                               f"free, not {SPECULATION_DISK_MARGIN:.2f} x the {need:,} the "
                               "second copies of the NVMe states need")
    elif not speculative:
        spec_reason = "not asked for"
    else:
        speculative = possible

    world = cfg.world_size
    shards = world if placement.stage >= 1 else 1
    spans = []           # (trainable elements, the range this rank steps) per unit
    largest_range = 0    # rank 0's largest range: a figure every rank plans alike
    for unit in units:
        numel, trainable = unit.layout(itemsize)
        span = trainable
        if shards > 1:
            shard = shard_numel(numel, shards)
            span = min(rank * shard + shard, trainable) - min(rank * shard, trainable)
        spans.append((sum(n for n, t in unit.params if t), span))
        largest_range = max(largest_range, first_rank_range(numel, trainable, shards))
    ranks_active = world > 1
    keeps = cpu if keeps_gradients is None else keeps_gradients
    holds = (placement.early_step or (speculative and not ranks_active)) and keeps \
        and not ranks_active
    # [Note: room for the optimizer] in planner/optimizer_room.py: one rule, read by the
    # engine and infinity plan alike, and by every rank alike (from rank 0's ranges: the last
    # rank's short shards made it alone keep buffers the others gave up, and run out of room)
    room, derived, sizes = make_room(
        cfg, (derived, sizes_for(speculative)), lambda c, off: sized(c, speculative, off),
        largest_range=largest_range,
        largest_unit=stats.largest_unit_params,
        direct_fetch=direct, params_fetched=placement.stage == 3
        and placement.param_tier is Tier.NVME, holds_grads=holds)
    placement = placement.with_gradient_home(sizes.grad_tier, sizes.grad_home_itemsize)

    layouts = []
    streamed = []
    for unit in units:
        numel, trainable = unit.layout(itemsize)
        layouts.append((shards * shard_numel(numel, shards), trainable))
        streamed.append(placement.stage == 3 and numel > sizes.persistence_threshold)
    placement = dataclasses.replace(placement, unit_states=state_bytes(
        placement.state_format, spans, ranks=world, sharded=placement.stage >= 1,
        master_separate=not placement.single_copy, compute_itemsize=itemsize))
    fetch_pool = None
    if placement.param_tier is Tier.NVME and not direct:
        fetch_pool = PoolPlan(name="fetch", count=sizes.fetch_slots,
                              slot_bytes=sizes.fetch_slot_bytes)
    pools = optimizer_pools(
        layouts, world_size=world, rank=rank, shard_states=placement.stage >= 1,
        sub_group_numel=sizes.sub_group_numel, optimizer_tier=placement.opt_tier,
        param_tier=placement.param_tier, streamed=streamed, grad_tier=sizes.grad_tier,
        master_separate=not placement.single_copy, early_step=placement.early_step,
        speculative=speculative, keeps_gradients=keeps, held_room_off=room.held_room_off,
        reduces_on_device=not cpu and ranks_active,
        device_grad_buffers=derived.device_grad_buffers,
        device_grad_dtype=derived.device_grad_dtype)
    # as the engine refuses it: only where some unit is stepped in int8 (a unit under
    # MIN_INT8_NUMEL trainable elements keeps fp32 moments whatever was asked)
    int8_units = placement.state_format.moments == "int8" and any(
        t >= MIN_INT8_NUMEL for t, _ in spans)
    refusal = int8_sub_group_refusal(pools.sub_group_numel, largest_range)
    if int8_units and refusal is not None:
        raise Int8SubGroupError(refusal)     # as the engine would at its first unit
    return RunPlan(config=cfg, placement=placement, derived=derived, sizes=sizes,
                   compute_dtype_reason=reason, device_is_cpu=cpu, direct_fetch=direct,
                   speculative=speculative, speculative_reason=spec_reason,
                   speculation_possible=possible,
                   fetch_pool=fetch_pool, optimizer=pools, room=room,
                   activation_staging_bytes=ACTIVATION_STAGING_BYTES
                   if sizes.activation_staging else 0)
