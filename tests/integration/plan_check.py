"""What an engine holds against what its run plan and ``infinity plan`` say, for the "plan is
the engine" tests (one rank in test_plan_is_the_engine.py, two in plan_ranks_worker.py).

States are counted from the stores the engine's tier manager creates, in the elements of the
parameters they hold (the engine pads each parameter to 64 B and each store to 4 KiB, which the
plan leaves out: at most 4 KiB + 64 B a tensor per store, 10% of a tiny model, nothing at 1B
parameters), in the store's dtype (Adam's m and v in their format: fp32, bf16 or int8); the
int8 moments' scales (one fp32 per 2048 elements of a unit's range, in host memory) by their
count of blocks. Pools are counted from the engine's own buffer pools, slot by slot.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

from infinity.planner.inputs import ModelStats, detect_hardware
from infinity.planner.plan import plan_memory
from infinity.optim.pools import plan_pools
from infinity.planner.run_plan import plan_run
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier

COMPONENT_OF = {"params": "params", "master": "optimizer_states", "exp_avg": "optimizer_states",
                "exp_avg_sq": "optimizer_states", "grad": "grads", "scales": "optimizer_states"}


@contextmanager
def recording_stores() -> Iterator[list]:
    """Every store a tier manager creates meanwhile, in a list."""
    created: list = []
    create = TierManager.create

    def recorded(self, name, *args, **kwargs):
        store = create(self, name, *args, **kwargs)
        created.append(store)
        return store
    TierManager.create = recorded
    try:
        yield created
    finally:
        TierManager.create = create


def held_states(engine, created: list) -> dict[str, int]:
    """"component@tier" -> bytes the engine's stores hold (see the module docstring); a unit
    kept on the device (below stage 3, or persistent) holds its parameters without a store."""
    units = {unit.name: unit for unit in engine.units}
    held: dict[str, int] = defaultdict(int)
    for store in created:
        unit_name, kind = store.name.rsplit(".", 1)
        if not store.allocated:
            continue        # freed
        if kind == "scales":            # "<unit>.exp_avg.scales": the blocks, as the plan counts
            key = f"{COMPONENT_OF[kind]}@{store.home}"
            held[key] += store.numel * store.itemsize
            if units[unit_name.rsplit(".", 1)[0]].shards > 1:
                held[f"stores:{key}"] += 1      # a rank's blocks: of its shard (``check``)
            continue
        unit = units[unit_name]
        if unit.shards > 1:
            # a rank's store holds its shard of the flat layout: its bytes, padding included
            # (``check`` bounds the padding, a shard's alignment per store)
            key = f"{COMPONENT_OF[kind]}@{store.home}"
            held[key] += store.numel * store.itemsize
            held[f"stores:{key}"] += 1
            continue
        numel = sum(e.numel for e in unit.params if kind == "params" or e.trainable)
        held[f"{COMPONENT_OF[kind]}@{store.home}"] += numel * store.itemsize
    for unit in engine.units:
        if unit.param_store is None:
            held["params@device"] += sum(e.numel for e in unit.params) * unit.dtype.itemsize
    return dict(held)


def planned_states(engine, stats: ModelStats, nvme: str) -> dict[str, int]:
    """"component@tier" -> bytes ``infinity plan`` shows for the engine's config and model;
    its host pools' rows as "pool:<name>" and its staging row as "staging"."""
    plan = plan_memory(engine.config, stats, detect_hardware(nvme))
    planned: dict[str, int] = defaultdict(int)     # the int8 scales are an item of their own
    for item in plan.items:
        if item.component in ("params", "grads", "optimizer_states") and item.nbytes:
            planned[f"{item.component}@{item.tier}"] += item.nbytes
        elif item.pool:
            planned[f"pool:{item.pool}"] += item.nbytes
        elif item.note.startswith("the activation swapper's staging"):
            planned["staging"] += item.nbytes
    return dict(planned)


def held_pools(engine) -> dict[str, tuple[int, int]]:
    """name -> (slots, bytes a slot) of the host pools the engine allocated."""
    pools = (engine.fetch_pool, engine.optimizer.grad_pool, engine.optimizer.step_pool)
    return {p.name: (p.count, p.slot_bytes) for p in pools if p is not None}


def pools_of_units(engine) -> dict[str, tuple[int, int]]:
    """The optimizer's pools as the run plan's rule sizes them from the units the engine built
    (their real flat layouts and shards): the plan, made before any unit existed, must agree."""
    plan = engine.plan
    pools = plan_pools(engine.units, engine.manager, sub_group_numel=plan.sizes.sub_group_numel,
                       optimizer_tier=plan.optimizer_tier, grad_tier=plan.grad_tier,
                       early_step=plan.early_step, master_separate=plan.master_separate,
                       speculative=plan.speculative, comm=engine.comm,
                       shard_states=plan.stage >= 1)
    return {p.name: (p.count, p.slot_bytes) for p in (pools.gradient, pools.step) if p}


def counted_plan(engine, stats: ModelStats, nvme: str):
    """The run plan ``infinity plan`` makes for the engine's config from the model's counts
    only (no units built), for this rank."""
    return plan_run(engine.config, detect_hardware(nvme), stats=stats,
                    rank=engine.comm.rank if engine.comm.active else 0)


def decisions(plan) -> dict:
    """Every decision of a run plan, by name (tiers as their names)."""
    return {"compute_dtype": plan.compute_dtype, "param_tier": str(plan.param_tier),
            "optimizer_tier": str(plan.optimizer_tier), "master_separate": plan.master_separate,
            "early_step": plan.early_step, "speculative": plan.speculative,
            "direct_fetch": plan.direct_fetch, "grad_tier": str(plan.grad_tier),
            "holds_grads": plan.optimizer.holds_grads,
            "pools": sorted((p.name, p.count) for p in plan.pools),
            "room": (plan.room.param_buffer_count, plan.room.held_room_off)}


def compare(engine, created: list, stats: ModelStats, nvme: str) -> dict:
    """What the tests assert, as plain data (a worker writes it; the test asserts it): the
    engine's states and pools, the plan's, and the counted plan's decisions."""
    counted = counted_plan(engine, stats, nvme)
    engine_pools = held_pools(engine)
    return {
        "held": held_states(engine, created), "planned": planned_states(engine, stats, nvme),
        "pools": {k: list(v) for k, v in engine_pools.items()},
        "plan_pools": {p.name: [p.count, p.slot_bytes] for p in engine.plan.pools},
        "unit_pools": {k: list(v) for k, v in pools_of_units(engine).items()},
        "decisions": decisions(engine.plan), "counted_decisions": decisions(counted),
        "counted_pools": {p.name: [p.count, p.slot_bytes] for p in counted.pools},
        "tiers": [str(engine.param_tier), str(engine.optimizer_tier), engine.master_separate],
        # the host budget's bytes held: the host stores' (padded) and the plan's pools and
        # staging, and nothing else (an allocation the plan does not know would show here)
        "staging": engine.plan.activation_staging_bytes,
        "host_held": engine.manager.host_budget.held,
        "host_planned": sum(s.nbytes for s in created if s.allocated and s.home == Tier.HOST)
        + sum(p.nbytes for p in engine.plan.pools) + engine.plan.activation_staging_bytes,
    }


def _states(held: dict) -> dict:
    """``held`` without its store counts (and, of the plan's rows, its pools and staging)."""
    return {k: v for k, v in held.items()
            if not k.startswith(("stores:", "pool:")) and k != "staging"}


def check_table_pools(result: dict) -> None:
    """``infinity plan``'s buffers rows are the engine's host pools, count x slot bytes each
    (the table is planned from the model's counts: a slot may exceed the engine's by a unit's
    alignment padding, as ``check`` allows the counted plan), and its staging row the
    engine's staging."""
    table = {k[len("pool:"):]: v for k, v in result["planned"].items() if k.startswith("pool:")}
    assert table.keys() == result["pools"].keys(), (table, result["pools"])
    for name, (count, slot) in result["pools"].items():
        assert count * slot <= table[name] <= count * (slot + (64 << 10)), (name, table[name],
                                                                           count, slot)
    assert result["planned"].get("staging", 0) == result["staging"], result["planned"]


def check(result: dict, *, padding: int | None = None) -> None:
    """Assert one engine's ``compare`` result (raises AssertionError naming what differs).
    ``padding`` None (one rank): the states' bytes equal the plan's. With several ranks each
    unit's shard is padded to 2048 elements, so a rank may hold less than the plan's even share
    (its shard of a small unit past the trainable part is empty) or more, by at most
    ``padding`` bytes per state; the test sums the ranks (see ``check_ranks_states``)."""
    held, planned = _states(result["held"]), _states(result["planned"])
    assert held.keys() == planned.keys(), (result["tiers"], held, planned)
    for key, nbytes in planned.items():
        if padding is None:
            assert held[key] == nbytes, (key, held[key], nbytes, result["tiers"])
        else:
            bound = nbytes + padding * result["held"].get(f"stores:{key}", 0)
            assert held[key] <= bound, (key, held[key], nbytes, result["tiers"])
    assert result["pools"] == result["plan_pools"]
    check_table_pools(result)
    assert result["host_held"] == result["host_planned"]
    optimizer_pools_held = {k: v for k, v in result["pools"].items() if k != "fetch"}
    assert optimizer_pools_held == result["unit_pools"]
    assert result["decisions"] == result["counted_decisions"]
    # from counts the plan bounds each unit's layout (parameters padded in any order): its
    # slots are the engine's or larger, by at most a unit's alignment padding
    for name, (count, slot) in result["pools"].items():
        planned_count, planned_slot = result["counted_pools"][name]
        assert planned_count == count, name
        assert slot <= planned_slot <= slot + (64 << 10), (name, slot, planned_slot)


def check_ranks_states(results: list[dict], padding: int) -> None:
    """The ranks' states together are the plan's even shares together (each rank planned for
    its 1/N), within the shards' padding (``padding`` bytes a store, all ranks together)."""
    for key in _states(results[0]["planned"]):
        total = sum(r["held"][key] for r in results)
        planned = sum(r["planned"][key] for r in results)
        slack = padding * results[0]["held"].get(f"stores:{key}", 0)
        assert planned - slack <= total <= planned + slack, (key, total, planned)


__all__ = ["recording_stores", "compare", "check", "check_table_pools", "check_ranks_states",
           "Tier"]
