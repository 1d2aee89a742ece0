"""Memory prediction: bytes per tier of params, grads, optimizer states and buffers for a config,
model and machine, with warnings naming the setting to change (``plan_memory``), and the
shallowest config that fits (``recommend_config``).

Pure functions, importable from any layer: ``infinity plan`` prints ``plan_memory`` for a model
that may never fit on this machine, from the run plan the engine itself is built from
(``infinity.planner.run_plan.plan_run``: its sizes, its pools, where each state lives) and the
byte math of ``infinity.planner.placement``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.inputs import Hardware, ModelStats
from infinity.planner.placement import (
    COMPONENTS,
    Placement,
    compute_dtype_choice,
    place,
    resident_bytes,
)
from infinity.planner.optimizer_room import NO_ROOM_NEEDED, OptimizerRoom
from infinity.planner.render import render_plan
from infinity.planner.run_plan import RunPlan, plan_run
from infinity.planner.sizes import (
    DerivedSizes,
    device_working,
    host_allowed,
    pool_in_host_budget,
)
from infinity.planner.state_format import MIN_INT8_NUMEL, StateFormat
from infinity.planner.tiers import TIERS, Tier

__all__ = ["Plan", "PlanItem", "plan_memory", "buffer_items", "recommend_config", "host_budget_fits",
           "minimum_host_budget", "host_budget_shortfall", "REFUSE_BELOW_FRACTION",
           "budget_need"]

RUNTIME_OVERHEAD_BYTES = 512 << 20  # Python + torch + native library resident set (measured ~0.3-0.5 GiB)
# nvme_path when recommending NVMe offload without one: the parent `infinity train` uses by default
# (infinity.train.defaults.DEFAULT_NVME_PATH; the engine makes its private swap directory inside),
# which exists on most systems; "/var/tmp/infinity-swap" did not, so the ds_config printed failed.
DEFAULT_SWAP_DIR = "/var/tmp"


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
    pool: str = ""
    """The run plan's host pool these bytes are (``PoolPlan.name``), or "" for none."""


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
    stepped_sub_group: int = 0
    """Elements the optimizer steps at once, as the run plan sizes its slots (``sizes`` holds
    the config's value, which the host budget may shrink)."""
    room: OptimizerRoom = NO_ROOM_NEEDED
    """What the run plan gave up for a useful sub-group (see planner/optimizer_room.py)."""
    host_budget_bytes: int | None = None
    """The host tier's budget as the run plan shares it out (None: ``sizes``'); on a CPU device
    with direct reads the parameter buffers' room moves to the device pool."""
    device_budget_bytes: int | None = None
    """The device pool's budget as the run plan sizes it (None: ``sizes``')."""
    planned: InfinityConfig | None = None
    """The config the plan was made from, as given (None: ``config``): its derived sizes left
    to derive, so a run of it is this plan again. The ds_config to hand out: ``config``, every
    size written in, plans otherwise where the run plan shared the budget after deriving
    (a tight host budget: the parameter buffers' room moved into the device pool, and the
    sub-group grew from what the buffers gave up), since sizes a config pins are the user's,
    never re-shared (the 85M model under 80 MiB: 139,264-element sub-groups in the plan shown,
    432,128 in the run of its ds_config)."""

    @property
    def ds_config(self) -> dict:
        """The ds_config to recommend (``planned``, or ``config``)."""
        return (self.planned or self.config).to_dict()

    @property
    def budgets(self) -> tuple[int, int]:
        """(device, host) budgets in bytes, as the run plan shares them out."""
        return (self.sizes.device_budget_bytes if self.device_budget_bytes is None
                else self.device_budget_bytes,
                self.sizes.host_budget_bytes if self.host_budget_bytes is None
                else self.host_budget_bytes)

    def bytes(self, component: str | None = None, tier: Tier | None = None) -> int:
        """Bytes of a component and/or at a tier (both None: everything)."""
        return sum(i.nbytes for i in self.items
                   if (component is None or i.component == component) and (tier is None or i.tier == tier))

    @property
    def fits(self) -> bool:
        """No tier exceeds its budget and the host RSS fits in MemAvailable."""
        return not self.warnings

    @property
    def state_format(self) -> StateFormat:
        """The Adam state format the config asks for (every param group's default)."""
        inf = self.config.infinity
        return StateFormat(inf.optimizer_moments, inf.optimizer_master)

    def table(self) -> dict[str, dict[str, int]]:
        """component -> tier -> bytes, every cell present."""
        return {comp: {tier: self.bytes(comp, tier) for tier in TIERS} for comp in COMPONENTS}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``infinity plan --json``)."""
        return {
            "fits": self.fits, "table_bytes": self.table(),
            "total_bytes": {tier: self.bytes(tier=tier) for tier in TIERS},
            "budget_bytes": {Tier.DEVICE: self.budgets[0], Tier.HOST: self.budgets[1],
                             Tier.NVME: self.hardware.disk_free_bytes},
            "peak_host_rss_bytes": self.peak_host_rss_bytes,
            "nvme_bytes_per_step": {"read": self.nvme_read_bytes_per_step,
                                    "write": self.nvme_write_bytes_per_step},
            "state_format": {"optimizer_moments": self.state_format.moments,
                             "optimizer_master": self.state_format.master,
                             "label": self.state_format.label},
            "items": [dataclasses.asdict(i) for i in self.items],
            "sizes": dataclasses.asdict(self.sizes),
            "model": {k: v for k, v in dataclasses.asdict(self.stats).items()
                      if k not in ("param_numels", "unit_numels")},
            "hardware": dataclasses.asdict(self.hardware),
            "warnings": list(self.warnings), "notes": list(self.notes),
            "stepped_sub_group": self.stepped_sub_group,
            "optimizer_room": dataclasses.asdict(self.room),
            "ds_config": self.ds_config,
        }

    def render(self) -> str:
        """A text table for people."""
        return render_plan(self)


_FIXES = {  # (component, tier) -> the setting that moves it deeper
    ("optimizer_states", Tier.HOST): "set offload_optimizer.device nvme",
    ("params", Tier.HOST): "set offload_param.device nvme",
    ("grads", Tier.HOST): "set offload_optimizer.device nvme, or allow the early step (no clipping, "
                       "no fp16, no gradient accumulation)",
    ("optimizer_states", Tier.DEVICE): "set offload_optimizer.device cpu (ZeRO stage >= 1)",
    ("grads", Tier.DEVICE): "set offload_optimizer.device cpu (gradients follow the optimizer)",
    ("params", Tier.DEVICE): "set ZeRO stage 3 with offload_param.device cpu",
}
_FIX_OPT_SLOTS = "set a smaller zero_optimization.sub_group_size or offload_optimizer.buffer_count (or \"auto\")"
_FIX_PARAM_SLOTS = "set a smaller offload_param.buffer_count (or \"auto\")"
_FIX_DEVICE_WORK = ("set a smaller stage3_prefetch_bucket_size / reduce_bucket_size, or a device budget "
                    "that holds at least two units")


def plan_memory(cfg: InfinityConfig, stats: ModelStats, hw: Hardware) -> Plan:
    """Bytes per tier of params, grads, optimizer states and buffers, with warnings."""
    # the gradients' home as the engine's sizes decide it (host memory unless the budget
    # cannot hold it), not where it might go: the plan shows the bytes the engine allocates
    run = plan_run(cfg, hw, stats=stats)
    sz, lay = run.derived, run.placement
    items: list[PlanItem] = []
    names = {"params": "parameters", "grads": "gradients", "optimizer_states": "optimizer states"}
    fmt = lay.state_format
    for (comp, tier), nbytes in resident_bytes(lay, scales=False).items():
        if comp == "params":
            note = (f"{lay.compute_dtype}, also the optimizer's master (one copy)"
                    if lay.single_copy else f"{lay.compute_dtype} compute copy")
        elif comp == "optimizer_states":
            note = state_note(lay)
        else:
            note = f"{lay.compute_dtype if lay.grad_bytes < 4 else 'fp32'}, kept until the step"
        fix = _FIXES.get((comp, tier), "")
        if (comp, tier) == ("params", Tier.DEVICE) and lay.stage == 3:
            fix = "set offload_param.device cpu"
        items.append(PlanItem(comp, tier, nbytes, note, fix))

    scales = lay.states.scales
    if scales:
        items.append(PlanItem("optimizer_states", Tier.HOST, scales,
                              "int8 scales of m, v (fp32, one per 2048 elements), kept in host "
                              "memory", "set infinity.optimizer_moments bf16 (no scales)"))
    items += buffer_items(run)
    persist = sz.persistent_device_bytes
    # the fetched unit and the prefetch in the bytes a fetch reserves (padded layouts), as
    # derive_sizes counted them
    working = device_working(lay, sz.unit_device_bytes, sz.prefetch_device_bytes, persist,
                             sz.reduce_bucket_size)
    if run.direct_fetch and run.sizes.device_budget is not None:
        # NVMe reads land in the device pool, which holds the parameter buffers' units (the
        # fetched, the prefetched and the kept ones) up to its budget
        # up to its budget, and no more than the model's parameters and a unit's gradients
        resident = sum(i.nbytes for i in items if i.tier == Tier.DEVICE)
        whole = lay.c * (stats.total_params + stats.largest_unit_params)
        pool = max(working, min(run.sizes.device_budget - resident, whole))
        items.append(PlanItem("buffers", Tier.DEVICE, pool,
                              f"the device pool: fetched, prefetched and kept units (NVMe reads "
                              f"land in it: {sz.param_buffer_count} parameter buffer(s) of "
                              f"{run.sizes.max_unit_bytes:,} B, no fetch slots), {persist:,} B of "
                              "persistent units, one unit's gradients", _FIX_DEVICE_WORK))
    elif working:
        note = (f"fetched units ({stats.largest_unit_params:,} + {sz.prefetch_bucket_size:,} prefetched "
                f"elements), {persist:,} B of persistent units, one unit's gradients" if lay.stage == 3
                else "one unit's gradients and a reduce bucket")
        items.append(PlanItem("buffers", Tier.DEVICE, working, note, _FIX_DEVICE_WORK))

    if run.sizes.device_gradient_bytes:
        # several ranks on a GPU reduce each unit's gradient in device buffers (see [Note:
        # gradients reduced on the device] in optim/device_gradients.py): the bytes the engine
        # reserves, as derive_sizes counted them
        items.append(PlanItem(
            "buffers", Tier.DEVICE, run.sizes.device_gradient_bytes,
            f"{sz.device_grad_buffers} {sz.device_grad_dtype} device buffer(s) a unit's gradient "
            "is reduced in (the unit's shards and its own)",
            "set communication_data_type bf16, or smaller units (infinity.unit_modules)"))
    if run.speculative:
        # [Note: speculative step] in optim/speculation.py: the engine keeps second copies of
        # the NVMe parameters and Adam states (its reserve counts them); the plan showed half
        # the disk the run takes, and checked the free space against that half
        once = sum(i.nbytes for i in items if i.tier == Tier.NVME)
        if run.sizes.nvme_bytes > once:
            items.append(PlanItem(
                "speculative_copies", Tier.NVME, run.sizes.nvme_bytes - once,
                f"second copies for the speculative step ({run.speculative_reason})",
                "set infinity.speculative_step \"off\" (the step then waits for the "
                "gradient norm instead of being redone)"))
    host = sum(i.nbytes for i in items if i.tier == Tier.HOST)
    device = sum(i.nbytes for i in items if i.tier == Tier.DEVICE)
    nvme = sum(i.nbytes for i in items if i.tier == Tier.NVME)
    rss = host + (0 if hw.has_gpu else device) + RUNTIME_OVERHEAD_BYTES

    reads = writes = 0
    for i in items:       # Adam states in their format (m, v and any fp32 master) and gradients
        if i.tier == Tier.NVME and i.component in ("optimizer_states", "grads"):
            reads += i.nbytes
            writes += i.nbytes
    if lay.param_tier == Tier.NVME:
        pbytes = lay.c * lay.param_elems
        reads += 2 * pbytes                  # fetched in forward and again in backward
        writes += pbytes if lay.single_copy else lay.c * lay.opt_elems  # master / updated 16-bit copy
        if lay.single_copy and lay.opt_tier != Tier.NVME:
            reads += lay.c * lay.opt_elems   # the master is read for the step, besides the fetches

    warnings: list[str] = []
    host_budget = sz.host_budget_bytes if run.sizes.host_budget is None else run.sizes.host_budget
    device_budget = sz.device_budget_bytes if run.sizes.device_budget is None \
        else run.sizes.device_budget
    for tier, used, budget in ((Tier.HOST, host, host_budget), (Tier.DEVICE, device, device_budget)):
        if used <= budget:
            continue
        worst = max((i for i in items if i.tier == tier), key=lambda i: i.nbytes)
        what = names.get(worst.component) or f"buffers ({worst.note})"
        total = "" if worst.nbytes == used else f" (the {tier} tier holds {format_bytes(used)} in all)"
        warnings.append(f"{what} need {format_bytes(worst.nbytes)} on {tier}{total} but the {tier} "
                        f"budget is {format_bytes(budget)}: {worst.fix}")
    if sz.device_room_warning:     # the user's prefetch bucket beside the gradient buffers
        warnings.append(sz.device_room_warning)
    allowed = host_allowed(cfg, hw)
    if pool_in_host_budget(cfg, hw) and host + device > allowed:
        worst = max((i for i in items if i.tier == Tier.DEVICE), key=lambda i: i.nbytes)
        what = names.get(worst.component) or f"buffers ({worst.note})"
        warnings.append(f"{what} need {format_bytes(worst.nbytes)} in the device pool, which is host "
                        f"memory on this CPU-only machine: host tier and device pool need "
                        f"{format_bytes(host + device)} but the host memory budget is "
                        f"{format_bytes(allowed)}: {worst.fix}")
    if hw.disk_free_bytes is not None and nvme > hw.disk_free_bytes:
        warnings.append(f"swap files need {format_bytes(nvme)} but {hw.nvme_path} has "
                        f"{format_bytes(hw.disk_free_bytes)} free: free space or choose another nvme_path")
    if rss > hw.host_available_bytes:
        deepest = lay.stage == 3 and lay.param_tier == Tier.NVME and lay.opt_tier == Tier.NVME
        # at the deepest offload "offload deeper" contradicted the config it was said of
        fix = ("offload deeper (stage 3, nvme)" if not deepest else
               f"this is already the deepest offload: it needs "
               f"{format_bytes(rss - hw.host_available_bytes)} more free host memory (or smaller "
               "units: infinity.unit_modules), or a larger machine (plan one with infinity plan "
               "--gpus/--host-memory/--nvme)")
        warnings.append(f"predicted peak host RSS {format_bytes(rss)} exceeds the available "
                        f"{format_bytes(hw.host_available_bytes)}: {fix}")
    notes: list[str] = []
    # [Note: room for the optimizer]: what the run plan gave up for a useful sub-group, or
    # (slow, not a failure: initialize trains this) the keys that keep it small
    notes += [f"optimizer room: {line}" for line in run.room.changes]
    notes += [f"slow: {line}; NVMe transfers will be small and slow" for line in run.room.warnings]
    if cfg.infinity.compute_dtype == "auto" and not hw.has_gpu:
        notes.append(f"compute dtype {lay.compute_dtype}: {compute_dtype_choice(cfg, hw)[1]}; set "
                     "infinity.compute_dtype to choose")
    if lay.single_copy and fmt.master == "bf16":
        notes.append(f"bf16 master: the bf16 parameters are the optimizer's master (updated with "
                     f"stochastic rounding), stored once on {lay.param_tier}")
    elif lay.single_copy:
        notes.append(f"fp32 compute: parameters are the optimizer's master, stored once on {lay.param_tier}")
    if not fmt.is_default:
        kept = lay.states.kept_fp32
        notes.append(f"Adam states stored as {fmt.describe()}"
                     + (f"; {kept} unit(s) under {MIN_INT8_NUMEL:,} elements keep fp32 moments "
                        "and an fp32 master" if kept else ""))
    if lay.early_step:
        notes.append("early step: each unit is stepped as its gradients arrive, gradients have no home")
    if not hw.has_gpu and cfg.infinity.device_memory_budget is None:
        notes.append(f"device budget {format_bytes(device_budget)} chosen for the working set "
                     "and taken from the host memory")
    if stats.unit_numels is None and lay.stage == 3:
        notes.append("unit sizes unknown: units of the largest size assumed, so no small unit "
                     "is counted as persistent on the device")
    return Plan(config=sz.apply(cfg), planned=cfg, stats=stats, hardware=hw, sizes=sz,
                items=tuple(items),
                stepped_sub_group=run.optimizer.sub_group_numel, room=run.room,
                host_budget_bytes=host_budget, device_budget_bytes=device_budget,
                peak_host_rss_bytes=rss, nvme_read_bytes_per_step=reads,
                nvme_write_bytes_per_step=writes, warnings=tuple(warnings), notes=tuple(notes))


_POOL_NOTES = {  # PoolPlan.name -> (what its slots are, the setting that makes them smaller)
    "fetch": ("parameter fetch slots", _FIX_PARAM_SLOTS),
    "gradient": ("gradient buffers (a unit's fp32 gradient on its way to the step)",
                 "set offload_optimizer.device nvme with the early step, or fewer ranks"),
    "optimizer": ("optimizer swap slots (a sub-group of a streamed state each)", _FIX_OPT_SLOTS),
}


def buffer_items(run: RunPlan) -> list[PlanItem]:
    """The host "buffers" rows: the run plan's pools, count x slot bytes each, as the engine
    allocates them (``RunPlan.pools``), then the host bytes its sizes keep beside them --
    held gradients, the accumulation chunk, the activation staging -- so that the rows add up
    to what the engine's host budget takes for buffers."""
    items = []
    for pool in run.pools:
        what, fix = _POOL_NOTES.get(pool.name, (f"{pool.name} slots", ""))
        note = f"{pool.count} {what} of {pool.slot_bytes:,} B"
        if pool.name == "optimizer":
            note += f" ({run.optimizer.sub_group_numel:,}-element sub-groups)"
        items.append(PlanItem("buffers", Tier.HOST, pool.nbytes, note, fix, pool=pool.name))
    sizes = run.sizes
    if run.optimizer.holds_grads and sizes.gradient_buffer_bytes:
        room = run.optimizer.held_room_bytes
        items.append(PlanItem(
            "buffers", Tier.HOST, sizes.gradient_buffer_bytes,
            "held gradients (fp32, as autograd made them): "
            + (f"a room of {room:,} B and the part waiting for it" if room else
               "no room (the plan gave it up): the unit being stepped and the next unit's "
               "first part"),
            "raise infinity.host_memory_budget, or turn the early step off"))
    if sizes.accumulate_bytes:
        items.append(PlanItem("buffers", Tier.HOST, sizes.accumulate_bytes,
                              "the chunk accumulation adds an NVMe gradient through", ""))
    if run.activation_staging_bytes:
        items.append(PlanItem("buffers", Tier.HOST, run.activation_staging_bytes,
                              "the activation swapper's staging chunks",
                              "set infinity.offload_activations \"none\""))
    return items


def state_note(lay: Placement) -> str:
    """What the optimizer states in the optimizer's tier are: "fp32 master, Adam m, v (int8,
    blockwise)" and the like (a single copy has no separate master)."""
    moments = f"Adam m, v ({lay.state_format.moments_note})"
    if lay.single_copy and not lay.states.kept_fp32:
        return moments
    master = "fp32 master" if not lay.single_copy else "fp32 master of the units kept fp32"
    return f"{master}, {moments}"


def host_budget_fits(cfg: InfinityConfig, stats: ModelStats, hw: Hardware) -> bool:
    """Whether ``cfg``'s host memory budget holds the planned host tier and, on a CPU-only
    machine without a device budget, the emulated device pool paid from it (disk and RSS aside)."""
    plan = plan_memory(cfg, stats, hw)
    host, device = plan.bytes(tier=Tier.HOST), plan.bytes(tier=Tier.DEVICE)
    if host > plan.budgets[1]:
        return False
    return not pool_in_host_budget(cfg, hw) or host + device <= host_allowed(cfg, hw)


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


# The least budget errs on the safe side (about 4x for a tiny model, ~10% at 85M-1B), so a
# budget under it by less than this factor is only warned about: the engine, which sizes its
# pools exactly, is the judge there.
REFUSE_BELOW_FRACTION = 0.5


def host_budget_shortfall(cfg: InfinityConfig, stats: ModelStats, hw: Hardware,
                          refuse_below: float = REFUSE_BELOW_FRACTION
                          ) -> tuple[bool, int | None] | None:
    """None where ``cfg``'s host budget fits this model (or is unset); else (refuse, least):
    ``least`` the smallest budget that fits (None: none does), ``refuse`` where the budget is
    clearly too small (under ``refuse_below`` of ``least``, or none fits), else it is worth
    trying. Read by ``infinity train`` and by the engine before it allocates anything."""
    budget = cfg.infinity.host_memory_budget
    if budget is None or host_budget_fits(cfg, stats, hw):
        return None
    least = minimum_host_budget(cfg, stats, hw)
    return (least is None or budget < refuse_below * least), least


def budget_need(least: int | None, fix: str) -> str:
    """What a too small host budget needs, for its error: the least budget, and ``fix`` with
    it in MiB (``"pass --host-budget {}MiB or more"``)."""
    if least is None:
        return ("no budget holds the sizes this config sets: see `infinity plan --config` for "
                "the ones to make smaller")
    return (f"it needs at least {format_bytes(least)} (`infinity plan` shows the split): "
            + fix.format(math.ceil(least / 2**20)))


def recommend_config(stats: ModelStats, hw: Hardware, base: InfinityConfig | None = None,
                     nvme_path: str | None = None) -> InfinityConfig:
    """The shallowest tiers that fit: no offload, then host, then NVMe (first plan without warnings).

    Keeps everything of ``base`` except the ZeRO stage and the offload devices. Without an
    nvme_path (argument, base config or ``hw``), NVMe candidates use DEFAULT_SWAP_DIR.
    """
    base = base or InfinityConfig()
    path = nvme_path or base.zero.swap_path or hw.nvme_path or DEFAULT_SWAP_DIR
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
        if stage == 3 and place(cfg, stats, hw).param_tier != Tier.from_offload_device(param):
            continue  # one fp32 copy in the deeper tier: the same layout as a later candidate
        if plan_memory(cfg, stats, hw).fits:
            break
    return cfg
