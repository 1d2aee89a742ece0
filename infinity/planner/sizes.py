"""Sizes derived from the budgets: every "auto" or unset size of a config, resolved for a model
on a machine (``derive_sizes``), before any memory is touched.

The engine sizes its sub-groups, buffers and prefetch from ``derive_sizes`` at start (then adds
what only the built units tell, in ``infinity.planner.engine_sizes``), and ``infinity plan``
predicts memory from the same numbers (``infinity.planner.plan``), so the two always agree.
Assumptions are named constants below; activations and autograd temporaries are not modelled.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from infinity.base.sizes import ALIGN_BYTES, format_bytes
from infinity.config import InfinityConfig
from infinity.planner.alignment import (
    PARAM_ALIGN_BYTES,
    SHARD_ALIGN_NUMEL,
    padded_numel,
    shard_numel,
    unit_layout_bound,
)
from infinity.planner.inputs import Hardware, ModelStats
from infinity.planner.placement import Placement, place, resident_bytes
from infinity.planner.tiers import Tier

__all__ = ["DerivedSizes", "derive_sizes", "host_allowed", "pool_in_host_budget",
           "slot_bytes_per_elem", "device_working", "device_gradient_bytes", "counted_units",
           "fetched_unit_bytes", "prefetch_bytes"]

# ---- assumptions (change them here, and the engine and `infinity plan` follow) ----------------
HOST_BUDGET_FRACTION = 0.8        # default host budget: this share of MemAvailable at start
OPTIMIZER_BUFFER_SHARE = 0.5      # share of the host budget the optimizer swap slots may take
DEFAULT_BUFFER_COUNT = 4          # read i+1 | step i | write i-1 | one spare
SUB_GROUP_ROUND = 1 << 20         # auto sub-groups: a multiple of 1 Mi elements (4 MiB of fp32) ...
MIN_SUB_GROUP = 1 << 20           # ... and at least this many unless the host budget forbids
ALIGN_ELEMS = ALIGN_BYTES // 4    # 1024: 4 KiB of fp32, O_DIRECT alignment of every extent
PREFETCH_UNITS = 2                # prefetch about this many units ahead (within the device budget)
PERSISTENCE_THRESHOLD = 100_000   # params below this many elements stay on the device ...
PERSISTENT_SHARE = 0.05           # ... if they take at most this share of the device budget
REDUCE_BUCKET_SHARE = 1 / 8       # a gradient reduce bucket takes at most this share of the device
EMULATED_DEVICE_SHARE = 0.25      # CPU-only: the device pool's share of the host's budgeted memory
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEVICE_GRAD_BUFFERS = 2
"""Device flat buffers a unit's gradient is collected and reduced in with several ranks on
a GPU (one collecting, one whose shard is being copied to the host; see [Note: gradients
reduced on the device] in optim/device_gradients.py)."""
                                  # (prefetch shrinks first; the pool never drops below one unit)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _round_down(value: int, multiple: int) -> int:
    return value // multiple * multiple


@dataclass(frozen=True, kw_only=True)
class DerivedSizes:
    """Every size the engine uses, resolved: the config's value where given, else from budgets.

    Counts of elements unless the name says bytes.
    """

    sub_group_size: int
    """Optimizer elements stepped and swapped at once."""
    buffer_count: int
    """Optimizer swap slots (read i+1 | step i | write i-1 | spare)."""
    buffer_size: int
    """Elements per optimizer swap slot (one sub-group)."""
    param_buffer_count: int
    """Parameter swap slots (current unit + prefetched units + one written back)."""
    param_buffer_size: int
    """Elements per parameter swap slot (one unit's shard)."""
    max_in_cpu: int
    """Parameter elements cached on the host when parameters live on NVMe."""
    prefetch_bucket_size: int
    """Parameter elements fetched ahead of use."""
    max_live_parameters: int
    """Most parameter elements fetched on the device at once."""
    max_reuse_distance: int
    """Keep a released parameter reused within this many elements."""
    persistence_threshold: int
    """A unit of at most this many elements (its padded layout) stays on the device at stage
    3 (``engine.wiring``: the whole unit, as the unit is what is fetched)."""
    reduce_bucket_size: int
    """Gradient elements reduced at once."""
    allgather_bucket_size: int
    """Parameter elements all-gathered at once (stages 1-2)."""
    host_budget_bytes: int
    """Bytes the HOST tier and host buffers may hold."""
    device_budget_bytes: int
    """Bytes the DEVICE tier (or the emulated device pool) may hold."""
    compute_dtype: Literal["fp32", "bf16", "fp16"]
    """Forward/backward dtype."""
    early_step: bool
    """Whether a unit's optimizer step runs as soon as its gradients arrive."""
    device_grad_buffers: int = DEVICE_GRAD_BUFFERS
    """Device buffers gradients are reduced in with several ranks on a GPU (see [Note:
    gradients reduced on the device] in optim/device_gradients.py): DEVICE_GRAD_BUFFERS, or one
    where the device budget has no room for two beside the resident states and a fetched unit
    (a unit's gradient then waits, on the device, for the copy out of the one before)."""
    device_grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The dtype of those buffers, their collective and the shard's copy to the host:
    ``communication_data_type``, unset the compute dtype (the gradients' own, as DeepSpeed)."""
    device_grad_bytes: int = 0
    """Device bytes of those buffers as counted in the device budget (``device_gradient_bytes``
    of the units' padded layouts): what the engine reserves for them, never less
    (``engine_sizes`` refuses a reservation above it)."""
    unit_device_bytes: int = 0
    """Device bytes of the largest unit's flat buffer as a fetch reserves it (``Unit.nbytes``:
    its padded layout, every shard with its padding; ``fetched_unit_bytes``): what
    ``device_working`` counts for the fetched unit and for its gradients in backward."""
    prefetch_device_bytes: int = 0
    """Device bytes the units a prefetch bucket of ``prefetch_bucket_size`` elements can hold
    (``prefetch_bytes``): the prefetch ``device_working`` counts."""
    persistent_device_bytes: int = 0
    """Device bytes of the units kept on the device at stage 3 (``persistent_unit_bytes``: a
    unit whose padded layout is at most ``persistence_threshold`` elements, its whole flat
    buffer): what ``device_working`` counts for them."""
    device_room_warning: str = ""
    """Why the device budget cannot hold the user's ``stage3_prefetch_bucket_size`` beside
    those buffers, with the numbers and what to lower (the planner's warnings say it); empty
    where it can, or where the prefetch is "auto" (sized to what the buffers leave)."""

    def apply(self, cfg: InfinityConfig) -> InfinityConfig:
        """``cfg`` with every "auto" replaced by these values (what a run really used)."""
        z = cfg.zero
        zero = dataclasses.replace(
            z, sub_group_size=self.sub_group_size,
            stage3_prefetch_bucket_size=self.prefetch_bucket_size,
            stage3_param_persistence_threshold=self.persistence_threshold,
            stage3_max_live_parameters=self.max_live_parameters,
            stage3_max_reuse_distance=self.max_reuse_distance,
            reduce_bucket_size=self.reduce_bucket_size,
            allgather_bucket_size=self.allgather_bucket_size,
            offload_optimizer=dataclasses.replace(z.offload_optimizer, buffer_count=self.buffer_count,
                                                  buffer_size=self.buffer_size),
            offload_param=dataclasses.replace(z.offload_param, buffer_count=self.param_buffer_count,
                                              buffer_size=self.param_buffer_size,
                                              max_in_cpu=self.max_in_cpu))
        inf = dataclasses.replace(cfg.infinity, host_memory_budget=self.host_budget_bytes,
                                  device_memory_budget=self.device_budget_bytes,
                                  compute_dtype=self.compute_dtype,
                                  early_step="on" if self.early_step else "off")
        # communication_data_type stays as given: unset it follows the compute dtype written
        # here, and a CPU device (which reduces in fp32) may resolve a compute dtype the key
        # given for a GPU would be refused beside
        return dataclasses.replace(cfg, zero=zero, infinity=inf)


def host_allowed(cfg: InfinityConfig, hw: Hardware) -> int:
    """The host memory budget (per rank) as given, else HOST_BUDGET_FRACTION of MemAvailable
    shared by the ranks on this machine."""
    given = cfg.infinity.host_memory_budget
    if given is not None:
        return given
    return int(HOST_BUDGET_FRACTION * hw.host_available_bytes) // max(1, hw.ranks_per_node)


def pool_in_host_budget(cfg: InfinityConfig, hw: Hardware) -> bool:
    """CPU-only without a device budget: the planner's device pool is paid from the host budget."""
    return not hw.has_gpu and cfg.infinity.device_memory_budget is None


def slot_bytes_per_elem(lay: Placement) -> int:
    """Bytes per element of one optimizer swap slot: the NVMe-homed states of a sub-group."""
    tensors = 0
    if lay.master_tier == Tier.NVME:
        tensors += 1
    if lay.opt_tier == Tier.NVME:
        tensors += 2  # m, v
    if lay.grads_tier == Tier.NVME or (lay.early_step and tensors and lay.opt_tier == Tier.NVME):
        tensors += 1  # the gradient is swapped, or staged in the slot by the early step
    return 4 * tensors


def device_gradient_bytes(layouts: Iterable[tuple[int, int]], world_size: int, stage: int,
                          gpu: bool, buffers: int = DEVICE_GRAD_BUFFERS, itemsize: int = 4) -> int:
    """Device bytes of the ``buffers`` kept buffers gradients are reduced in (see [Note:
    gradients reduced on the device] in optim/device_gradients.py), for units whose flat
    buffers are laid out as ``layouts``: each unit's (flat numel, trainable numel) as
    ``unit_layout_bound`` gives them in the compute dtype, every store padded to 4 KiB and every
    parameter to PARAM_ALIGN_BYTES. The one count of these bytes: ``derive_sizes`` chooses two
    buffers or one and leaves the prefetch room by it, ``engine_sizes`` reserves it (and the dry
    run and ``infinity plan`` show it), so the number chosen is the number reserved.

    It is what the optimizer's pool allocates (optim/device_gradients.py ``pool_buffer_numel``),
    bounded: a buffer holds the largest unit's collected gradient -- every shard of its flat
    buffer, ``world_size * shard_numel(flat numel)``, at stages 1-3; its trainable range at
    stage 0 -- and, when scattered, its own shard behind it, in ``itemsize``-byte elements (the
    communication dtype). ``unit_layout_bound`` rounds every parameter up to its alignment and
    puts the trainable ones first, as the runtime's ``flat_layout`` does (Unit sorts them so),
    so each runtime flat numel and trainable numel is at most the bound, and ``shard_numel``
    only grows with its argument: the pool's buffers are never larger than this count. None with
    one rank or on a CPU device (the host path)."""
    if world_size <= 1 or not gpu:
        return 0
    if stage >= 1:
        shards = (shard_numel(numel, world_size) for numel, _ in layouts)
        per_buffer = max((world_size * shard + shard for shard in shards), default=0)
    else:
        per_buffer = max((trainable for _, trainable in layouts), default=0)
    return buffers * per_buffer * itemsize


@functools.lru_cache(maxsize=64)       # a target plan asks the same stats for every rung
def counted_units(stats: ModelStats) -> tuple[tuple[tuple[int, bool], ...], ...]:
    """The units of a model known by its counts, as (numel, trainable) parameters: one entry
    per parameter where ``stats`` lists every parameter unit by unit (``from_module``,
    ``llama_stats``: ``param_numels`` in the order of ``unit_numels``), so each unit's padded
    layout (``unit_layout_bound``: every parameter on PARAM_ALIGN_BYTES) is the engine's; else
    one entry per unit. The frozen elements are taken from the first units' parameters. What
    ``derive_sizes`` and the run plan size a model by when its units are not given."""
    frozen = stats.total_params - stats.trainable_params
    units = []
    for params in _unit_params(stats):
        out = []
        for numel in params:
            take = min(frozen, numel)
            frozen -= take
            out += [(numel - take, True), (take, False)] if take else [(numel, True)]
        units.append(tuple(out))
    return tuple(units)


def _unit_params(stats: ModelStats) -> list[list[int]]:
    """Each unit's parameter sizes: ``param_numels`` cut at the ``unit_numels`` where they add
    up to them unit by unit, else one parameter a unit."""
    sizes = stats.units()
    numels = stats.param_numels
    if stats.unit_numels is not None and numels is not None and sum(numels) == sum(sizes):
        cut: list[list[int]] = []
        it = iter(numels)
        for size in sizes:
            params, held = [], 0
            while held < size:
                numel = next(it, None)
                if numel is None:
                    break
                params.append(numel)
                held += numel
            if held != size:
                break
            cut.append(params)
        else:
            return cut
    return [[numel] for numel in sizes]


def fetched_unit_bytes(layouts: Iterable[tuple[int, int]], world_size: int, stage: int,
                       itemsize: int) -> int:
    """Device bytes of the largest unit's flat buffer while it is fetched, for units laid out as
    ``layouts`` (each unit's (flat numel, trainable numel) as ``unit_layout_bound`` gives them in
    the compute dtype of ``itemsize`` bytes): what ``Unit.nbytes`` reserves in the device budget
    at a fetch (zero/unit.py, through the device cache), ``shards * shard_numel(flat numel)``
    elements, the shards being the world size at stages 1-3 (see [Note: shards]) and one at
    stage 0. The one count of a fetched unit for ``device_working`` (the derived sizes' room,
    ``infinity plan``'s device row, ``rank_memory``).

    An upper bound where it cannot be exact: ``unit_layout_bound`` rounds every parameter up to
    PARAM_ALIGN_BYTES and puts the trainable ones first, as ``flat_layout`` lays out the
    runtime's units (whose order of param groups it does not know), so each runtime flat numel
    is at most the bound's, and ``shard_numel`` only grows with its argument: no fetch reserves
    more than this. Equal where the units are given parameter by parameter in the engine's
    order (the engine's own plan). Counted from the element counts alone (as before), a
    unit's 4 KiB and 64-byte padding was left out: units of a few hundred elements reserve
    4 KiB each, more than twice their elements."""
    shards = world_size if stage >= 1 else 1
    return itemsize * max((shards * shard_numel(numel, shards) for numel, _ in layouts),
                          default=0)


def prefetch_bytes(prefetch: int, unit_numels: Iterable[int], world_size: int, stage: int,
                   itemsize: int) -> int:
    """Device bytes at most held by the units a prefetch bucket of ``prefetch`` elements lets
    the coordinator fetch ahead (``choose_prefetch`` in zero/prefetch.py), for units of
    ``unit_numels`` elements (their parameters' sum) in the compute dtype of ``itemsize`` bytes.

    The coordinator adds units while their ``Unit.numel`` (the padded flat numel) sum to at most
    the bucket, and each holds ``Unit.nbytes``: ``itemsize`` times its numel with one rank (or
    at stage 0), where the sum is the bound; with several ranks its shards add at most
    ``world_size * SHARD_ALIGN_NUMEL`` elements of padding a unit
    (``shard_numel``), for as many units as fit the bucket -- no more than the smallest units
    padded to 4 KiB (what a flat numel is at least) whose numels sum to the bucket. (A unit
    larger than the bucket is still fetched ahead when nothing else is: into free room only,
    and cancelled when a fetch needs it, so never a refusal; not counted here, as before.)"""
    if prefetch <= 0:
        return 0
    nbytes = itemsize * prefetch
    shards = world_size if stage >= 1 else 1
    if shards <= 1:
        return nbytes
    fit = held = 0
    for least in sorted(padded_numel(max(numel, 1), itemsize) for numel in unit_numels):
        if held + least > prefetch:
            break
        held += least
        fit += 1
    return nbytes + fit * shards * SHARD_ALIGN_NUMEL * itemsize


def persistent_unit_bytes(layouts: Iterable[tuple[int, int]], threshold: int, world_size: int,
                          stage: int, itemsize: int) -> int:
    """Device bytes of the units that stay on the device at stage 3: as ``engine.wiring``
    decides it, a unit whose layout's numel is at most ``threshold`` (the whole unit: the unit
    is what a fetch moves, so a small parameter inside a large unit is fetched with it), each
    holding its whole flat buffer, every shard with its padding (``Unit.nbytes``). ``layouts``:
    each unit's (flat numel, trainable numel), ``unit_layout_bound``'s. None below stage 3."""
    if stage != 3:
        return 0
    return sum(world_size * shard_numel(numel, world_size) * itemsize
               for numel, _ in layouts if numel <= threshold)


def device_working(lay: Placement, unit_bytes: int, prefetch_device: int, persist: int,
                   bucket: int) -> int:
    """Device bytes beyond the resident states: at stage 3 the fetched unit (``unit_bytes``: the
    largest unit's flat buffer as a fetch reserves it, ``fetched_unit_bytes``), the prefetched
    units (``prefetch_device``: ``prefetch_bytes`` of the bucket), the persistent units
    (``persist`` bytes, ``persistent_unit_bytes``) and the unit's gradients in backward (autograd's, one tensor a parameter: at most
    the unit's flat buffer, so counted as ``unit_bytes``); below stage 3, where gradients are
    not kept on the device, a unit's gradients and a reduce bucket of ``bucket`` elements."""
    if lay.stage == 3:
        return unit_bytes + prefetch_device + persist + unit_bytes
    return 0 if lay.grads_tier == Tier.DEVICE else unit_bytes + lay.c * bucket


def layout_slack(stats: ModelStats, world_size: int = 1) -> int:
    """Bytes the flat layout adds to the element counts on the device: each parameter starts
    on PARAM_ALIGN_BYTES (64), and each unit's stores are padded to 4 KiB with one rank, and
    to a whole shard of SHARD_ALIGN_NUMEL elements per rank with several (a unit's flat buffer
    covers ``world_size`` equal shards: at stage 1 or 2 the device holds it whole), in up to 5
    fp32-sized states (parameters, gradients, m, v, master). Small next to a real model; most
    of a tiny one (whose units at 3 ranks did not fit a budget counted with 4 KiB a unit)."""
    n_params = len(stats.param_numels) if stats.param_numels else 16 * stats.n_units
    per_unit = ALIGN_BYTES if world_size == 1 else world_size * SHARD_ALIGN_NUMEL * DTYPE_BYTES["fp32"]
    return 5 * (stats.n_units * per_unit + n_params * PARAM_ALIGN_BYTES)


def derive_sizes(cfg: InfinityConfig, stats: ModelStats, hw: Hardware, *,
                 units: Sequence[Sequence[tuple[int, bool]]] | None = None) -> DerivedSizes:
    """Resolve every size of ``cfg`` for this model on this machine (see the module docstring).

    ``units``: each unit's (numel, trainable) parameters, in the order the engine lays them out
    (the device gradient buffers are counted from their padded layouts, as the engine reserves
    them); None: the units ``stats`` describes (``counted_units``), as the run plan takes a
    model known by its counts."""
    lay = place(cfg, stats, hw)
    z, c, unit = cfg.zero, lay.c, stats.largest_unit_params
    resident_device = sum(b for (_, tier), b in resident_bytes(lay).items() if tier == Tier.DEVICE)
    unit_cap = _round_up(max(unit, 1), ALIGN_ELEMS)

    threshold = (z.stage3_param_persistence_threshold if z.stage3_param_persistence_threshold
                 is not None else PERSISTENCE_THRESHOLD)
    # Counted from the units' padded layouts, as the engine lays them out: a fetch, a prefetch,
    # the persistent units and the gradient buffers reserve these bytes, not the element counts'
    params_of = counted_units(stats) if units is None else units
    layouts = [unit_layout_bound(params, c) for params in params_of]

    def persistent(below: int) -> int:
        return persistent_unit_bytes(layouts, below, cfg.world_size, z.stage, c)
    allowed = host_allowed(cfg, hw)
    device_budget = cfg.infinity.device_memory_budget
    if device_budget is None:
        if hw.has_gpu:
            device_budget = hw.gpu_free_bytes or 0
        else:  # CPU-only: the emulated device gets what the working set needs, within a share
            persist_guess = persistent(threshold)
            prefetch_guess = PREFETCH_UNITS * unit if z.stage == 3 else 0
            # (in elements: layout_slack below adds the padding, for every unit at once)
            least, wanted = (resident_device + device_working(lay, c * unit, c * p, persist_guess,
                                                              unit_cap)
                             for p in (0, prefetch_guess))
            device_budget = max(least, min(wanted, int(EMULATED_DEVICE_SHARE * allowed)))
            device_budget += layout_slack(stats, cfg.world_size)
    host_budget = allowed
    if pool_in_host_budget(cfg, hw):
        host_budget = max(0, allowed - device_budget)  # the emulated device is host RAM too

    if z.stage3_param_persistence_threshold is None:
        fits = persistent(PERSISTENCE_THRESHOLD) <= PERSISTENT_SHARE * device_budget
        threshold = PERSISTENCE_THRESHOLD if fits else 0
    persist = persistent(threshold)
    prefetch = z.stage3_prefetch_bucket_size
    if prefetch is not None:
        # more than the model holds prefetches nothing more (DeepSpeed configs say 1e9, 1e12),
        # but would size a fetch slot per unit of it out of the host budget
        prefetch = min(prefetch, stats.total_params)
    # the device gradient buffers: two where they fit beside what a fetched unit needs and (at
    # stage 3) one unit fetched ahead of it, else one. A second buffer only hides the copy out
    # of a unit's shard (1/N of its gradient) behind the next unit's backward; the unit
    # fetched ahead hides its whole NVMe read, copy in and gather behind compute, so it goes
    # first (1T on 8 x 80 GB: two bf16 buffers of a block, 32.7 GiB, left 0.87B elements of
    # prefetch and no copy in overlapped compute; one leaves 9.6B). A prefetch bucket the user
    # set is what is fetched ahead: the buffers fit beside it, or the plan says they do not.
    # the largest padded flat numel: the coordinator counts the prefetch bucket and the live
    # limit in these numels
    largest_numel = max((n for n, _ in layouts), default=0)
    unit_numels = [sum(numel for numel, _ in params) for params in params_of]
    fetch_layouts = layouts
    if units is None and stats.trainable_params < stats.total_params:
        # counts do not tell which parameters are frozen (counted_units takes them from the first
        # units): a unit's trainable range is padded to 4 KiB of fp32 before its frozen ones
        # ([Note: flat layout]), at most ALIGN_ELEMS - 1 more elements in any unit
        fetch_layouts = [unit_layout_bound(tuple(params) + ((ALIGN_ELEMS - 1, False),), c)
                         for params in params_of]
    fetched = fetched_unit_bytes(fetch_layouts, cfg.world_size, z.stage, c)

    def prefetched(elements: int) -> int:
        return prefetch_bytes(elements, unit_numels, cfg.world_size, z.stage, c)

    room = device_budget - resident_device - device_working(lay, fetched, 0, persist, 0)
    ahead = (fetched if prefetch is None else prefetched(prefetch)) if z.stage == 3 else 0
    # in the communication dtype: DeepSpeed's unset one is the gradients' own, the compute
    # dtype (the config refused the pairs that make no sense: config/precision.py; a GPU
    # resolves the compute dtype as the config declares it)
    grad_dtype = cfg.communication_data_type or lay.compute_dtype
    grad_itemsize = DTYPE_BYTES[grad_dtype]
    grad_buffers = DEVICE_GRAD_BUFFERS
    if device_gradient_bytes(layouts, cfg.world_size, z.stage, hw.has_gpu, grad_buffers,
                             grad_itemsize) > room - ahead:
        grad_buffers = 1
    device_grads = device_gradient_bytes(layouts, cfg.world_size, z.stage, hw.has_gpu,
                                         grad_buffers, grad_itemsize)
    crowded = ""
    # (no gradient buffers on the device -- a CPU's -- nothing to crowd: a DeepSpeed-sized
    # bucket there warned of "0 B" needed, to be mended by raising the budget "by 0 B")
    if prefetch is not None and z.stage == 3 and 0 < device_grads and device_grads > room - ahead:
        crowded = _prefetch_crowds_gradients(prefetch, c, room, device_grads, grad_buffers,
                                             grad_dtype, prefetched)

    bucket_cap = max(ALIGN_ELEMS, int(REDUCE_BUCKET_SHARE * device_budget) // c)
    reduce_bucket = z.reduce_bucket_size or min(unit_cap, bucket_cap)
    allgather_bucket = z.allgather_bucket_size or min(unit_cap, bucket_cap)

    if prefetch is None:
        # PREFETCH_UNITS of the largest unit as the coordinator counts the bucket (its padded
        # flat numel: the raw count fell short of the second unit), within the bytes left
        prefetch = prefetch_within(PREFETCH_UNITS * largest_numel, room - device_grads, c,
                                    prefetched) if z.stage == 3 else 0
    max_live = z.stage3_max_live_parameters
    # the live limit in the coordinator's numels too (the fetched unit's padded flat numel):
    # from the raw count the fetched unit and a full bucket were a few elements over it
    max_live = largest_numel + prefetch if max_live is None else max_live
    reuse = z.stage3_max_reuse_distance
    reuse = prefetch if reuse is None else reuse

    opt = z.offload_optimizer
    buffer_count = opt.buffer_count or DEFAULT_BUFFER_COUNT
    sub_group = z.sub_group_size
    if sub_group is None:
        # a rank steps its shard of each unit (stages 1-3): a sub-group larger than the largest
        # shard buys nothing but slots (a 1T model's 7.7B-element unit at 8 ranks: 961M)
        unit_share = shard_numel(unit, cfg.world_size) if z.stage >= 1 else unit
        sub_group = min(_round_up(max(unit_share, 1), SUB_GROUP_ROUND),
                        _round_up(max(lay.opt_elems, 1), ALIGN_ELEMS))
        slot = slot_bytes_per_elem(lay) or 16
        if slot_bytes_per_elem(lay):
            fit = _round_down(int(OPTIMIZER_BUFFER_SHARE * host_budget) // (buffer_count * slot), ALIGN_ELEMS)
            sub_group = max(ALIGN_ELEMS, min(sub_group, fit))
    buffer_size = opt.buffer_size or sub_group

    par = z.offload_param
    shard_unit = -(-unit // cfg.world_size) if z.stage == 3 else unit
    param_buffer_size = par.buffer_size or _round_up(max(shard_unit, 1), ALIGN_ELEMS)
    # the units the bucket holds, in the numels it counts them by (padded, as the prefetch)
    param_buffer_count = par.buffer_count or (2 + math.ceil(prefetch / largest_numel)
                                              if unit and largest_numel else 3)
    return DerivedSizes(
        sub_group_size=sub_group, buffer_count=buffer_count, buffer_size=buffer_size,
        param_buffer_count=param_buffer_count, param_buffer_size=param_buffer_size,
        max_in_cpu=par.max_in_cpu or 0, prefetch_bucket_size=prefetch,
        max_live_parameters=max_live, max_reuse_distance=reuse, persistence_threshold=threshold,
        reduce_bucket_size=reduce_bucket, allgather_bucket_size=allgather_bucket,
        host_budget_bytes=host_budget, device_budget_bytes=device_budget,
        compute_dtype=lay.compute_dtype, early_step=lay.early_step,  # type: ignore[arg-type]
        device_grad_buffers=grad_buffers, device_grad_dtype=grad_dtype,  # type: ignore[arg-type]
        device_grad_bytes=device_grads, device_room_warning=crowded,
        persistent_device_bytes=persist,
        unit_device_bytes=fetched, prefetch_device_bytes=prefetched(prefetch) if z.stage == 3 else 0)


def prefetch_within(wanted: int, free: int, itemsize: int,
                     prefetched: Callable[[int], int]) -> int:
    """A prefetch bucket of at most ``wanted`` elements whose ``prefetched`` bytes
    (``prefetch_bytes``: the elements and, with several ranks, their units' shard padding) fit
    in ``free`` bytes: ``free`` in elements, lowered by the excess bytes until they fit (the
    elements alone with one rank)."""
    prefetch = max(0, min(wanted, free // itemsize))
    while prefetch and prefetched(prefetch) > free:      # each pass drops the excess at least
        prefetch = max(0, prefetch - -(-(prefetched(prefetch) - free) // itemsize))
    return prefetch


def _prefetch_crowds_gradients(prefetch: int, itemsize: int, room: int, device_grads: int,
                               buffers: int, grad_dtype: str,
                               prefetched: Callable[[int], int]) -> str:
    """The planner's warning for a ``stage3_prefetch_bucket_size`` the user set that leaves
    the device budget too little room for the gradient buffers (``room``: the budget's bytes
    beside the resident states and a fetched unit; ``device_grads``: the ``buffers`` buffers'
    bytes; ``prefetched``: a bucket's bytes, ``prefetch_bytes``): the numbers, and the prefetch
    that would fit (or the budget's shortfall)."""
    fits = prefetch_within(prefetch, room - device_grads, itemsize, prefetched)
    left = max(0, room - prefetched(prefetch))
    fix = (f"lower stage3_prefetch_bucket_size to at most {fits:,} elements (or \"auto\"), or "
           f"raise infinity.device_memory_budget by {format_bytes(device_grads - left)}"
           if room >= device_grads else
           f"even with no prefetch they do not fit: raise infinity.device_memory_budget by "
           f"{format_bytes(device_grads - room)} (or set communication_data_type \"bf16\", "
           "or offload deeper)")
    return (f"zero_optimization.stage3_prefetch_bucket_size {prefetch:,} elements "
            f"({format_bytes(prefetched(prefetch))}) leaves {format_bytes(left)} of the device "
            f"budget beside the resident states and a fetched unit, but the gradients reduced "
            f"on the device need {format_bytes(device_grads)} ({buffers} {grad_dtype} "
            f"buffer{'s' if buffers > 1 else ''} of the largest unit's gradient): {fix}")
