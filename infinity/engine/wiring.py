"""How the engine's parts are made from the config and the model, before it wires them.

Why a module of its own: the facade (engine.py) holds the training calls; what decides where
each state lives, turns the partitioned model into units in their home tiers and makes the
activation swapper is construction, read once when a run starts and not again.
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol

import torch
from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes
from infinity.comm.collectives import NO_COMM, Collectives
from infinity.config import InfinityConfig
from infinity.engine.activation_policy import AutoActivationOffload
from infinity.engine.sizing import (
    EngineSizes,
    grouped_params,
    host_budget_note,
    param_group_of,
)
from infinity.planner.engine_sizes import ACTIVATION_STAGING_BYTES
from infinity.storage.manager import TierManager
from infinity.storage.protocols import SlotPool, StorageBackend
from infinity.storage.tiers import Tier
from infinity.zero.activation_swap import ActivationSwapper
from infinity.zero.materialize import materialize_params
from infinity.zero.partition import UnitSpec
from infinity.zero.protocols import UnitValues
from infinity.zero.unit import Unit, flat_nbytes

log = get_logger("engine")


def tier_manager(config: InfinityConfig, device: torch.device, sizes: EngineSizes,
                 nvme_path: str | None, rank: int = 0,
                 least_host_budget: int | None = None) -> TierManager:
    """The tier manager with the budgets ``sizes`` gives, its swap space reserved up front."""
    manager = TierManager(
        host_budget=MemoryBudget("host", sizes.host_budget,
                                 host_budget_note(config, device, sizes, least_host_budget)),
        device_budget=MemoryBudget("device", sizes.device_budget),
        nvme_path=nvme_path, aio_config=config.aio, device=device,
        swap_check=config.infinity.swap_check, rank=rank)
    manager.nvme_reserve_bytes = sizes.nvme_bytes
    return manager


class UnitFactory(Protocol):
    """How ``build_units`` makes a unit: ``Unit`` itself, or the dry run's unit on the meta
    device (whose direct reads the plan decides, not where its absent bytes lie)."""

    def __call__(self, index: int, name: str, module: nn.Module,
                 named_params: list[tuple[str, nn.Parameter, int]], dtype: torch.dtype,
                 device: torch.device, *, comm: Collectives, shards: int,
                 params_sharded: bool) -> Unit: ...


def build_units(model: nn.Module, specs: list[UnitSpec], groups: list[dict], device: torch.device,
                compute_dtype: torch.dtype, manager: StorageBackend, param_tier: Tier, *,
                staging: SlotPool | None, persistence_threshold: int | None,
                doubled: bool, comm: Collectives = NO_COMM, stage: int = 3,
                values: UnitValues | None = None, make_unit: UnitFactory = Unit,
                materialize: bool = True,
                ) -> tuple[list[Unit], dict[nn.Parameter, nn.Parameter]]:
    """The units of ``specs``, each adopted into ``param_tier`` (persistent on the device when
    ``persistence_threshold`` is None, below stage 3, or the unit is no larger), and the
    parameters that were materialized (meta or zero.Init-released ones) as {old: new}; the
    ``groups``' params are replaced in place. With several ranks each unit is cut in shards
    (stages 1-3) whose parameters are sharded at stage 3 (see [Note: shards] in zero/unit.py).
    ``values``: where the parameters it provides take their first values (a pretrained
    checkpoint), read into each unit as it is adopted instead of initialised, so each home is
    written once. ``make_unit``: how a unit is made (see ``UnitFactory``); ``materialize``:
    meta parameters get memory and their init (the dry run's meta model keeps them on meta)."""
    shards = comm.world_size if stage >= 1 else 1
    group_of = param_group_of(groups)
    units: list[Unit] = []
    replacements = {}
    # full shapes by id: units built before a later one's init runs are released by then
    full_shapes = {id(p): p.shape for spec in specs for _, p in spec.params}
    # with ``values`` a unit's home write is left in flight while the next unit is read, so
    # reading the files overlaps writing the homes (two units' device memory at most);
    # ``pending`` waits for the last such write and releases its unit
    pending = None
    warming = _warm_blocks(specs[1:3], group_of, compute_dtype, shards, manager) \
        if values is not None else None
    try:
        for index, spec in enumerate(specs):
            provided = values.provides if values is not None else None
            # values each rank made on its own (a model built outside zero.Init)
            own_values = values is None and comm.active and any(
                p.device.type != "meta" and p.numel() for _, p in spec.params)
            made = materialize_params(model, spec.params, device, full_shapes, provided) \
                if materialize else []
            # drawn here, by each rank's own generator (zero.Init's, a new head beside a
            # checkpoint's): a unit whole on every rank (stages 0-2) takes rank 0's, as with
            # the user's own values; at stage 3 each rank's shard is one model's part already
            drawn = comm.active and stage < 3 and any(
                provided is None or not provided(name) for name, _, _ in made)
            for name, old, new in made:
                replacements[old] = new
                full_shapes[id(new)] = old.shape
                group_of[new] = group_of.pop(old, -1)
            spec.params = [(n, replacements.get(p, p)) for n, p in spec.params]
            # a parameter with no elements has nothing to step: kept as frozen
            named = grouped_params(spec.params, group_of)
            unit = make_unit(index, spec.name, spec.module, named, compute_dtype, device,
                             comm=comm, shards=shards, params_sharded=stage == 3)
            # A unit stays on the device when all of it is below the persistence threshold.
            persistent = persistence_threshold is None or unit.numel <= persistence_threshold
            if pending is not None and not manager.device_cache.fits(unit.nbytes):
                previous, pending = pending, None     # no room for two units: it lands first
                previous()
            finish = unit.adopt(manager, param_tier, persistent, staging=staging,
                                doubled=doubled and unit.has_trainable, values=values,
                                write_behind=values is not None,
                                from_rank0=own_values or drawn)
            units.append(unit)
            previous, pending = pending, finish
            if previous is not None:
                previous()
    finally:
        if warming is not None:
            warming.join()
        if pending is not None:
            pending()
    for group in groups:
        group["params"] = [replacements.get(p, p) for p in group["params"]]
    return units, replacements


def _warm_blocks(specs: list[UnitSpec], group_of: dict, dtype: torch.dtype, shards: int,
                 manager: TierManager) -> threading.Thread | None:
    """Device memory for the units of ``specs`` (the next ones to be placed), allocated on a
    helper thread while the first unit is read: on a CPU device fresh memory is slow to
    populate (huge pages), and a load otherwise waits for it unit after unit until the device
    cache holds the blocks the pipeline cycles through."""
    cache = manager.device_cache
    if not cache.enabled or not specs:
        return None
    sizes = [flat_nbytes(grouped_params(spec.params, group_of), dtype, shards) for spec in specs]

    def run() -> None:
        for size in sizes:
            try:
                if not cache.warm(size, "a unit's device memory (load)"):
                    return
            except Exception as exc:  # noqa: BLE001 - an optimisation: the attach allocates
                log.debug("warming device memory failed: %s", exc)
                return

    thread = threading.Thread(target=run, name="warm-device-memory", daemon=True)
    thread.start()
    return thread


def activation_swapper(config: InfinityConfig, manager: TierManager, units: list[Unit],
                       model: nn.Module, *, sizes: EngineSizes | None = None,
                       compute_dtype: torch.dtype | None = None, has_swap: bool = True,
                       keep_outermost: Callable[[nn.Module, int], None] | None = None,
                       ) -> AutoActivationOffload | None:
    """The swapper of saved activations for ``infinity.offload_activations``: "nvme" swaps
    every training forward's (naming what the step keeps in memory beside them past the host
    budget), "auto" those of a batch that does not fit in what the host budget
    leaves (``sizes.activation_room``; see engine/activation_policy.py), "none" gives None."""
    section = config.infinity
    mode = section.offload_activations
    if mode == "none":
        return None
    swapper = None
    if mode == "nvme" or (has_swap and sizes is not None and sizes.activation_staging):
        # parameters are views of their unit's flat buffer while fetched (empty when released)
        storages = {u.flat.untyped_storage()._cdata for u in units}
        storages |= {p.untyped_storage()._cdata for p in model.parameters()}
        swapper = ActivationSwapper(
            manager, min_bytes=section.activation_min_bytes,
            window_bytes=section.activation_window,
            is_parameter_storage=lambda t: t.untyped_storage()._cdata in storages)
    if mode == "nvme":
        log.info("saved activations of >= %s go to NVMe (%s of them in memory at a time)",
                 format_bytes(section.activation_min_bytes), format_bytes(section.activation_window))
    dtype = compute_dtype if compute_dtype is not None else \
        (units[0].dtype if units else torch.float32)
    room = sizes.activation_room if sizes is not None else None
    device = units[0].device if units else torch.device("cpu")
    return AutoActivationOffload(
        model, swapper, room if room is not None else 0, dtype.itemsize,
        # autograd's gradient of a unit counts against the room unless sizes reserved it
        largest_unit_numel=0 if sizes is not None and sizes.gradient_reserve_bytes else
        max((u.trainable_numel for u in units), default=0),
        on_device=device.type != "cpu" or room is None,
        offloaded_mmap_threshold=section.offloaded_mmap_threshold,
        kept_mmap_threshold=section.malloc_mmap_threshold, keep_outermost=keep_outermost,
        no_swap="no swap directory: set zero_optimization.offload_param or offload_optimizer "
                ".nvme_path" if not has_swap else
                f"the host budget leaves no room beside the engine's pools for the swapper's "
                f"{format_bytes(ACTIVATION_STAGING_BYTES)} of staging and the step's activation "
                f"windows, or only by halving the optimizer's sub-groups (slower steps)",
        always=mode == "nvme")
