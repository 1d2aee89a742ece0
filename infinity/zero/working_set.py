"""The device memory a stage-3 backward needs at once, checked when the engine starts.

Why: a unit whose parameter is also used by a module outside it (a tied head: GPT-2's lm_head
uses the embedding's weight) is fetched at its first use in backward and stays fetched until
its gradient is complete at its last use (see [Note: release during backward] in
zero/coordinator.py); every unit whose backward runs in between is fetched beside it. A device
budget that held each unit alone but not that pair was accepted, and the first backward failed
with "unit transformer.h.1 needs 196 KiB ... only 133 KiB free" after the engine was built.
``check_backward_working_set`` says so at ``initialize``, with the budget that works.
"""
from __future__ import annotations

from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.base.sizes import format_bytes
from infinity.zero.unit import Unit


def shared_units(units: list[Unit], hooked: list[tuple[nn.Module, list[int]]]) -> list[Unit]:
    """Units fetched by more than one module, one of them outside the unit's own module (a
    tied parameter's unit), from ``modules_needing``'s list."""
    fetchers: dict[int, list[nn.Module]] = {}
    for module, unit_ids in hooked:
        for uid in unit_ids:
            fetchers.setdefault(uid, []).append(module)
    shared = []
    for unit in units:
        modules = fetchers.get(unit.index, [])
        if len(modules) < 2:
            continue
        inside = {id(m) for m in unit.module.modules()}
        if any(id(m) not in inside for m in modules):
            shared.append(unit)
    return shared


def check_backward_working_set(units: list[Unit], hooked: list[tuple[nn.Module, list[int]]],
                               budget: MemoryBudget) -> None:
    """Raise ValueError when the device budget cannot hold the persistent units, every shared
    trainable unit (held through the backward) and the largest other unit at once."""
    if budget.limit is None:
        return
    held = [u for u in shared_units(units, hooked) if not u.persistent and u.has_trainable]
    if not held:
        return
    others = [u for u in units if not u.persistent and all(u is not h for h in held)]
    persistent = sum(u.nbytes for u in units if u.persistent)
    largest = max(others, key=lambda u: u.nbytes, default=None)
    need = persistent + sum(u.nbytes for u in held) + (largest.nbytes if largest else 0)
    if need <= budget.limit:
        return
    names = ", ".join(f"{u.name} ({format_bytes(u.nbytes)})" for u in held)
    beside = f" beside the largest other unit, {largest.name} ({format_bytes(largest.nbytes)})" \
        if largest else ""
    raise ValueError(
        f"the device budget {format_bytes(budget.limit)} is too small for this model's backward: "
        f"{names} {'is' if len(held) == 1 else 'are'} used by more than one module (a tied "
        "parameter) and stay fetched from the first use in backward until the gradient is "
        f"complete{beside}, with {format_bytes(persistent)} of persistent units: "
        f"{format_bytes(need)} at once. Raise infinity.device_memory_budget to at least "
        f"{format_bytes(need)} (or untie the parameters)")


def traced_backward_need(units: list[Unit], forward_order: list[int]) -> tuple[int, list[Unit]]:
    """The device bytes the backward of a recorded training forward needs at its fullest, and
    the units fetched then. ``forward_order``: the units the forward used with grad enabled, in
    order. The backward runs them in reverse; a unit with trainable parameters used more than
    once (a tied weight, a block shared by several depths) is fetched at its last use in the
    forward and held until its first (its gradient is complete only then), every other unit
    only while its own backward runs. A lower bound: recomputation (activation checkpointing)
    holds more."""
    backward = list(reversed(forward_order))
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for position, uid in enumerate(backward):
        first.setdefault(uid, position)
        last[uid] = position
    persistent = sum(u.nbytes for u in units if u.persistent)
    held = {uid: (first[uid], last[uid]) for uid in first
            if not units[uid].persistent and units[uid].has_trainable}
    need, fullest = persistent, []
    for position, uid in enumerate(backward):
        live = {u for u, (a, b) in held.items() if a <= position <= b}
        if not units[uid].persistent:
            live.add(uid)
        size = persistent + sum(units[u].nbytes for u in live)
        if size > need:
            need, fullest = size, sorted(live, key=lambda u: -units[u].nbytes)
    return need, [units[u] for u in fullest]


def check_traced_working_set(units: list[Unit], forward_order: list[int],
                             budget: MemoryBudget) -> None:
    """Raise ValueError, after a training forward and before its backward, when the device
    budget cannot hold what that backward must hold at once (``traced_backward_need``):
    a block shared by several depths cannot be seen before the first forward runs it."""
    if budget.limit is None or not forward_order:
        return
    need, fullest = traced_backward_need(units, forward_order)
    if need <= budget.limit:
        return
    uses = {uid: forward_order.count(uid) for uid in set(forward_order)}
    reused = [u for u in fullest if uses.get(u.index, 0) > 1]
    listed = ", ".join(f"{u.name} ({format_bytes(u.nbytes)}, used {uses[u.index]} times)"
                       for u in reused[:4]) + (" ..." if len(reused) > 4 else "")
    others = [u for u in fullest if u not in reused]
    beside = f", beside {others[0].name} ({format_bytes(others[0].nbytes)})" if others else ""
    raise ValueError(
        f"the device budget {format_bytes(budget.limit)} is too small for this model's "
        f"backward: {listed or 'its units'} stay fetched from their last use in the forward "
        f"until their gradient is complete at their first{beside}: {format_bytes(need)} at "
        f"once. Raise infinity.device_memory_budget to at least {format_bytes(need)}")
