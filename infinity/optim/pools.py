"""The partitioned optimizer's host pools: the gradient buffers and the step stream's slots.

Why a module: their counts and sizes are the run plan's (planner/run_plan.py
``optimizer_pools``), which the engine hands to the optimizer; an optimizer built alone (tests,
tools) plans them here from its units by the same rule, so no second formula exists.
"""
from __future__ import annotations

from infinity.comm.collectives import Collectives
from infinity.optim.device_gradients import reduces_on_device
from infinity.optim.gradients import gradients_held
from infinity.planner.run_plan import OptimizerPools, PoolPlan, optimizer_pools
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.protocols import SteppedUnit

__all__ = ["plan_pools", "host_pool"]


def plan_pools(units: list[SteppedUnit], manager: TierManager, *, sub_group_numel: int,
               optimizer_tier: Tier, grad_tier: Tier, early_step: bool, master_separate: bool,
               speculative: bool, comm: Collectives, shard_states: bool) -> OptimizerPools:
    """The pools of an optimizer built without a run plan (tests, tools), planned from its
    units by the run plan's own rule."""
    stores = [u.param_store for u in units if u.has_trainable and u.param_store is not None]
    return optimizer_pools(
        [(u.flat_numel, u.trainable_numel) for u in units], world_size=comm.world_size,
        rank=comm.rank if comm.active else 0, shard_states=shard_states,
        sub_group_numel=sub_group_numel, optimizer_tier=optimizer_tier,
        param_tier=stores[0].home if stores else Tier.DEVICE,
        streamed=[u.param_store is not None for u in units], grad_tier=grad_tier,
        master_separate=master_separate, early_step=early_step, speculative=speculative,
        keeps_gradients=gradients_held(manager.device),
        reduces_on_device=reduces_on_device(manager.device))


def host_pool(manager: TierManager, plan: PoolPlan | None) -> BufferPool | None:
    """The host pool ``plan`` describes, or None."""
    return BufferPool(manager, plan.slot_bytes, plan.count, plan.name) if plan is not None else None
