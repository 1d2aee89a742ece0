"""The engine's own sizes: the derived sizes (``infinity.planner.sizes``) completed with what
only the built units tell (their flat layouts), the schedule's slot counts, where gradients live
and how much NVMe to reserve.

Pure: the engine (``infinity.engine.sizing``) hands in each unit's (numel, trainable) pairs and
the compute dtype's item size; the optimizer asks ``step_slot_count`` and
``accumulate_chunk_numel`` for the pools it allocates, so what the engine budgets for is what the
optimizer takes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.alignment import (
    ALIGN_BYTES,
    FP32_BYTES,
    padded_numel,
    shard_numel,
    unit_layout_bound,
)
from infinity.planner.placement import gradient_home_itemsize
from infinity.planner.sizes import (
    DEVICE_GRAD_BUFFERS,
    DTYPE_BYTES,
    PREFETCH_UNITS,
    DerivedSizes,
    device_gradient_bytes,
    fetched_unit_bytes,
    prefetch_bytes,
    prefetch_within,
)
from infinity.planner.state_format import (
    FP32_STATES,
    INT8_CHUNK,
    StateFormat,
    keeps_fp32_master,
    unit_format,
    unit_stores,
)
from infinity.planner.tiers import Tier

__all__ = ["EngineSizes", "engine_sizes", "step_slot_count", "accumulate_chunk_numel",
           "optimizer_store_bytes", "INT8_SUB_GROUP", "DEVICE_GRAD_BUFFERS",
           "ACCUMULATE_CHUNK_NUMEL", "ACTIVATION_STAGING_BYTES", "activation_staging"]

ACCUMULATE_CHUNK_NUMEL = 2 << 20
"""Elements (8 MiB) of the host chunk through which accumulation adds a gradient kept on NVMe."""
STAGING_CHUNK_BYTES = 4 << 20
"""Bytes of one page-aligned staging chunk of the activation swapper (zero/activation_swap.py)."""
STAGING_CHUNKS = 8
"""Staging chunks of the activation swapper."""
ACTIVATION_STAGING_BYTES = STAGING_CHUNK_BYTES * STAGING_CHUNKS
"""Host bytes of the activation swapper's staging, counted in the host budget."""
GRADS_HELD = 2
"""Flat gradient buffers of the optimizer's gradient pool (a unit's gradient each: one being
collected, one being stepped), where gradients go through host buffers (the early step off
a CPU device, an NVMe gradient home, several ranks)."""
HELD_ROOM_UNITS = 1.0
"""Largest units' worth of held gradients before the backward waits for a background step
(see optim/held_room.py)."""


INT8_SUB_GROUP = INT8_CHUNK
"""The least sub-group of a run with int8 moments: the optimizer steps them in chunks of two
blocks (``planner.state_format.INT8_CHUNK``) and refuses a smaller sub-group."""


def optimizer_store_bytes(state_shares: Sequence[int], fmt: StateFormat, master_separate: bool,
                          itemsize: int, trainable: Sequence[int] | None = None
                          ) -> tuple[int, int, bool]:
    """(bytes in the optimizer's tier, bytes in host memory, any unit in int8) of the
    optimizer's stores for units whose ranges this rank steps are ``state_shares``, each store
    padded to 4 KiB as the tier manager pads it: m, v (and the fp32 master) in the unit's
    format, and the int8 scales, which stay in host memory (planner/state_format.py
    ``unit_stores``)."""
    tier = host = 0
    int8 = False
    # each unit's format is decided on its trainable elements (``trainable``; by default the
    # shares: one rank), the same on every rank
    trainable = state_shares if trainable is None else trainable
    pairs = Counter((s, t) for s, t in zip(state_shares, trainable) if s > 0)   # few sizes
    for (share, whole), units in pairs.items():
        unit = unit_format([fmt], whole)
        int8 = int8 or unit.moments == "int8"
        master = keeps_fp32_master(unit, master_separate=master_separate,
                                   compute_itemsize=itemsize)
        for store in unit_stores(unit, share, fp32_master=master):
            nbytes = units * padded_numel(store.numel, store.itemsize) * store.itemsize
            if store.in_host:
                host += nbytes
            else:
                tier += nbytes
    return tier, host, int8


def held_room_bytes(max_trainable: int) -> int:
    """Bytes held gradients may take before the backward waits for a background step."""
    return int(HELD_ROOM_UNITS * max_trainable * 4)


def gradient_buffer_bytes(max_trainable: int, largest_part: int | None = None) -> int:
    """Host bytes of the gradients on their way to the step, counted once for both ways the
    optimizer may take them: its GRADS_HELD flat buffers, or held gradients (the room and the
    part waiting for it). ``largest_part`` given: the gradients are held with no room (see
    [Note: room for the optimizer] in planner/optimizer_room.py): the unit being stepped and
    the next unit's first part, its largest trainable parameter at most, in fp32."""
    if largest_part is not None:
        return (max_trainable + min(largest_part, max_trainable)) * 4
    return max(GRADS_HELD * max_trainable * 4, held_room_bytes(max_trainable) + max_trainable * 4)


MIN_SLOT_SHARE = 0.5
"""The room kept for the step (activation windows, autograd's gradient) is kept only where the
optimizer slots keep at least this share of the sub-group they would get without it."""
SUB_GROUP_ALIGN = ALIGN_BYTES // 2
"""Sub-groups are multiples of this many elements (2048: 4 KiB aligned in fp32 and in 16-bit, as
the optimizer rounds them); the host budget shrinks one to no less than this."""


@dataclass(frozen=True)
class EngineSizes:
    """Every size the engine allocates by (bytes unless the name says numel)."""

    host_budget: int | None
    device_budget: int | None
    sub_group_numel: int
    fetch_slots: int
    max_unit_bytes: int
    fetch_slot_bytes: int
    """A fetch slot: the largest unit's parameter home (its shard with several ranks)."""
    persistence_threshold: int
    prefetch_bucket_numel: int
    max_live_numel: int
    max_reuse_numel: int
    grad_tier: Tier
    nvme_bytes: int
    host_home_bytes: int = 0
    """Host bytes of the states whose home is the host (parameters, Adam states, gradients) and
    of the int8 moments' scales (in host memory whatever the optimizer's tier)."""
    host_buffer_bytes: int = 0
    """Host bytes of the pools: fetch slots, step-stream slots, gradient rooms, staging."""
    activation_staging: bool = False
    """The activation swapper's staging is in the host buffers ("nvme", or "auto" with a swap
    directory where the budget has room for it beside the smallest optimizer slots)."""
    step_reserve_bytes: int = 0
    """Host bytes the optimizer slots leave for the step beside the pools, with activation
    staging: two windows of swapped activations and, on a CPU device, autograd's gradient of
    the largest unit (see [Note: room kept for the step])."""
    gradient_reserve_bytes: int = 0
    """Of ``step_reserve_bytes``, autograd's gradient of the largest unit (0 off a CPU device)."""
    grad_home_itemsize: int = 4
    """Bytes per element of the gradients' home: 2 where a host home never sums (see [Note: the
    gradient home in the compute dtype] in planner/placement.py), else 4."""
    activation_room: int | None = None
    """Host bytes the host budget leaves beside the engine's homes and pools (and, on a CPU-only
    machine, the emulated device pool) and the step's reserve: where activations kept in memory
    must fit (offload_activations "auto"); None without a host budget."""
    gradient_buffer_bytes: int = 0
    """Of ``host_buffer_bytes``, the gradients on their way to the step: the gradient pool's
    GRADS_HELD buffers or the held gradients' room and the part waiting for it."""
    accumulate_bytes: int = 0
    """Of ``host_buffer_bytes``, the chunk through which accumulation adds an NVMe gradient."""
    device_gradient_bytes: int = 0
    """Device bytes of the buffers gradients are reduced in with several ranks on a GPU (see
    [Note: gradients reduced on the device] in optim/device_gradients.py); 0 otherwise."""


def step_slot_count(optimizer_tier: Tier, param_tier: Tier, grad_tier: Tier,
                    master_separate: bool, early_step: bool) -> int:
    """Host slots for the step stream: about 3 sub-groups in flight (read ahead, stepped,
    written behind), each with one slot per state streamed from NVMe. The stream holds fewer
    when the pool runs short; it never waits on slots it holds itself."""
    per_group = 0
    if optimizer_tier == Tier.NVME:
        per_group += 2 + int(master_separate)          # m, v (+ fp32 master)
    if not early_step and grad_tier == Tier.NVME:
        per_group += 1                                  # gradient
    # both schedules step a fetched unit and write its parameters home through two more slots
    # (none when its device copy is page-aligned host memory)
    staging = 2 if param_tier == Tier.NVME else 0
    return max(1, 3 * per_group + staging)


def stepped_sub_group(sub_group_numel: int, largest_range: int) -> int:
    """The sub-group the optimizer steps: no larger than the largest range a rank steps (its
    shard with several), a multiple of SUB_GROUP_ALIGN (4 KiB aligned in fp32 and 16-bit)."""
    return -(-max(1, min(sub_group_numel, largest_range or 1)) // SUB_GROUP_ALIGN) \
        * SUB_GROUP_ALIGN


def gradient_pool_needed(early_step: bool, holds_grads: bool, grad_tier: Tier,
                         ranks_active: bool) -> bool:
    """Whether the optimizer collects gradients in its GRADS_HELD flat host buffers: an early
    step that does not hold autograd's gradients (off a CPU device), an NVMe gradient home
    (through float32 slots), or several ranks (each unit's reduced gradient lands there)."""
    return (early_step and not holds_grads) or (not early_step and grad_tier == Tier.NVME) \
        or ranks_active


def accumulate_chunk_numel(max_trainable: int) -> int:
    """The accumulation chunk: 8 MiB, or the largest unit's gradient when smaller (a multiple
    of 4 KiB either way, so every chunk starts aligned for O_DIRECT)."""
    return min(ACCUMULATE_CHUNK_NUMEL, padded_numel(max(1, max_trainable), FP32_BYTES))


def engine_sizes(cfg: InfinityConfig, units: Sequence[Sequence[tuple[int, bool]]],
                 derived: DerivedSizes, itemsize: int, param_tier: Tier, optimizer_tier: Tier,
                 master_separate: bool, early_step: bool, direct_fetch: bool = False,
                 speculative: bool = False, host_activations: bool = True,
                 state_format: StateFormat = FP32_STATES,
                 held_room_off: bool = False, device_reduce: bool = False) -> EngineSizes:
    """Sizes for this model, config and machine: ``units`` are each unit's (numel, trainable)
    parameters, ``itemsize`` the compute dtype's bytes per element (``speculative``: parameters
    and Adam states have second copies on NVMe; ``host_activations``: saved activations live in
    host memory, a CPU device -- on a GPU they stay in device memory under "auto", which takes
    no staging and keeps no room for them).

    ``direct_fetch``: NVMe reads land straight in device memory (a CPU device, see
    ``Unit.start_fetch``), so there are no fetch slots; the host they would have taken goes to
    the emulated device pool, where prefetched units now wait (unless the user set its budget).

    ``state_format``: the config's Adam state format; each unit's optimizer stores are sized in
    its own (``optimizer_store_bytes``), the int8 scales counted in host memory.

    ``held_room_off``: the early (or speculative) step holds autograd's gradients with no room
    beside the unit being stepped (the run plan's last economy for the optimizer's sub-group,
    see [Note: room for the optimizer] in planner/optimizer_room.py).

    ``device_reduce``: several ranks reduce each unit's gradient in device buffers and copy
    only the own shard to the host (a GPU: see [Note: gradients reduced on the device] in
    optim/device_gradients.py): the host gradient buffers hold a shard, not the unit.
    """
    nvme_path = cfg.zero.swap_path
    layouts = [unit_layout_bound(u, itemsize) for u in units]
    unit_numels = [numel for numel, _ in layouts]
    # per rank (see [Note: shards] in zero/unit.py): each rank's homes hold a shard of every
    # unit's parameters (stage 3) and of its optimizer states and gradients (stages 1-3)
    ranks = cfg.world_size if cfg.zero.stage >= 1 else 1
    shards = [shard_numel(numel, ranks) for numel in unit_numels]
    trainable = [numel for _, numel in layouts]
    state_shares = [min(t, s) for t, s in zip(trainable, shards)]
    max_unit_bytes = max(unit_numels, default=0) * itemsize
    threshold = derived.persistence_threshold
    streamed_homes = [s for n, s in zip(unit_numels, shards) if n > threshold] \
        if cfg.zero.stage == 3 else []
    # a fetch reads a rank's own shard into a slot (the gather fills the rest on the device)
    fetch_slot_bytes = max(streamed_homes, default=0) * itemsize or max_unit_bytes
    host_budget = derived.host_budget_bytes
    # on a CPU-only machine the planner pays the emulated device pool out of the host budget
    device_budget = derived.device_budget_bytes

    # Host bytes the engine will hold before gradients get a home.
    total_trainable = sum(state_shares)
    state_bytes, scale_bytes, int8 = optimizer_store_bytes(state_shares, state_format,
                                                           master_separate, itemsize,
                                                           trainable=trainable)
    least_sub_group = INT8_SUB_GROUP if int8 else SUB_GROUP_ALIGN
    host = scale_bytes                  # int8 scales: host memory whatever the tier
    if param_tier == Tier.HOST:
        host += sum(streamed_homes) * itemsize
    if optimizer_tier == Tier.HOST:
        host += state_bytes
    homes = host
    fetch_slots = derived.param_buffer_count
    if param_tier == Tier.NVME and direct_fetch:
        moved = fetch_slots * max_unit_bytes
        if cfg.infinity.device_memory_budget is None and host_budget is not None and \
                device_budget is not None:
            moved = min(moved, max(0, host_budget - max_unit_bytes))
            host_budget -= moved
            device_budget += moved
        fetch_slots = 0
    elif param_tier == Tier.NVME:
        host += fetch_slots * fetch_slot_bytes
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
        # (the prefetch counts what is already in flight: see choose_prefetch), beside a
        # fetched unit and its gradients in the bytes a fetch reserves (every shard, padded:
        # ``fetched_unit_bytes``; a prefetched unit's shards too: ``prefetch_bytes``)
        largest = max(unit_numels, default=0)
        if cfg.zero.stage3_prefetch_bucket_size is None:
            fetched = fetched_unit_bytes(layouts, cfg.world_size, cfg.zero.stage, itemsize)
            prefetch = max(prefetch, prefetch_within(
                PREFETCH_UNITS * largest, device_budget - 2 * fetched, itemsize,
                lambda n: prefetch_bytes(n, [sum(p for p, _ in u) for u in units],
                                         cfg.world_size, cfg.zero.stage, itemsize)))
        if cfg.zero.stage3_max_live_parameters is None:
            max_live = max(max_live, largest + prefetch)
    max_trainable = max(trainable, default=0)
    sub_group = max(1, derived.sub_group_size)
    streamed = optimizer_tier == Tier.NVME or param_tier == Tier.NVME
    grad_tier = Tier.HOST
    grad_itemsize = gradient_home_itemsize(itemsize, cfg.gradient_accumulation_steps or 1,
                                           cfg.world_size)
    asked_staging = ACTIVATION_STAGING_BYTES if cfg.infinity.offload_activations == "nvme" else 0
    # [Note: keeping activations within the host budget] in planner/activations.py: what the
    # config keeps for the step's activations in memory comes off the budget before the slots
    kept = (cfg.infinity.activation_reserve or 0) \
        if host_budget is not None and host_activations else 0
    if not early_step and host_budget is not None and nvme_path:
        # gradients stay on the host when they fit beside the smallest optimizer slots (and
        # the activation staging "nvme" always takes: left out, the 85M job in fp32 under
        # 560 MiB kept its gradients on the host and got 2,048-element slots, 3.4M with them
        # on NVMe)
        least_slots = step_slot_count(optimizer_tier, param_tier, Tier.HOST, master_separate,
                                      early_step) * SUB_GROUP_ALIGN * 4 if streamed else 0
        if host + total_trainable * grad_itemsize + least_slots + asked_staging + kept > \
                host_budget:
            grad_tier = Tier.NVME
    if grad_tier == Tier.NVME or early_step:
        grad_itemsize = 4          # an NVMe home goes through float32 slots; no home at all
    if not early_step and grad_tier == Tier.HOST:
        host += total_trainable * grad_itemsize              # the gradients' home
        homes += total_trainable * grad_itemsize
    gradient_buffers = accumulate = 0
    if early_step or grad_tier == Tier.NVME or speculative or cfg.world_size > 1:
        # across ranks the optimizer always collects a unit's reduced gradient in its flat
        # buffers (PartitionedOptimizer's grad_pool when comm is active)
        largest_part = max((n for u in units for n, t in u if t), default=0)
        gradient_buffers = gradient_buffer_bytes(
            max(state_shares, default=0) if device_reduce else max_trainable,
            largest_part if held_room_off else None)
        host += gradient_buffers
    if grad_tier == Tier.NVME and (cfg.gradient_accumulation_steps or 1) > 1:
        accumulate = accumulate_chunk_numel(max_trainable) * 4
        host += accumulate                      # adds the gradient kept at home, chunk by chunk
    staging = cfg.infinity.offload_activations == "nvme"
    if not staging and host_activations and activation_staging(cfg):
        # "auto" takes the staging only where it fits beside the smallest optimizer slots: a
        # budget that worked without it keeps working (its activations then stay in memory)
        least = step_slot_count(optimizer_tier, param_tier, grad_tier, master_separate,
                                early_step) * SUB_GROUP_ALIGN * 4 if streamed else 0
        staging = host_budget is None or \
            host + kept + ACTIVATION_STAGING_BYTES + least <= host_budget
    auto_staging = staging and cfg.infinity.offload_activations != "nvme"
    if staging:
        host += ACTIVATION_STAGING_BYTES
    # [Note: room kept for the step] on a CPU device autograd's gradient of a unit (in the
    # compute dtype, before the engine takes it into its buffers) is host memory outside the
    # pools, and so are the swapped activations' held tail and reads ahead (a window each):
    # where activations can be offloaded (the staging fits), the optimizer slots leave room for
    # them, so that the budget holds the step. A budget too small for the staging cannot hold
    # the step's activations anyway ("auto" warns): its slots are not shrunk for nothing (the
    # 85M main job under 512 MiB: 2.8 -> 3.1-3.5 s a step with halved sub-groups)
    gradient_reserve = max_trainable * itemsize if direct_fetch and staging else 0
    reserve = gradient_reserve + (2 * cfg.infinity.activation_window if staging else 0)
    slots = step_slot_count(optimizer_tier, param_tier, grad_tier, master_separate, early_step)

    def slots_sub_group(held: int) -> int:
        """The sub-group the optimizer slots get of what ``held`` bytes leave of the budget."""
        room = int(0.95 * max(0, host_budget - held)) // (slots * 4)
        return max(least_sub_group, min(sub_group, room // SUB_GROUP_ALIGN * SUB_GROUP_ALIGN))
    if streamed and host_budget is not None and reserve:
        # the step's room must not starve the optimizer: where it would cost the slots more
        # than half their sub-group (the 85M main job at 560-650 MiB: 2,048 elements instead
        # of ~600,000, 30x slower steps), the budget cannot hold both; speed wins: "auto" then
        # keeps activations in memory (it warns of the overshoot), "nvme" keeps its staging
        # without the reserve, as before the reserve existed
        without = host - (ACTIVATION_STAGING_BYTES if auto_staging else 0)
        if slots_sub_group(host + reserve + kept) < \
                MIN_SLOT_SHARE * slots_sub_group(without + kept):
            reserve = gradient_reserve = 0
            if auto_staging:
                staging, host = False, without
    if streamed:
        # The optimizer slots get what the other pools leave of the host budget (the planner
        # sized the sub-group for its own count of slots, which the deferred schedule exceeds).
        if host_budget is not None:
            sub_group = slots_sub_group(host + reserve + kept)
        host += slots * padded_numel(min(sub_group, max(max(state_shares, default=0), 1)),
                                     FP32_BYTES) * 4
    if kept and host + reserve + kept > host_budget:
        least = " (the optimizer's sub-groups at their least)" if streamed else ""
        raise ValueError(
            f"infinity.activation_reserve = {format_bytes(kept)} does not fit: the engine's "
            f"pools need {format_bytes(host + reserve)}{least} of the "
            f"{format_bytes(host_budget)} the host budget leaves them, which leaves "
            f"{format_bytes(max(0, host_budget - host - reserve))} for the step; "
            "lower the reserve, or raise infinity.host_memory_budget")
    # the buffers as the derived sizes counted them (the same function of the same layouts):
    # a reservation above that count would be refused at the first backward of a plan the
    # derived sizes accepted at the device budget's edge
    device_gradients = device_gradient_bytes(
        layouts, cfg.world_size, cfg.zero.stage, device_reduce, derived.device_grad_buffers,
        DTYPE_BYTES[derived.device_grad_dtype])
    if device_gradients > derived.device_grad_bytes:
        raise ValueError(
            f"the device gradient buffers: the engine reserves {device_gradients:,} bytes "
            f"({derived.device_grad_buffers} {derived.device_grad_dtype} buffer(s) of these "
            f"units' padded layouts), more than the {derived.device_grad_bytes:,} the derived "
            "sizes counted in the device budget: derive_sizes was given other units (or another "
            "machine) than engine_sizes; pass it the same units")
    nvme = 0
    copies = 2 if speculative else 1
    if param_tier == Tier.NVME:
        nvme += sum(streamed_homes) * itemsize * copies
    if optimizer_tier == Tier.NVME:
        nvme += state_bytes * copies
    if grad_tier == Tier.NVME:
        nvme += total_trainable * 4
    return EngineSizes(
        host_budget=host_budget, device_budget=device_budget, sub_group_numel=sub_group,
        fetch_slots=fetch_slots if direct_fetch else max(2, fetch_slots),
        max_unit_bytes=max_unit_bytes, fetch_slot_bytes=fetch_slot_bytes,
        persistence_threshold=threshold,
        prefetch_bucket_numel=max(prefetch, max(unit_numels, default=0)),
        max_live_numel=max(max_live, 2 * max(unit_numels, default=0)),
        max_reuse_numel=max_reuse,
        grad_tier=grad_tier, nvme_bytes=nvme, host_home_bytes=homes,
        host_buffer_bytes=host - homes, activation_staging=staging, step_reserve_bytes=reserve,
        gradient_reserve_bytes=gradient_reserve, grad_home_itemsize=grad_itemsize,
        activation_room=None if host_budget is None else max(0, host_budget - host - reserve),
        gradient_buffer_bytes=gradient_buffers, accumulate_bytes=accumulate,
        device_gradient_bytes=device_gradients)


def activation_staging(cfg: InfinityConfig) -> bool:
    """Whether the activation swapper's staging is budgeted: "nvme", or "auto" with a swap
    directory to offload to (it may choose to at the first training forward)."""
    mode = cfg.infinity.offload_activations
    has_swap = bool(cfg.zero.swap_path)
    return mode == "nvme" or (mode == "auto" and has_swap)
