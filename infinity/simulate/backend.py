"""The dry run's backend for the engine's assembly (``engine.assembly.PartsBackend``): what a
pool, a unit and the units' stepper are when no byte moves.

Why here: ``engine.assembly.assemble`` builds the engine's parts over a backend, the engine's
(real slots, ``Unit``, the partitioned optimizer) or this one (``SimPool`` slots of meta memory,
``MetaUnit``, the optimizer's schedule on the clock: ``SimStepper``), so the dry run is the
engine's own wiring. The assembly names the Protocol; this class implements it, as
``engine.engine._EngineBackend`` does, without importing the engine (the package sits beside
it). Besides the stepper, it reserves in the simulated host budget what the optimizer takes
there at its start, in ``PartitionedOptimizer``'s order: a separate fp32 master's
initialisation buffer, the gradient and step pools, the activation staging.
"""
from __future__ import annotations

from typing import Callable

import torch

from infinity.planner.engine_sizes import ACTIVATION_STAGING_BYTES
from infinity.planner.placement import Placement
from infinity.planner.run_plan import PoolPlan, RunPlan
from infinity.planner.tiers import Tier
from infinity.simulate.collectives import SimCollectives
from infinity.simulate.compute import SimCompute
from infinity.simulate.stepper import SimStepper
from infinity.simulate.storage import META, SimManager, SimPool
from infinity.storage.tiers import Residency
from infinity.zero.unit import Unit

__all__ = ["MetaUnit", "SimBackend"]


class MetaUnit(Unit):
    """A unit on the meta device. On a CPU device the engine reads NVMe straight into the
    unit's page-aligned memory (no slots); here that is decided by the plan (``direct``), not
    by where a meta tensor's (absent) bytes lie."""

    direct = False

    @property
    def flat_on_aligned_host(self) -> bool:
        return self.direct

    # the copies a fetch issues are this unit's (the timeline's H2D row names them)
    def start_fetch(self, manager: SimManager, pool) -> bool:
        with manager.copies.for_unit(self.name):
            return super().start_fetch(manager, pool)

    def advance_fetch(self, manager: SimManager, pool) -> bool:
        with manager.copies.for_unit(self.name):
            return super().advance_fetch(manager, pool)

    def finish_fetch(self, manager: SimManager, pool, gather: bool = True) -> None:
        with manager.copies.for_unit(self.name):
            super().finish_fetch(manager, pool, gather)


# ``communication_data_type`` as the planner resolved it -> the dtype the device buffers, their
# collective and the shard's copy to the host are in (optim/device_gradients.py's COMM_DTYPES)
_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class SimBackend:
    """The byte-free tier manager, simulated pools, units on the meta device and the
    optimizer's schedule on the clock, for ``engine.assembly.assemble``.

    ``grad_dtype``: the dtype a gradient's home holds (the engine's
    ``engine.sizing.gradient_home_dtype``, which the caller passes: this package does not
    import the engine). ``instant``: steps cost nothing (see ``simulate.stepper``).
    ``direct``: NVMe reads go into the unit's memory (the plan's direct fetch)."""

    def __init__(self, manager: SimManager, comm: SimCollectives, compute: SimCompute, *,
                 adam_params_per_s: float, grad_dtype: torch.dtype, instant: bool,
                 direct: bool, host_add_Bps: float = 0.0) -> None:
        self.manager, self.comm, self.compute = manager, comm, compute
        self.host_add_Bps = host_add_Bps
        self.adam_params_per_s, self.grad_dtype = adam_params_per_s, grad_dtype
        self.instant = instant
        self.device = META
        self.direct = direct

    def pool(self, plan: PoolPlan) -> SimPool:
        return SimPool(self.manager, plan.slot_bytes, plan.count, plan.name)

    def unit_factory(self) -> Callable[..., MetaUnit]:
        direct = self.direct

        def make(*args, **kwargs) -> MetaUnit:
            unit = MetaUnit(*args, **kwargs)
            unit.direct = direct
            return unit
        return make

    def stepper(self, units: list[Unit], groups: list[dict], plan: RunPlan,
                fetch_pool: SimPool | None) -> SimStepper:
        lay, es = plan.placement, plan.sizes
        stepper = SimStepper(
            units, self.manager, early=lay.early_step, speculative=plan.speculative,
            opt_tier=lay.opt_tier, grad_tier=es.grad_tier, master_separate=not lay.single_copy,
            adam_params_per_s=self.adam_params_per_s, comm=self.comm,
            grads_held=plan.optimizer.holds_grads, backward_s=self.compute.backward_s,
            instant=self.instant, grad_dtype=self.grad_dtype, state_format=lay.state_format,
            comm_dtype=_COMM_DTYPES[plan.derived.device_grad_dtype] if es.device_gradient_bytes
            else torch.float32,
            # the buffers a unit's reduce takes and its copy out gives back (several ranks on
            # a GPU; none on the host path)
            device_grad_buffers=plan.derived.device_grad_buffers if es.device_gradient_bytes
            else 0, scatter=plan.stage >= 1, host_add_Bps=self.host_add_Bps,
            boundary_steps=plan.boundary_steps)
        _init_masters(units, self.manager, fetch_pool, lay, stepper.masters)
        for pool in (plan.optimizer.gradient, plan.optimizer.step):
            if pool is not None:
                self.pool(pool)
        if es.activation_staging:      # "nvme", or "auto" that may choose it (as the engine)
            self.manager.host_budget.reserve(ACTIVATION_STAGING_BYTES, "activation staging")
        return stepper


def _init_masters(units: list[Unit], manager: SimManager, pool: SimPool | None,
                  lay: Placement, masters: set[int]) -> None:
    """A separate fp32 master on NVMe (of the units in ``masters``: every trainable one unless
    the parameter is its own master; a bf16-master run's units kept fp32) is written from a
    host buffer of its size, the unit fetched meanwhile (``PartitionedOptimizer._init_master``)."""
    if lay.opt_tier is not Tier.NVME:
        return
    for unit in units:
        if not unit.has_trainable or unit.index not in masters:
            continue
        released = unit.residency != Residency.FETCHED
        if released:
            unit.finish_fetch(manager, pool, gather=False)
        n = unit.shard_numel if unit.shards > 1 else unit.trainable_numel
        buf = manager.host_empty(-(-n // 1024) * 1024, torch.float32, what="master init")
        manager.release_host(buf)
        if released:
            unit.release(manager)
