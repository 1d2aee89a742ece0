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

from infinity.budget import MemoryBudget
from infinity.sizes import format_bytes
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
