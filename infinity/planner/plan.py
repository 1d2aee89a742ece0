"""Model size + hardware + config -> sizes and bytes per tier, before any memory is touched.

Pure functions, importable from any layer: the engine sizes its sub-groups, buffers and prefetch
from ``derive_sizes`` at start, and ``infinity plan`` prints ``plan_memory`` for a model that may
never fit on this machine. One place owns the byte math, so the two always agree.

Byte math (per rank; N = world size; P = parameters, T = trainable parameters):

* fp32 Adam states are 12 B per trainable parameter (master 4 + m 4 + v 4), sharded over N from
  stage 1; fp32 gradients add 4 B (sharded from stage 2); a 16-bit compute copy of the parameters
  adds 2 B (sharded at stage 3). Mixed precision: 18 B/param.
* When the compute dtype is fp32 and the compute copy can be fetched from where the master lives
  (same tier, or stage 3 on a CPU-only machine whose "device" is an emulated pool), the fp32
  master *is* the parameter and is stored once, in the deeper of the two tiers: 16 B/param with
  gradients, not the 20 B DeepSpeed keeps (see shared/peers/DS_E2E.md).
* With the early step (the optimizer steps a unit as soon as its gradient shard arrives) the
  gradients have no home at all; only one sub-group's staging buffer exists.

Assumptions are named constants below; activations and autograd temporaries are not modelled.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from infinity.config import InfinityConfig
from infinity.planner.inputs import (LLAMA_PRESETS, Hardware, ModelStats, detect_hardware,  # noqa: F401 (re-exported)
                                     llama_stats)
from infinity.base.sizes import format_bytes

__all__ = [
    "LLAMA_PRESETS", "ModelStats", "Hardware", "DerivedSizes", "Plan", "PlanItem",
    "detect_hardware", "derive_sizes", "plan_memory", "recommend_config", "llama_stats",
    "host_budget_fits", "minimum_host_budget",
]

Tier = Literal["device", "host", "nvme"]
TIERS: tuple[Tier, ...] = ("device", "host", "nvme")
COMPONENTS = ("params", "grads", "optimizer_states", "buffers")

# ---- assumptions (change them here, and the engine and `infinity plan` follow) ----------------
HOST_BUDGET_FRACTION = 0.8        # default host budget: this share of MemAvailable at start
OPTIMIZER_BUFFER_SHARE = 0.5      # share of the host budget the optimizer swap slots may take
DEFAULT_BUFFER_COUNT = 4          # read i+1 | step i | write i-1 | one spare
SUB_GROUP_ROUND = 1 << 20         # auto sub-groups: a multiple of 1 Mi elements (4 MiB of fp32) ...
MIN_SUB_GROUP = 1 << 20           # ... and at least this many unless the host budget forbids
ALIGN_ELEMS = 1024                # 4 KiB of fp32: O_DIRECT alignment of every extent
ALIGN_BYTES = 4 * ALIGN_ELEMS
PREFETCH_UNITS = 2                # prefetch about this many units ahead (within the device budget)
PERSISTENCE_THRESHOLD = 100_000   # params below this many elements stay on the device ...
PERSISTENT_SHARE = 0.05           # ... if they take at most this share of the device budget
REDUCE_BUCKET_SHARE = 1 / 8       # a gradient reduce bucket takes at most this share of the device
EMULATED_DEVICE_SHARE = 0.25      # CPU-only: the device pool's share of the host's budgeted memory
                                  # (prefetch shrinks first; the pool never drops below one unit)
RUNTIME_OVERHEAD_BYTES = 512 << 20  # Python + torch + native library resident set (measured ~0.3-0.5 GiB)
# nvme_path when recommending NVMe offload without one: the parent `infinity train` uses by default
# (infinity.train.defaults.DEFAULT_NVME_PATH; the engine makes its private swap directory inside),
# which exists on most systems; "/var/tmp/infinity-swap" did not, so the ds_config printed failed.
DEFAULT_SWAP_DIR = "/var/tmp"

_DEPTH = {"device": 0, "host": 1, "nvme": 2}
_TIER_OF_DEVICE = {"none": "device", "cpu": "host", "nvme": "nvme"}

def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _round_down(value: int, multiple: int) -> int:
    return value // multiple * multiple


# ----------------------------------------------------------------------------------------------
# Where each kind of state lives for a config on a machine.

@dataclass(frozen=True)
class _Layout:
    stage: int
    compute_dtype: str
    c: int                  # bytes per element of the compute dtype
    param_tier: Tier        # home of the compute copy of the parameters
    opt_tier: Tier          # home of m and v (and the master unless single_copy)
    single_copy: bool       # fp32 compute: the master is the parameter, stored once
    early_step: bool
    param_elems: int        # per rank
    opt_elems: int          # per rank
    grad_elems: int         # per rank

    @property
    def master_tier(self) -> Tier:
        return self.param_tier if self.single_copy else self.opt_tier

    @property
    def grads_tier(self) -> Tier | None:
        """Where the deferred schedule keeps gradients: as the engine does (engine_sizing),
        beside offloaded Adam states, and in host memory when the states stay on the device."""
        if self.early_step:
            return None
        return "host" if self.opt_tier == "device" else self.opt_tier


def _compute_dtype(cfg: InfinityConfig, hw: Hardware) -> str:
    if cfg.infinity.compute_dtype != "auto":
        return cfg.infinity.compute_dtype
    if not hw.has_gpu:
        return "fp32"  # bf16 matmuls are ~45x slower than fp32 on CPUs without AVX512-BF16
    return "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"


def _early_step(cfg: InfinityConfig, dtype: str) -> bool:
    if cfg.infinity.early_step != "auto":
        return cfg.infinity.early_step == "on"
    # "auto": only for the partitioned (offloaded) optimizer, and only when nothing needs all
    # gradients before the step: no clipping (global norm), no fp16 (overflow check), no accumulation.
    return (cfg.zero.offload_optimizer.device != "none" and cfg.gradient_clipping == 0
            and not cfg.fp16.enabled and dtype != "fp16" and cfg.gradient_accumulation_steps == 1)


def _layout(cfg: InfinityConfig, stats: ModelStats, hw: Hardware) -> _Layout:
    z, n = cfg.zero, cfg.world_size
    dtype = _compute_dtype(cfg, hw)
    opt_tier: Tier = _TIER_OF_DEVICE[z.offload_optimizer.device]  # type: ignore[assignment]
    param_tier: Tier = "device" if z.stage < 3 else _TIER_OF_DEVICE[z.offload_param.device]  # type: ignore[assignment]
    single = dtype == "fp32" and (param_tier == opt_tier or (not hw.has_gpu and z.stage == 3))
    if single:
        param_tier = max(param_tier, opt_tier, key=_DEPTH.__getitem__)
    shard = lambda elems, from_stage: -(-elems // n) if z.stage >= from_stage else elems  # noqa: E731
    return _Layout(stage=z.stage, compute_dtype=dtype, c=4 if dtype == "fp32" else 2,
                   param_tier=param_tier, opt_tier=opt_tier, single_copy=single,
                   early_step=_early_step(cfg, dtype),
                   param_elems=shard(stats.total_params, 3), opt_elems=shard(stats.trainable_params, 1),
                   grad_elems=shard(stats.trainable_params, 2))


def _resident(lay: _Layout) -> dict[tuple[str, Tier], int]:
    """Bytes of params, grads and optimizer states at their home tiers."""
    out: dict[tuple[str, Tier], int] = {}

    def add(component: str, tier: Tier | None, nbytes: int) -> None:
        if tier is not None and nbytes:
            out[(component, tier)] = out.get((component, tier), 0) + nbytes
    add("params", lay.param_tier, (4 if lay.single_copy else lay.c) * lay.param_elems)
    add("optimizer_states", lay.opt_tier, (8 if lay.single_copy else 12) * lay.opt_elems)
    add("grads", lay.grads_tier, 4 * lay.grad_elems)
    return out


# ----------------------------------------------------------------------------------------------
# Sizes derived from the budgets.

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
    """Parameters below this many elements stay on the device."""
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
        return dataclasses.replace(cfg, zero=zero, infinity=inf)


def _host_allowed(cfg: InfinityConfig, hw: Hardware) -> int:
    """The host memory budget as given, else HOST_BUDGET_FRACTION of MemAvailable."""
    given = cfg.infinity.host_memory_budget
    return int(HOST_BUDGET_FRACTION * hw.host_available_bytes) if given is None else given


def _pool_in_host_budget(cfg: InfinityConfig, hw: Hardware) -> bool:
    """CPU-only without a device budget: the planner's device pool is paid from the host budget."""
    return not hw.has_gpu and cfg.infinity.device_memory_budget is None


def _slot_bytes_per_elem(lay: _Layout) -> int:
    """Bytes per element of one optimizer swap slot: the NVMe-homed states of a sub-group."""
    tensors = 0
    if lay.master_tier == "nvme":
        tensors += 1
    if lay.opt_tier == "nvme":
        tensors += 2  # m, v
    if lay.grads_tier == "nvme" or (lay.early_step and tensors and lay.opt_tier == "nvme"):
        tensors += 1  # the gradient is swapped, or staged in the slot by the early step
    return 4 * tensors


def _device_working(lay: _Layout, unit: int, prefetch: int, persist: int, bucket: int) -> int:
    """Device bytes beyond the resident states: fetched units, persistent params, unit grads."""
    if lay.stage == 3:
        return lay.c * (unit + prefetch + persist) + lay.c * unit  # + the unit's grads in backward
    return 0 if lay.grads_tier == "device" else lay.c * (unit + bucket)


def _layout_slack(stats: ModelStats) -> int:
    """Bytes the flat layout adds to the element counts on the device: each unit's stores are
    padded to 4 KiB and each parameter starts on 64 bytes, in up to 5 fp32-sized states
    (parameters, gradients, m, v, master). Small next to a real model; most of a tiny one."""
    n_params = len(stats.param_numels) if stats.param_numels else 16 * stats.n_units
    return 5 * (stats.n_units * ALIGN_BYTES + n_params * 64)


def derive_sizes(cfg: InfinityConfig, stats: ModelStats, hw: Hardware) -> DerivedSizes:
    """Resolve every size of ``cfg`` for this model on this machine (see the module docstring)."""
    lay = _layout(cfg, stats, hw)
    z, c, unit = cfg.zero, lay.c, stats.largest_unit_params
    resident_device = sum(b for (_, tier), b in _resident(lay).items() if tier == "device")
    unit_cap = _round_up(max(unit, 1), ALIGN_ELEMS)

    threshold = (z.stage3_param_persistence_threshold if z.stage3_param_persistence_threshold
                 is not None else PERSISTENCE_THRESHOLD)
    allowed = _host_allowed(cfg, hw)
    device_budget = cfg.infinity.device_memory_budget
    if device_budget is None:
        if hw.has_gpu:
            device_budget = hw.gpu_free_bytes or 0
        else:  # CPU-only: the emulated device gets what the working set needs, within a share
            persist_guess = stats.persistent_elements(threshold) if z.stage == 3 else 0
            prefetch_guess = PREFETCH_UNITS * unit if z.stage == 3 else 0
            least, wanted = (resident_device + _device_working(lay, unit, p, persist_guess, unit_cap)
                             for p in (0, prefetch_guess))
            device_budget = max(least, min(wanted, int(EMULATED_DEVICE_SHARE * allowed)))
            device_budget += _layout_slack(stats)
    host_budget = allowed
    if _pool_in_host_budget(cfg, hw):
        host_budget = max(0, allowed - device_budget)  # the emulated device is host RAM too

    if z.stage3_param_persistence_threshold is None:
        fits = c * stats.persistent_elements(PERSISTENCE_THRESHOLD) <= PERSISTENT_SHARE * device_budget
        threshold = PERSISTENCE_THRESHOLD if fits else 0
    persist = stats.persistent_elements(threshold) if z.stage == 3 else 0

    bucket_cap = max(ALIGN_ELEMS, int(REDUCE_BUCKET_SHARE * device_budget) // c)
    reduce_bucket = z.reduce_bucket_size or min(unit_cap, bucket_cap)
    allgather_bucket = z.allgather_bucket_size or min(unit_cap, bucket_cap)

    prefetch = z.stage3_prefetch_bucket_size
    if prefetch is not None:
        # more than the model holds prefetches nothing more (DeepSpeed configs say 1e9, 1e12),
        # but would size a fetch slot per unit of it out of the host budget
        prefetch = min(prefetch, stats.total_params)
    if prefetch is None:
        if z.stage == 3:
            free = device_budget - resident_device - _device_working(lay, unit, 0, persist, 0)
            prefetch = max(0, min(PREFETCH_UNITS * unit, free // c))
        else:
            prefetch = 0
    max_live = z.stage3_max_live_parameters
    max_live = unit + prefetch if max_live is None else max_live
    reuse = z.stage3_max_reuse_distance
    reuse = prefetch if reuse is None else reuse

    opt = z.offload_optimizer
    buffer_count = opt.buffer_count or DEFAULT_BUFFER_COUNT
    sub_group = z.sub_group_size
    if sub_group is None:
        sub_group = min(_round_up(max(unit, 1), SUB_GROUP_ROUND), _round_up(max(lay.opt_elems, 1), ALIGN_ELEMS))
        slot = _slot_bytes_per_elem(lay) or 16
        if _slot_bytes_per_elem(lay):
            fit = _round_down(int(OPTIMIZER_BUFFER_SHARE * host_budget) // (buffer_count * slot), ALIGN_ELEMS)
            sub_group = max(ALIGN_ELEMS, min(sub_group, fit))
    buffer_size = opt.buffer_size or sub_group

    par = z.offload_param
    shard_unit = -(-unit // cfg.world_size) if z.stage == 3 else unit
    param_buffer_size = par.buffer_size or _round_up(max(shard_unit, 1), ALIGN_ELEMS)
    param_buffer_count = par.buffer_count or (2 + math.ceil(prefetch / unit) if unit else 3)
    return DerivedSizes(
        sub_group_size=sub_group, buffer_count=buffer_count, buffer_size=buffer_size,
        param_buffer_count=param_buffer_count, param_buffer_size=param_buffer_size,
        max_in_cpu=par.max_in_cpu or 0, prefetch_bucket_size=prefetch,
        max_live_parameters=max_live, max_reuse_distance=reuse, persistence_threshold=threshold,
        reduce_bucket_size=reduce_bucket, allgather_bucket_size=allgather_bucket,
        host_budget_bytes=host_budget, device_budget_bytes=device_budget,
        compute_dtype=lay.compute_dtype, early_step=lay.early_step)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# The plan: bytes per tier, warnings, and a printable table.

@dataclass(frozen=True)
class PlanItem:
    """Bytes of one component at one tier, what they are, and the setting that makes them smaller."""

    component: str
    tier: Tier
    nbytes: int
    note: str
    fix: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Predicted memory per tier for a config, model and machine (per rank)."""

    config: InfinityConfig
    """The config with every derived size written in."""
    stats: ModelStats
    hardware: Hardware
    sizes: DerivedSizes
    items: tuple[PlanItem, ...]
    peak_host_rss_bytes: int
    """Host tier + host buffers + the emulated device (CPU-only) + runtime; no activations."""
    nvme_read_bytes_per_step: int
    nvme_write_bytes_per_step: int
    warnings: tuple[str, ...]
    """Things that will not fit, each with the setting to change."""
    notes: tuple[str, ...]
    """Choices and assumptions worth knowing."""

    def bytes(self, component: str | None = None, tier: Tier | None = None) -> int:
        """Bytes of a component and/or at a tier (both None: everything)."""
        return sum(i.nbytes for i in self.items
                   if (component is None or i.component == component) and (tier is None or i.tier == tier))

    @property
    def fits(self) -> bool:
        """No tier exceeds its budget and the host RSS fits in MemAvailable."""
        return not self.warnings

    def table(self) -> dict[str, dict[str, int]]:
        """component -> tier -> bytes, every cell present."""
        return {comp: {tier: self.bytes(comp, tier) for tier in TIERS} for comp in COMPONENTS}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``infinity plan --json``)."""
        return {
            "fits": self.fits, "table_bytes": self.table(),
            "total_bytes": {tier: self.bytes(tier=tier) for tier in TIERS},
            "budget_bytes": {"device": self.sizes.device_budget_bytes, "host": self.sizes.host_budget_bytes,
                             "nvme": self.hardware.disk_free_bytes},
            "peak_host_rss_bytes": self.peak_host_rss_bytes,
            "nvme_bytes_per_step": {"read": self.nvme_read_bytes_per_step,
                                    "write": self.nvme_write_bytes_per_step},
            "items": [dataclasses.asdict(i) for i in self.items],
            "sizes": dataclasses.asdict(self.sizes),
            "model": {k: v for k, v in dataclasses.asdict(self.stats).items() if k != "param_numels"},
            "hardware": dataclasses.asdict(self.hardware),
            "warnings": list(self.warnings), "notes": list(self.notes),
            "ds_config": self.config.to_dict(),
        }

    def render(self) -> str:
        """A text table for people."""
        s, hw, z, sz = self.stats, self.hardware, self.config.zero, self.sizes
        gpu = (f"GPU {hw.gpu_name} {format_bytes(hw.gpu_free_bytes or 0)} free of "
               f"{format_bytes(hw.gpu_total_bytes or 0)}") if hw.has_gpu else \
            "no GPU (the device is a pool in host RAM)"
        disk = "" if hw.disk_free_bytes is None else \
            f", {format_bytes(hw.disk_free_bytes)} free at {hw.nvme_path}"
        lines = [
            f"model     {_count(s.total_params)} params ({_count(s.trainable_params)} trainable), "
            f"{s.n_units} units, largest unit {_count(s.largest_unit_params)}",
            f"machine   {hw.cpu_cores} cores, host {format_bytes(hw.host_available_bytes)} available of "
            f"{format_bytes(hw.host_total_bytes)}, {gpu}{disk}",
            f"config    ZeRO stage {z.stage}, offload_param {z.offload_param.device}, offload_optimizer "
            f"{z.offload_optimizer.device}, compute {sz.compute_dtype}, early step "
            f"{'on' if sz.early_step else 'off'}, world size {self.config.world_size} (bytes per rank)",
            "",
            f"{'':18}{'device':>14}{'host':>14}{'nvme':>14}",
        ]
        for comp, row in self.table().items():
            lines.append(f"{comp.replace('_', ' '):18}" + "".join(f"{_cell(row[t]):>14}" for t in TIERS))
        lines.append(f"{'total':18}" + "".join(f"{_cell(self.bytes(tier=t)):>14}" for t in TIERS))
        budgets = (sz.device_budget_bytes, sz.host_budget_bytes, hw.disk_free_bytes)
        lines.append(f"{'budget':18}" + "".join(
            f"{'-' if b is None else format_bytes(b):>14}" for b in budgets))
        lines += [
            "",
            f"predicted peak host RSS {format_bytes(self.peak_host_rss_bytes)} "
            f"(activations not included); NVMe traffic per step: read "
            f"{format_bytes(self.nvme_read_bytes_per_step)}, write {format_bytes(self.nvme_write_bytes_per_step)}",
            f"sizes     sub_group_size {sz.sub_group_size:,} x {sz.buffer_count} slots; param slots "
            f"{sz.param_buffer_count} x {sz.param_buffer_size:,}; prefetch {sz.prefetch_bucket_size:,}; "
            f"max live {sz.max_live_parameters:,}; persistence threshold {sz.persistence_threshold:,}; "
            f"reduce bucket {sz.reduce_bucket_size:,} (elements)",
            "",
            "details:",
        ]
        lines += [f"  {i.tier:6} {format_bytes(i.nbytes):>12}  {i.component}: {i.note}" for i in self.items]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"WARNING: {w}" for w in self.warnings] or ["fits: every tier is within its budget"]
        return "\n".join(lines)


def _cell(nbytes: int) -> str:
    return "-" if nbytes == 0 else format_bytes(nbytes)


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


_FIXES = {  # (component, tier) -> the setting that moves it deeper
    ("optimizer_states", "host"): "set offload_optimizer.device nvme",
    ("params", "host"): "set offload_param.device nvme",
    ("grads", "host"): "set offload_optimizer.device nvme, or allow the early step (no clipping, "
                       "no fp16, no gradient accumulation)",
    ("optimizer_states", "device"): "set offload_optimizer.device cpu (ZeRO stage >= 1)",
    ("grads", "device"): "set offload_optimizer.device cpu (gradients follow the optimizer)",
    ("params", "device"): "set ZeRO stage 3 with offload_param.device cpu",
}
_FIX_OPT_SLOTS = "set a smaller zero_optimization.sub_group_size or offload_optimizer.buffer_count (or \"auto\")"
_FIX_PARAM_SLOTS = "set a smaller offload_param.buffer_count or buffer_size (or \"auto\")"
_FIX_DEVICE_WORK = ("set a smaller stage3_prefetch_bucket_size / reduce_bucket_size, or a device budget "
                    "that holds at least two units")


def plan_memory(cfg: InfinityConfig, stats: ModelStats, hw: Hardware) -> Plan:
    """Bytes per tier of params, grads, optimizer states and buffers, with warnings."""
    lay = _layout(cfg, stats, hw)
    sz = derive_sizes(cfg, stats, hw)
    items: list[PlanItem] = []
    names = {"params": "parameters", "grads": "gradients", "optimizer_states": "optimizer states"}
    for (comp, tier), nbytes in _resident(lay).items():
        if comp == "params":
            note = ("fp32, also the optimizer's master (one copy)" if lay.single_copy
                    else f"{lay.compute_dtype} compute copy")
        elif comp == "optimizer_states":
            note = "Adam m, v (fp32)" if lay.single_copy else "fp32 master, Adam m, v"
        else:
            note = "fp32, kept until the step"
        fix = _FIXES.get((comp, tier), "")
        if (comp, tier) == ("params", "device") and lay.stage == 3:
            fix = "set offload_param.device cpu"
        items.append(PlanItem(comp, tier, nbytes, note, fix))

    slot = _slot_bytes_per_elem(lay)
    if slot:
        items.append(PlanItem("buffers", "host", sz.buffer_count * sz.buffer_size * slot,
                              f"{sz.buffer_count} optimizer swap slots of {sz.buffer_size:,} elements x {slot} B",
                              _FIX_OPT_SLOTS))
    elif lay.early_step and lay.opt_tier == "host":
        items.append(PlanItem("buffers", "host", 4 * stats.largest_unit_params,
                              "fp32 gradient staging of one unit for the early step",
                              "set offload_optimizer.device nvme"))
    if lay.param_tier == "nvme":
        pbytes = 4 if lay.single_copy else lay.c
        items.append(PlanItem("buffers", "host", sz.param_buffer_count * sz.param_buffer_size * pbytes,
                              f"{sz.param_buffer_count} parameter swap slots of {sz.param_buffer_size:,} elements",
                              _FIX_PARAM_SLOTS))
        if sz.max_in_cpu:
            items.append(PlanItem("buffers", "host", sz.max_in_cpu * pbytes, "max_in_cpu parameter cache",
                                  "set a smaller offload_param.max_in_cpu"))
    persist = stats.persistent_elements(sz.persistence_threshold) if lay.stage == 3 else 0
    working = _device_working(lay, stats.largest_unit_params, sz.prefetch_bucket_size, persist,
                              sz.reduce_bucket_size)
    if working:
        note = (f"fetched units ({stats.largest_unit_params:,} + {sz.prefetch_bucket_size:,} prefetched "
                f"elements), {persist:,} persistent, one unit's gradients" if lay.stage == 3
                else "one unit's gradients and a reduce bucket")
        items.append(PlanItem("buffers", "device", working, note, _FIX_DEVICE_WORK))

    host = sum(i.nbytes for i in items if i.tier == "host")
    device = sum(i.nbytes for i in items if i.tier == "device")
    nvme = sum(i.nbytes for i in items if i.tier == "nvme")
    rss = host + (0 if hw.has_gpu else device) + RUNTIME_OVERHEAD_BYTES

    reads = writes = 0
    for i in items:
        if i.tier == "nvme" and i.component in ("optimizer_states", "grads"):
            reads += i.nbytes
            writes += i.nbytes
    if lay.param_tier == "nvme":
        pbytes = (4 if lay.single_copy else lay.c) * lay.param_elems
        reads += 2 * pbytes                  # fetched in forward and again in backward
        writes += pbytes if lay.single_copy else lay.c * lay.opt_elems  # master / updated 16-bit copy
        if lay.single_copy and lay.opt_tier != "nvme":
            reads += 4 * lay.opt_elems       # the master is read for the step, besides the fetches

    warnings: list[str] = []
    for tier, used, budget in (("host", host, sz.host_budget_bytes), ("device", device, sz.device_budget_bytes)):
        if used <= budget:
            continue
        worst = max((i for i in items if i.tier == tier), key=lambda i: i.nbytes)
        what = names.get(worst.component) or f"buffers ({worst.note})"
        total = "" if worst.nbytes == used else f" (the {tier} tier holds {format_bytes(used)} in all)"
        warnings.append(f"{what} need {format_bytes(worst.nbytes)} on {tier}{total} but the {tier} "
                        f"budget is {format_bytes(budget)}: {worst.fix}")
    allowed = _host_allowed(cfg, hw)
    if _pool_in_host_budget(cfg, hw) and host + device > allowed:
        worst = max((i for i in items if i.tier == "device"), key=lambda i: i.nbytes)
        what = names.get(worst.component) or f"buffers ({worst.note})"
        warnings.append(f"{what} need {format_bytes(worst.nbytes)} in the device pool, which is host "
                        f"memory on this CPU-only machine: host tier and device pool need "
                        f"{format_bytes(host + device)} but the host memory budget is "
                        f"{format_bytes(allowed)}: {worst.fix}")
    if hw.disk_free_bytes is not None and nvme > hw.disk_free_bytes:
        warnings.append(f"swap files need {format_bytes(nvme)} but {hw.nvme_path} has "
                        f"{format_bytes(hw.disk_free_bytes)} free: free space or choose another nvme_path")
    if rss > hw.host_available_bytes:
        warnings.append(f"predicted peak host RSS {format_bytes(rss)} exceeds the available "
                        f"{format_bytes(hw.host_available_bytes)}: offload deeper (stage 3, nvme)")
    notes: list[str] = []
    if slot and cfg.zero.sub_group_size is None and sz.sub_group_size < min(MIN_SUB_GROUP, lay.opt_elems):
        # slow, not a failure: initialize trains this (the plan said "does not fit")
        notes.append(f"slow: the host budget {format_bytes(sz.host_budget_bytes)} allows only "
                     f"{sz.sub_group_size:,}-element sub-groups (under {MIN_SUB_GROUP:,}): NVMe "
                     "transfers will be small and slow; raise infinity.host_memory_budget")
    if cfg.infinity.compute_dtype == "auto" and not hw.has_gpu and (cfg.bf16.enabled or cfg.fp16.enabled):
        notes.append("compute dtype fp32 on this CPU-only machine (16-bit matmuls are far slower "
                     "here); set infinity.compute_dtype to force 16-bit")
    if lay.single_copy:
        notes.append(f"fp32 compute: parameters are the optimizer's master, stored once on {lay.param_tier}")
    if lay.early_step:
        notes.append("early step: each unit is stepped as its gradients arrive, gradients have no home")
    if not hw.has_gpu and cfg.infinity.device_memory_budget is None:
        notes.append(f"device budget {format_bytes(sz.device_budget_bytes)} chosen for the working set "
                     "and taken from the host memory")
    if stats.param_numels is None and lay.stage == 3:
        notes.append("parameter sizes unknown: no small parameters assumed persistent on the device")
    return Plan(config=sz.apply(cfg), stats=stats, hardware=hw, sizes=sz, items=tuple(items),
                peak_host_rss_bytes=rss, nvme_read_bytes_per_step=reads,
                nvme_write_bytes_per_step=writes, warnings=tuple(warnings), notes=tuple(notes))


def host_budget_fits(cfg: InfinityConfig, stats: ModelStats, hw: Hardware) -> bool:
    """Whether ``cfg``'s host memory budget holds the planned host tier and, on a CPU-only
    machine without a device budget, the emulated device pool paid from it (disk and RSS aside)."""
    plan = plan_memory(cfg, stats, hw)
    host, device = plan.bytes(tier="host"), plan.bytes(tier="device")
    if host > plan.sizes.host_budget_bytes:
        return False
    return not _pool_in_host_budget(cfg, hw) or host + device <= _host_allowed(cfg, hw)


def minimum_host_budget(cfg: InfinityConfig, stats: ModelStats, hw: Hardware) -> int | None:
    """The smallest ``infinity.host_memory_budget`` (within 0.4%) for which ``host_budget_fits``,
    or None when no budget does (sizes written in the config that no memory can hold).

    Why: a budget too small fails only inside the engine's start, after the swap files were
    preallocated, and names the share left to one pool ("0 B of the 0 B host budget"), not the
    budget the user gave; ``infinity train`` checks the budget against this first.
    """
    def fits(budget: int) -> bool:
        inf = dataclasses.replace(cfg.infinity, host_memory_budget=budget)
        return host_budget_fits(dataclasses.replace(cfg, infinity=inf), stats, hw)

    low, high = 0, 1 << 50
    if not fits(high):
        return None
    while high - low > max(4096, low >> 8):
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


def recommend_config(stats: ModelStats, hw: Hardware, base: InfinityConfig | None = None,
                     nvme_path: str | None = None) -> InfinityConfig:
    """The shallowest tiers that fit: no offload, then host, then NVMe (first plan without warnings).

    Keeps everything of ``base`` except the ZeRO stage and the offload devices. Without an
    nvme_path (argument, base config or ``hw``), NVMe candidates use DEFAULT_SWAP_DIR.
    """
    base = base or InfinityConfig()
    path = (nvme_path or base.zero.offload_optimizer.nvme_path or base.zero.offload_param.nvme_path
            or hw.nvme_path or DEFAULT_SWAP_DIR)
    candidates = [(0, "none", "none")]
    if hw.has_gpu:
        candidates.append((2, "none", "cpu"))
    candidates += [(3, "cpu", "cpu"), (3, "cpu", "nvme"), (3, "nvme", "nvme")]
    cfg = base
    for stage, param, opt in candidates:
        z = base.zero
        zero = dataclasses.replace(
            z, stage=stage, overlap_comm=stage == 3,
            offload_param=dataclasses.replace(z.offload_param, device=param,
                                              nvme_path=path if param == "nvme" else z.offload_param.nvme_path),
            offload_optimizer=dataclasses.replace(z.offload_optimizer, device=opt,
                                                  nvme_path=path if opt == "nvme" else z.offload_optimizer.nvme_path))
        cfg = dataclasses.replace(base, zero=zero)
        if stage == 3 and _layout(cfg, stats, hw).param_tier != _TIER_OF_DEVICE[param]:
            continue  # one fp32 copy in the deeper tier: the same layout as a later candidate
        if plan_memory(cfg, stats, hw).fits:
            break
    return cfg
