"""One assembly: the engine's parts -- units in their home tiers, the fetch pool, the optimizer,
the coordinator -- built from a model, its run plan and a backend.

Why one: ``initialize`` builds them over the tier manager (real bytes); ``infinity plan
--dry-run`` builds the same parts over a byte-free backend on a simulated clock
(commands/dry_run.py). With one function building both, the dry run is the engine's own wiring
(the same units, shards, persistence, speculative copies, pools and prefetch limits, from the
same plan), not a copy of it that can drift. What differs is the backend: where bytes live
(``StorageBackend``, storage/protocols.py), what a pool and a unit are, and what steps the units
(the partitioned optimizer, or the dry run's model of its schedule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from infinity.comm.collectives import NO_COMM, Collectives
from infinity.engine.wiring import UnitFactory, build_units
from infinity.planner.run_plan import PoolPlan, RunPlan
from infinity.storage.protocols import SlotPool, StorageBackend
from infinity.zero.coordinator import Coordinator
from infinity.zero.partition import UnitSpec, modules_needing
from infinity.zero.prefetch import PrefetchLimits
from infinity.zero.protocols import NO_PASS_OWNER, PassOwner, UnitStepper, UnitValues
from infinity.zero.unit import Unit

__all__ = ["PartsBackend", "Parts", "assemble", "prefetch_limits"]


class PartsBackend(Protocol):
    """What the assembly asks of a backend (the engine's: engine/engine.py ``_EngineBackend``;
    the dry run's: simulate/backend.py ``SimBackend``)."""

    manager: StorageBackend
    device: torch.device

    def pool(self, plan: PoolPlan) -> SlotPool:
        """The host pool ``plan`` describes."""

    def unit_factory(self) -> UnitFactory:
        """How a unit is made (``Unit``'s signature)."""

    def stepper(self, units: list[Unit], groups: list[dict], plan: RunPlan,
                fetch_pool: SlotPool | None) -> UnitStepper:
        """What steps the units: the optimizer, built over ``units``."""


@dataclass
class Parts:
    """What ``assemble`` built."""

    units: list[Unit]
    replacements: dict[nn.Parameter, nn.Parameter]
    """Parameters materialized on the way (meta or zero.Init-released ones): {old: new}."""
    fetch_pool: SlotPool | None
    stepper: Any
    coordinator: Coordinator


def prefetch_limits(plan: RunPlan) -> PrefetchLimits:
    """The coordinator's prefetch bucket, live and reuse limits of the plan."""
    sizes = plan.sizes
    return PrefetchLimits(sizes.prefetch_bucket_numel, sizes.max_live_numel,
                          sizes.max_reuse_numel)


def assemble(model: nn.Module, specs: list[UnitSpec], groups: list[dict], plan: RunPlan,
             backend: PartsBackend, *, dtype: torch.dtype, comm: Collectives = NO_COMM,
             owner: PassOwner = NO_PASS_OWNER, values: UnitValues | None = None,
             materialize: bool = True, overlap_comm: bool = False) -> Parts:
    """The parts of ``model`` (partitioned into ``specs``, its trainable parameters in the
    optimizer's ``groups``) as ``plan`` says, over ``backend``, in the engine's order: the
    fetch pool, the units adopted into their home tiers (``values``: a checkpoint their
    parameters are read from), what steps them, the coordinator. ``materialize``: meta
    parameters get memory and their init (False: the dry run's meta model stays on meta).
    ``overlap_comm``: stage-3 gathers are issued ahead of use where the coordinator can keep
    the ranks' order (see [Note: gathers issued ahead] in zero/gather_ahead.py); the dry run
    passes the config's as the engine does (its collectives' handles fire on the simulated
    clock)."""
    fetch_pool = backend.pool(plan.fetch_pool) if plan.fetch_pool is not None else None
    units, replacements = build_units(
        model, specs, groups, backend.device, dtype, backend.manager, plan.param_tier,
        staging=fetch_pool,
        persistence_threshold=plan.sizes.persistence_threshold if plan.stage == 3 else None,
        doubled=plan.speculative, comm=comm, stage=plan.stage, values=values,
        make_unit=backend.unit_factory(), materialize=materialize)
    if comm.active:     # a timeout's story names the units of each rank's last collective
        comm.unit_names = [u.name for u in units]
    stepper = backend.stepper(units, groups, plan, fetch_pool)
    coordinator = Coordinator(units, modules_needing(model, specs), backend.manager, fetch_pool,
                              prefetch_limits(plan), stepper=stepper, owner=owner,
                              overlap_comm=overlap_comm, comm=comm)
    return Parts(units=units, replacements=replacements, fetch_pool=fetch_pool,
                 stepper=stepper, coordinator=coordinator)
