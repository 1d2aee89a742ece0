"""Room for the optimizer: where the host budget leaves the step stream a sub-group too small to
be worth its calls, the run plan gives up parameter buffers (and the prefetch they carry) and,
last, the held-gradient room -- settings the user left unset -- until the sub-group is useful.

[Note: room for the optimizer]
The optimizer's slots get what the other host pools leave of the budget (planner/engine_sizes.py),
so a tight budget used to end at the least sub-group: a 6.74B Llama with int8 moments and a bf16
master under 3 GiB got 4,096 elements, because its three parameter buffers (moved into the
emulated device pool on a CPU device, one 405 MB layer each) and the early step's two units of
held fp32 gradients (809 MB each) took nearly all of it; one buffer and no prefetch gave 9.7M.

Useful: at least USEFUL_SUB_GROUP elements (or, where smaller, the largest range a rank steps or
the config's own ``sub_group_size``: no budget makes a sub-group larger than those). Why 1 Mi:
each sub-group costs its calls whatever its size -- an O_DIRECT request per NVMe state each way
(~90 us each on this project's VM disk, against ~1.2 ms for 1 MiB) and a kernel call (~25 us,
against 0.9 ns an element) -- about 0.5 ms a sub-group of 4 to 6 requests. At 1 Mi elements
an int8 + bf16-master sub-group moves ~8 MB (~10 ms at 0.8 GB/s), so the calls cost under 5%;
at 4,096 elements they are ~90% of it and the step is 10-20x slower. (``MIN_SUB_GROUP``, the
size under which ``infinity plan`` already called sub-groups slow.)

The economies, in order (each taken only while the sub-group is still under the useful size,
and only where the user left its key unset; a key the user set is kept and warned about):

1. Parameter buffers (``offload_param.buffer_count``), one at a time down to the least the
   fetch needs (1 where NVMe reads land in the device pool, 2 through host fetch slots). Each
   frees a unit's parameters in the compute dtype (a 7B layer in bf16: 405 MB) and costs only
   prefetch depth: the prefetch follows the buffers (the device pool's room where reads land
   in it, ``(buffers - 2)`` units through fetch slots), so at worst one unit's NVMe read is no
   longer hidden behind the compute of the unit before. A prefetch the user set keeps the
   buffers it needs (``2 + ceil(prefetch / unit)``).
2. The held-gradient room (no key: the early or speculative step on a CPU device, one rank,
   where autograd's gradients are held). Without it the host keeps the unit being stepped and
   the next unit's first part (its largest parameter, in fp32) instead of two units: at 7B one
   layer's 809 MB less its 180 MB largest part, 290 MB where the embedding's 524 MB part is the
   largest. Last because it costs the most: every unit's backward waits for the step of the
   unit before, so the step no longer overlaps the backward.

Pure: ``plan_run`` (planner/run_plan.py) asks ``make_room`` with a function that sizes a config;
the engine and ``infinity plan`` read the choice from the run plan (logged by the engine, shown
as notes and warnings by ``infinity plan``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Callable

from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.engine_sizes import EngineSizes
from infinity.planner.sizes import MIN_SUB_GROUP, DerivedSizes

__all__ = ["OptimizerRoom", "make_room", "room_config", "useful_sub_group", "USEFUL_SUB_GROUP",
           "NO_ROOM_NEEDED"]

USEFUL_SUB_GROUP = MIN_SUB_GROUP
"""Elements a sub-group needs for its per-call costs to be small (see [Note: room for the
optimizer])."""


@dataclass(frozen=True, kw_only=True)
class OptimizerRoom:
    """What the run plan changed of the config's unset sizes so that the optimizer's sub-group
    is useful, and why (see [Note: room for the optimizer])."""

    useful: int
    """The sub-group the rule aims for, in elements (0: the rule did not apply)."""
    sub_group_before: int
    """The sub-group the defaults gave, in elements."""
    sub_group_after: int
    """The sub-group the plan takes, in elements."""
    param_buffer_count: int | None = None
    """The parameter buffers taken instead of the derived count (None: as derived)."""
    prefetch_bucket_size: int | None = None
    """The prefetch set with them, in elements, where it must follow the fetch slots (None:
    as derived, or following the device pool)."""
    held_room_off: bool = False
    """The held-gradient room was given up."""
    changes: tuple[str, ...] = ()
    """What was changed and why, one line each (logged by the engine, notes of ``infinity
    plan``)."""
    warnings: tuple[str, ...] = ()
    """Keys the user set that keep the sub-group small, with what lowering them would do."""

    @property
    def changed(self) -> bool:
        return self.param_buffer_count is not None or self.held_room_off


NO_ROOM_NEEDED = OptimizerRoom(useful=0, sub_group_before=0, sub_group_after=0)
"""The choice where the rule does not apply (no step slots, no host budget)."""


def useful_sub_group(cfg: InfinityConfig, largest_range: int) -> int:
    """The sub-group worth aiming for: USEFUL_SUB_GROUP, or less where the largest range a
    rank steps or the config's ``sub_group_size`` is smaller."""
    target = min(USEFUL_SUB_GROUP, max(1, largest_range))
    if cfg.zero.sub_group_size is not None:
        target = min(target, cfg.zero.sub_group_size)
    return target


def room_config(cfg: InfinityConfig, param_buffer_count: int | None,
                prefetch_bucket_size: int | None) -> InfinityConfig:
    """``cfg`` with the rule's choices written in as if the user had set them (None: left)."""
    if param_buffer_count is None:
        return cfg
    z = cfg.zero
    zero = dataclasses.replace(z, offload_param=dataclasses.replace(
        z.offload_param, buffer_count=param_buffer_count))
    if prefetch_bucket_size is not None:
        zero = dataclasses.replace(zero, stage3_prefetch_bucket_size=prefetch_bucket_size)
    return dataclasses.replace(cfg, zero=zero)


Sizer = Callable[[InfinityConfig, bool], tuple[DerivedSizes, EngineSizes]]
"""(config, held room off) -> (derived sizes, engine sizes): ``plan_run``'s own sizing."""


def make_room(cfg: InfinityConfig, base: tuple[DerivedSizes, EngineSizes], size: Sizer, *,
              largest_range: int, largest_unit: int, direct_fetch: bool, params_fetched: bool,
              holds_grads: bool) -> tuple[OptimizerRoom, DerivedSizes, EngineSizes]:
    """The economies [Note: room for the optimizer] takes for ``cfg`` (``base``: its sizes as
    derived), with the sizes they give. ``largest_range``: elements of the largest range a rank
    steps; ``largest_unit``: of the largest unit; ``direct_fetch``: NVMe reads land in the
    device pool; ``params_fetched``: parameters are fetched from NVMe through buffers;
    ``holds_grads``: the early (or speculative) step holds autograd's gradients."""
    derived, sizes = base
    useful = useful_sub_group(cfg, largest_range)
    before = sizes.sub_group_numel
    if before >= useful or sizes.host_budget is None:
        return NO_ROOM_NEEDED, derived, sizes
    changes: list[str] = []
    warnings: list[str] = []
    best = (before, None, None, False, derived, sizes)
    candidates: list[tuple[int | None, int | None, bool]] = []
    par = cfg.zero.offload_param
    count = derived.param_buffer_count
    if params_fetched:
        user_prefetch = cfg.zero.stage3_prefetch_bucket_size
        least = 1 if direct_fetch else 2
        if user_prefetch:
            least = max(least, 2 + math.ceil(user_prefetch / max(1, largest_unit)))
        if par.buffer_count is not None:
            if par.buffer_count > least:
                warnings.append(
                    f"zero_optimization.offload_param.buffer_count is set to {par.buffer_count} "
                    f"(kept): each buffer is a unit's parameters ({format_bytes(sizes.max_unit_bytes)})"
                    f" of the host budget; down to {least} would give the optimizer's sub-group "
                    "more room")
        else:
            for n in range(count - 1, least - 1, -1):
                prefetch = None
                if not direct_fetch and user_prefetch is None:
                    prefetch = min(derived.prefetch_bucket_size, (n - 2) * largest_unit)
                candidates.append((n, prefetch, False))
    if holds_grads:
        n, prefetch, _ = candidates[-1] if candidates else (None, None, False)
        candidates.append((n, prefetch, True))
    for n, prefetch, room_off in candidates:
        got_derived, got = size(room_config(cfg, n, prefetch), room_off)
        if got.sub_group_numel > best[0]:
            best = (got.sub_group_numel, n, prefetch, room_off, got_derived, got)
        if got.sub_group_numel >= useful:
            break
    after, n, prefetch, room_off, derived, sizes = best
    if n is not None:
        how = ("the prefetch follows the device pool" if direct_fetch else
               f"prefetch {prefetch:,} elements" if prefetch is not None else "prefetch as set")
        changes.append(f"offload_param.buffer_count {n} (was {count}; {how}): each buffer "
                       f"held a unit's parameters ({format_bytes(sizes.max_unit_bytes)}) of the "
                       "host budget")
    if room_off:
        changes.append("no held-gradient room: each unit's backward waits for the step of the "
                       "unit before (the host keeps one unit's gradients and a part, not two "
                       "units')")
    budget = cfg.infinity.host_memory_budget
    budget_name = "the host budget" + (f" {format_bytes(budget)}" if budget is not None else "")
    if changes:
        changes = [f"{budget_name} left the optimizer "
                   f"{before:,}-element sub-groups (useful from {useful:,}): took "
                   + "; ".join(changes) + f" -> {after:,}-element sub-groups"
                   + ("" if after >= useful else " (still under: raise "
                      "infinity.host_memory_budget)")]
    elif not warnings:
        warnings.append(f"{budget_name} leaves the optimizer {before:,}-element sub-groups (useful from {useful:,}) and "
                        "nothing the plan may give up frees more: raise "
                        "infinity.host_memory_budget")
    room = OptimizerRoom(useful=useful, sub_group_before=before, sub_group_after=after,
                         param_buffer_count=n, prefetch_bucket_size=prefetch,
                         held_room_off=room_off, changes=tuple(changes),
                         warnings=tuple(warnings))
    return room, derived, sizes
