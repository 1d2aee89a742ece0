"""The optimizer's side of the state formats (planner/state_format.py): which format each
param group asks for, the dtypes of the stores, what a unit's format needs of it, and the log
line that says where the engine kept more precision than asked."""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from infinity.base.log import get_logger
from infinity.optim.records import UnitOptimState
from infinity.planner.state_format import (
    StateFormat,
    int8_sub_group_refusal,
    keeps_fp32_master,
    unit_format,
    unit_stores,
)
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.protocols import SteppedUnit

log = get_logger("optim")

__all__ = ["MOMENT_DTYPES", "group_format", "check_unit_format", "build_state", "log_formats"]

SCALES = ("exp_avg.scales", "exp_avg_sq.scales")
"""The int8 scale stores' names (``planner.state_format.unit_stores``)."""

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
"""The stored dtype of m and v per moments format (int8: codes into the dynamic maps)."""


def group_format(group: dict) -> StateFormat:
    """The state format a param group asks for (its ``optimizer_moments`` and
    ``optimizer_master``; fp32 where it names none, as for an optimizer built alone)."""
    try:
        return StateFormat(group.get("optimizer_moments", "fp32"),
                           group.get("optimizer_master", "fp32"))
    except ValueError as exc:
        raise ValueError(f"param group with lr {group.get('lr')}: {exc}") from None


def check_unit_format(unit: SteppedUnit, fmt: StateFormat, sub_group_numel: int,
                      optimizer_tier: Tier = Tier.HOST, span_numel: int | None = None) -> None:
    """Refuse a format this unit cannot be stepped in, before any store is made (the run plan
    refuses the config's formats; these checks catch a param group's own). ``span_numel``:
    the largest range of the unit a rank steps, the same on every rank, so that all refuse or
    none (a range no larger than one int8 chunk is one sub-group whatever the chunk: with
    several ranks the plan clamps the sub-group to the largest range, 2048 elements for a
    small unit's shard at three ranks)."""
    if not fmt.is_default and optimizer_tier is Tier.DEVICE and unit.flat.device.type != "cpu":
        raise ValueError(
            f"{unit.name}: its param group asks for {fmt.describe()}, but the optimizer states "
            f"live on {unit.flat.device} (zero_optimization.offload_optimizer.device \"none\"):"
            " the formats are stepped by the CPU Adam, on offloaded states. Offload the "
            "optimizer (\"cpu\" or \"nvme\"), or keep the group's formats fp32")
    if fmt.master == "bf16":
        if unit.dtype != torch.bfloat16 or unit.flat.device.type != "cpu":
            raise ValueError(
                f"{unit.name}: a bf16 master (optimizer_master \"bf16\") is the bf16 parameter "
                f"itself, stepped in place on the host, but the unit computes in {unit.dtype} on "
                f"{unit.flat.device}: use bf16 compute on a CPU device, or an fp32 master")
    refusal = int8_sub_group_refusal(sub_group_numel, span_numel)
    if fmt.moments == "int8" and refusal is not None:
        raise ValueError(f"{unit.name}: {refusal}")


def build_state(manager: TierManager, unit: SteppedUnit, span: tuple[int, int],
                asked: list[StateFormat], sub_group_numel: int, *, optimizer_tier: Tier,
                grad_tier: Tier, grad_dtype: torch.dtype, early_step: bool,
                master_separate: bool, doubled: bool, sharded: bool) -> UnitOptimState:
    """One unit's optimizer state over its range ``span`` of trainable elements, its stores
    made in the unit's format (``asked``: each param group's; see [Note: a unit's state
    format]): m and v, the int8 scales, the fp32 master where one is kept, the gradient home
    of the deferred schedule. The master is not seeded here."""
    lo, hi = span
    # the unit's format, the same on every rank: decided on the unit's trainable elements, not
    # this rank's range of them (ranks would otherwise store one unit in two formats)
    fmt = unit_format({asked[e.group_index] for e in unit.trainable_entries()},
                      unit.trainable_numel)
    # the first rank's range, the largest (the same figure on every rank; the plan sizes the
    # sub-group from it: planner/alignment.py first_rank_range)
    largest = min(unit.shard_numel, unit.trainable_numel) if sharded else unit.trainable_numel
    check_unit_format(unit, fmt, sub_group_numel, optimizer_tier, span_numel=largest)
    # the stores the plan counts (planner/state_format.py: one rule for both): m and v in the
    # format, an fp32 master where the compute copy is not the fp32 parameter itself (a bf16
    # master is the bf16 parameter), the int8 scales in host memory (zero-initialised,
    # so every code reads as 0 before the first step, whatever an NVMe extent held)
    fp32_master = keeps_fp32_master(fmt, master_separate=master_separate,
                                    compute_itemsize=unit.dtype.itemsize)
    made = {store.name: manager.create(
        f"{unit.name}.{store.name}", store.numel,
        torch.float32 if store.name in ("master", *SCALES) else MOMENT_DTYPES[fmt.moments],
        Tier.HOST if store.in_host else optimizer_tier, doubled=doubled and not store.in_host)
        for store in unit_stores(fmt, hi - lo, fp32_master=fp32_master)}
    grad_store = None if early_step else manager.create(
        f"{unit.name}.grad", max(hi - lo, 1), grad_dtype, grad_tier)
    return UnitOptimState(unit, made["exp_avg"], made["exp_avg_sq"], made.get("master"),
                          grad_store, shard=span if sharded else None, fmt=fmt,
                          exp_avg_scales=made.get(SCALES[0]),
                          exp_avg_sq_scales=made.get(SCALES[1]))


def log_formats(states: Iterable[UnitOptimState], asked: list[StateFormat]) -> None:
    """One line of the formats in use, and one naming the units kept more precise than some of
    their param groups asked (see [Note: a unit's state format])."""
    states = list(states)
    if all(f.is_default for f in asked) and all(s.fmt.is_default for s in states):
        return
    used = Counter(s.fmt.describe() for s in states)
    log.info("optimizer states: %s", ", ".join(f"{n} unit(s) {d}" for d, n in used.items()))
    kept = [s.unit.name for s in states
            if any(asked[e.group_index] != s.fmt for e in s.unit.trainable_entries())]
    if kept:
        log.info("%d unit(s) keep a more precise format than some of their param groups ask "
                 "(groups disagree within the unit, or a state under 4096 elements keeps fp32 "
                 "moments): %s", len(kept), ", ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""))
