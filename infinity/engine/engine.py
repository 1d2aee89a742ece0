"""The engine: what users touch. Wires config, tiers, units, coordinator and optimizer.

``engine, optimizer, _, scheduler = infinity.initialize(model=..., config=ds_config)`` then
``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()``: a DeepSpeed script ports
by changing the import. This module only wires; each concern has its own (DESIGN.md "Layers").
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from infinity.base.interrupts import deferred_interrupts
from infinity.base.log import get_logger
from infinity.base.malloc_tuning import set_mmap_threshold, trim
from infinity.comm.group import RankInfo
from infinity.config import InfinityConfig
from infinity.engine.checkpointing import CheckpointCalls, warn_if_unsaveable
from infinity.engine.deepspeed_api import DeepSpeedEngineAccessors
from infinity.engine.guards import (
    BACKWARD_AFTER_BOUNDARY_STEPS, BOUNDARY_SET_AFTER_LAST_BACKWARD, SECOND_EARLY_BACKWARD,
    SPECULATIVE_SWAP_ROOM,
    ZERO_GRAD_AFTER_BOUNDARY_STEPS, ZERO_GRAD_UNDER_EARLY_STEP,
    check_cycle_discardable, check_edit_before_step, check_open, check_pass_start,
    check_same_on_every_rank, pass_hooks, schedule_label, step_settings,
    warn_if_hyperparameters_moved,
)
from infinity.engine.module_state import exact_from_source
from infinity.engine.model_methods import (
    model_device, place_buffers, route_module_methods, unroute_module_methods,
)
from infinity.engine.client_optimizer import check_scheduler_groups, rebind_scheduler, take_over
from infinity.engine.param_groups import optimizer_groups
from infinity.engine.monitor import StepReport
from infinity.engine.pass_owner import EnginePassOwner
from infinity.engine.ranks import join as join_ranks_and_config
from infinity.engine.passes import PassHooks, cast_floating, cast_inputs
from infinity.engine.sizing import (
    COMPUTE_DTYPES,
    EngineSizes,
    engine_plan,
    gradient_home_dtype,
    warn_second_nvme_path,
)
from infinity.engine.step_stats import step_stats
from infinity.engine.assembly import assemble
from infinity.engine.wiring import activation_swapper, tier_manager
from infinity.optim.loss_scaler import LossScaler
from infinity.optim.partitioned import PartitionedOptimizer
from infinity.optim.schedules import (build_scheduler, check_scheduler_builds,
                                      check_user_scheduler)
from infinity.planner.run_plan import PoolPlan, RunPlan
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.preflight import SwapPathError
from infinity.storage.tiers import Tier
from infinity.zero.external_hint import raise_with_external_parameter_hint
from infinity.zero.init import (
    EXTERNAL_PARAMS_ATTR,
    check_not_released,
    guard_released,
    register_engine,
    released_on_failure,
    remember_released,
    unregister_engine,
)
from infinity.zero.partition import partition
from infinity.zero.protocols import UnitValues, Wait
from infinity.zero.unit import Unit

log = get_logger("engine")


class Engine(DeepSpeedEngineAccessors, CheckpointCalls):
    """Trains ``model`` with its states in tiers, per the DeepSpeed-style ``config``."""

    def __init__(self, model: nn.Module, model_parameters: Iterable | None,
                 config: str | Path | Mapping[str, Any] | InfinityConfig | None,
                 lr_scheduler: Any = None, process_group: Any = None,
                 auto_values: Mapping[str, Any] | None = None, optimizer: Any = None,
                 weights: UnitValues | None = None) -> None:
        """``weights``: where parameters take their first values instead of the model's
        (``infinity.from_pretrained``'s checkpoint), read into each unit as it is placed."""
        self._weights = weights
        if optimizer is None or getattr(lr_scheduler, "optimizer", None) is not optimizer:
            check_user_scheduler(lr_scheduler)   # one on the optimizer passed moves over
        self.ranks: RankInfo
        self.ranks, self.config, self.comm = join_ranks_and_config(
            config, process_group, model_device(model), auto_values)
        if self.config.infinity.mmap_threshold_in_use is not None:
            set_mmap_threshold(self.config.infinity.mmap_threshold_in_use)
        self.module = model
        check_not_released(model)
        self.device = model_device(model)
        # every rank must build the same engine: a config or model that differs is named
        check_same_on_every_rank(self.comm, self.config, model)
        place_buffers(model, self.device, self.comm)   # Init-built: on the CPU; rank 0's values
        specs = partition(model, list(self.config.infinity.unit_modules or []) or None)
        # the config's optimizer, or the one passed, taken over (engine/client_optimizer.py)
        groups, self.optimizer_defaults = optimizer_groups(model, model_parameters, self.config,
                                                           optimizer)
        self._client_optimizer = optimizer
        check_scheduler_groups(lr_scheduler, optimizer, len(groups))   # before any weight moves
        check_scheduler_builds(self.config, groups, self.optimizer_defaults, lr_scheduler)
        # every decision and size, made once (planner/run_plan.py); the parts read it
        self.plan: RunPlan = engine_plan(self.config, specs, groups, self.device, self.comm)
        plan = self.plan
        self.compute_dtype = COMPUTE_DTYPES[plan.compute_dtype]
        self.stage = stage = self.config.zero.stage
        self.micro_steps = self.global_steps = 0
        self.forward_running = False
        self._boundary_set: bool | None = None      # set_gradient_accumulation_boundary
        self._backward_was_boundary = False         # the last backward ran as the cycle's last
        self.param_tier, self.optimizer_tier = param_tier, optimizer_tier = \
            plan.param_tier, plan.optimizer_tier
        self.master_separate = plan.master_separate
        self.early_step = plan.early_step
        self.direct_fetch = plan.direct_fetch      # a CPU device reads NVMe into its memory
        self.speculative = plan.speculative
        self.sizes: EngineSizes = plan.sizes
        nvme_path = self.config.zero.swap_path    # a "cpu" section's path is not used
        warn_second_nvme_path(self.config, nvme_path, param_tier, optimizer_tier)
        # the monitors first: a section enabled without its library stops before any file
        self.report = StepReport(self.config, self.ranks.rank)
        self.manager = tier_manager(self.config, self.device, self.sizes, nvme_path,
                                    self.ranks.rank, self.plan.least_host_budget)
        try:
            with released_on_failure(model):     # a retry on the emptied model is refused
                self._build(model, specs, groups, lr_scheduler)
        except BaseException as exc:
            with contextlib.suppress(Exception):    # the build's own error is the one raised
                self.close()    # hooks, routed methods, the step stream (a model left hooked)
            if isinstance(exc, SwapPathError) and self.speculative and "free space" in str(exc):
                raise SwapPathError(SPECULATIVE_SWAP_ROOM.format(exc=exc)) from exc
            raise
        log.info("engine ready on %s: stage %d, compute %s, params on %s, optimizer on %s, %d "
                 "units, %s schedule; holding %s", self.device, stage,
                 str(self.compute_dtype).replace("torch.", ""), param_tier.name,
                 optimizer_tier.name, len(self.units), schedule_label(self.optimizer),
                 self.manager.describe())

    # -- construction ----------------------------------------------------------------------
    def _build(self, model: nn.Module, specs, groups: list[dict], lr_scheduler: Any) -> None:
        owner = EnginePassOwner(self)       # the optimizer's and the coordinator's
        parts = assemble(model, specs, groups, self.plan, _EngineBackend(self, owner, self._weights),
                         dtype=self.compute_dtype, comm=self.comm, owner=owner,
                         values=self._weights, overlap_comm=self.config.zero.overlap_comm)
        self._weights = None     # read: its files are the caller's to close
        self.units, replacements = parts.units, parts.replacements
        self.fetch_pool, self.optimizer = parts.fetch_pool, parts.stepper
        self.coordinator = parts.coordinator
        self.coordinator.detached_reads.enabled = self.config.infinity.detached_reads == "hold"
        route_module_methods(model, self)
        self.coordinator.install()
        self._passes = PassHooks(model, self._begin_pass, self._end_pass,
                                 self.coordinator.keep_outermost)
        # "auto" chose bf16 for this CPU (infinity/base/cpu_bf16.py): fp32 inputs are cast for
        # the user, who asked for no 16-bit dtype (a GPU's bf16.enabled leaves that to the user)
        self._cast_hook = cast_inputs(model, self.compute_dtype) if (
            self.config.infinity.compute_dtype == "auto" and self.device.type == "cpu"
            and self.compute_dtype != torch.float32) else None
        for module in model.modules():      # register_external_parameter before initialize
            external = module.__dict__.get(EXTERNAL_PARAMS_ATTR, [])
            external[:] = [replacements.get(p, p) for p in external]
            for param in external:
                self.hook_external_parameter(module, param)
        self.activation_swapper = activation_swapper(
            self.config, self.manager, self.units, self.module, sizes=self.sizes,
            compute_dtype=self.compute_dtype, has_swap=self.manager.nvme_path is not None,
            keep_outermost=self.coordinator.keep_outermost)
        register_engine(self)
        lr_scheduler = rebind_scheduler(lr_scheduler, self._client_optimizer, self.optimizer)
        take_over(self._client_optimizer, self.optimizer)
        self.lr_scheduler = build_scheduler(self.config, self.optimizer, lr_scheduler)
        warn_if_unsaveable(self.lr_scheduler)
        self._step_started = None
        self._last_stats: dict[str, float] = {}
        fp16 = self.config.fp16     # the loss scale, the skipping of steps that overflow
        self.loss_scaler = self.optimizer.scaler = LossScaler(fp16) if fp16.enabled else None
        self.skipped_steps = self._backwards_since_step = 0
        self._warned_hyper_moved = False

    # -- training API ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def _check_open(self, what: str) -> None:
        check_open(self, what)   # closed, a load failed part-way, a step failed (guards.py)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; the pass around it is the root module's hooks' (see
        engine/passes.py), so calling the model itself does the same."""
        self._check_open("forward")
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = cast_floating((args, kwargs), self.compute_dtype)
        try:
            return self.module(*args, **kwargs)
        except BaseException as exc:
            self._passes.abandon_cut_short(exc)    # a Ctrl-C skipped the pass's end
            raise_with_external_parameter_hint(exc, "forward", self.stage)
            raise

    def _begin_pass(self) -> tuple[bool, contextlib.ExitStack]:
        """Before a forward: returns whether it trains, and the activation swapper's hooks."""
        check_pass_start(self)      # open, and nothing frozen at initialize unfrozen since
        if self._step_started is None:
            self._step_started = time.perf_counter()
            self.manager.counters.reset()
            self.optimizer.timers.reset()
            self.comm.counters.reset()
        self._void_speculation()
        self.coordinator.owner.settle_failed_backward()    # a loss.backward() that raised
        self.coordinator.begin_forward()
        training = torch.is_grad_enabled()   # [Note: a forward under grad trains] (guards.py)
        hooks = pass_hooks(self, training)
        self._pass_started = time.perf_counter()
        self.forward_running = True       # a part's cast in it is the model's own (model_methods)
        return training, hooks

    def _end_pass(self, state: tuple[bool, contextlib.ExitStack],
                  error: BaseException | None) -> None:
        training, hooks = state
        self.forward_running = False
        if error is not None:
            self.comm.report_failure(error, "forward")    # the other ranks name this one
            try:
                hooks.__exit__(type(error), error, error.__traceback__)
            finally:
                self.coordinator.abandon_pass()   # post-hooks did not run: units stay fetched
            return
        hooks.close()
        if training:
            self.coordinator.end_forward()
            self.report.add_time("forward", time.perf_counter() - self._pass_started)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss``, scaled by 1/gradient_accumulation_steps unless ``scale_wrt_gas``
        is False, as DeepSpeed does; returns the loss so scaled (DeepSpeed's return value)."""
        self._check_open("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss)}"
                             + (f" with shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        if self.optimizer.early_step and self._backwards_since_step:
            raise RuntimeError(SECOND_EARLY_BACKWARD.format(call="engine.backward()"))
        if self.optimizer.boundary.pending:
            raise RuntimeError(BACKWARD_AFTER_BOUNDARY_STEPS.format(call="engine.backward()"))
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        scaled = loss.detach()
        self.report.add_loss(scaled)
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        started = self._begin_backward()   # voids a speculation: a second backward in a cycle
        # a backward that steps its units is whole or not run: a Ctrl-C waits until it is
        # recorded whole (then raised: a backward before its step(), which a save refuses)
        steps = self.optimizer.early_step or self.optimizer.boundary.now
        with deferred_interrupts("the backward, which steps each unit") if steps \
                else contextlib.nullcontext():
            try:
                with self.coordinator.tracked_backward():
                    loss.backward(retain_graph=retain_graph)
            except BaseException as exc:
                self.comm.report_failure(exc, "backward")
                try:    # the rest's gradients never come: the cycle is dropped (pass_owner.py)
                    self.coordinator.owner.abandon_failed_backward()
                finally:
                    self.report.add_time("backward", time.perf_counter() - started)
                raise_with_external_parameter_hint(exc, "backward", self.stage)
                raise
            self._end_backward(started)
        return scaled

    def _begin_backward(self) -> float:
        """Before a backward, ``engine.backward``'s or a direct ``loss.backward()``'s (see
        ``EnginePassOwner.begin_untracked_backward``): the optimizer starts a backward of this
        micro-step with the loss scale its gradients carry. Returns when it started."""
        self._void_speculation()
        self._backward_was_boundary = self.is_gradient_accumulation_boundary()
        self.optimizer.begin_backward(self._backward_was_boundary, self.loss_scale)
        self._hyper_at_backward = self.optimizer.hyperparameters() \
            if self.optimizer.early_step or self.optimizer.boundary.now else None
        return time.perf_counter()

    def _end_backward(self, started: float) -> None:
        """After a backward that completed (either kind): its time, the activations its graph
        dropped, the optimizer's end of backward, one more backward in this cycle."""
        self._release_dropped_activations()
        self.report.add_time("backward", time.perf_counter() - started)
        self.optimizer.end_backward()
        self._backwards_since_step += 1

    def _release_dropped_activations(self) -> None:
        """The backward dropped its graph's swapped activations: free their swap extents now
        rather than at the next forward (see ``ActivationSwapper.release_forgotten``)."""
        if self.activation_swapper is not None:
            self.activation_swapper.release_forgotten()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients of the backwards since the last step (none right after one),
        as torch's zero_grad() does (``optimizer.zero_grad()`` comes here too); see [Note: what
        zero_grad discards] in engine/guards.py for what it keeps and refuses."""
        self._check_open("zero_grad")
        self.coordinator.owner.settle_failed_backward()
        if self.optimizer.boundary.pending:
            raise RuntimeError(ZERO_GRAD_AFTER_BOUNDARY_STEPS)
        if not self._backwards_since_step:
            return                      # nothing since the last step: the cycle is kept
        if self.optimizer.early_step:
            raise RuntimeError(ZERO_GRAD_UNDER_EARLY_STEP)
        if self.optimizer.holds_cycle_gradients():
            check_cycle_discardable(self.micro_steps, self.gradient_accumulation_steps())
            self.optimizer.discard_cycle_gradients()
            self._drop_rolled_back()

    def record_loss(self, loss: torch.Tensor) -> None:
        """Count ``loss`` in this step's reported loss (the monitors' ``train_loss``, the
        ``steps_per_print`` line) when its backward was ``loss.backward()`` called directly
        (as Hugging Face's Trainer does), which the engine cannot see: pass the loss that was
        backpropagated, already divided by the accumulation steps. ``engine.backward``
        records its own."""
        self.report.add_loss(loss)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count a micro-step; at the accumulation boundary step the optimizer and scheduler
        (``lr_kwargs`` go to the scheduler's step, as DeepSpeed passes them). A Ctrl-C meanwhile
        is raised once the step is whole (see infinity/base/interrupts.py)."""
        with deferred_interrupts("the optimizer step"), self._reported("step"):
            self._step(lr_kwargs, step_scheduler=True)

    def _step_from_optimizer(self) -> None:
        """``optimizer.step()`` in a torch-style loop: the engine's step, whose scheduler the
        loop steps itself (as it would a torch scheduler)."""
        with deferred_interrupts("the optimizer step"), self._reported("step"):
            self._step(None, step_scheduler=False)

    @contextlib.contextmanager
    def _reported(self, where: str):
        """An error escaping ``where`` is told to the other ranks (whose next collective fails
        naming this rank); a step that completes withdraws an earlier report the caller
        caught (see [Note: lost rank] in comm/watchdog.py)."""
        try:
            yield
        except BaseException as exc:
            self.comm.report_failure(exc, where)
            raise
        self.comm.carried_on()

    def _step(self, lr_kwargs: dict[str, Any] | None, step_scheduler: bool) -> None:
        self._check_open("step")
        self.coordinator.owner.settle_failed_backward()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self._backwards_since_step and not self._backward_was_boundary:
            raise RuntimeError(BOUNDARY_SET_AFTER_LAST_BACKWARD)
        self.micro_steps += 1
        self._backwards_since_step = 0
        if not boundary:
            return
        # a cycle ended early (set_gradient_accumulation_boundary) counts as a whole one
        self.micro_steps += -self.micro_steps % self.gradient_accumulation_steps()
        started = time.perf_counter()
        lrs = [h["lr"] for h in warn_if_hyperparameters_moved(self)]   # the rates it uses
        with self.comm.every_rank("step()"):    # a rank gone on without it: named at once
            self.comm.check_same_sequence(f"optimizer step {self.global_steps + 1}",
                                          settings=step_settings(lrs, self.get_mom()))
        # units a deferred step still waits for (the forward did not use them) run first
        self.coordinator.step_waiting_units(self.optimizer.waiting_units())
        self.optimizer.owner_step()     # torch's step hooks and schedulers see it
        stuck = False
        if self.loss_scaler is not None:
            stuck = self.loss_scaler.update(self.optimizer.overflow)
        self.skipped_steps += int(self.optimizer.overflow)
        if self.optimizer.early_step:
            self.coordinator.reap()
        else:
            self._drop_rolled_back()     # a speculative step that clipping or overflow undid
            # persistent units are never fetched again: their deferred steps run now (the rest
            # run when the next forward fetches them)
            self.coordinator.step_waiting_units(
                [u for u in self.optimizer.waiting_units() if u.persistent])
            self.coordinator.reap()
        if not self.optimizer.overflow:     # the weights changed in place: a graph recorded
            # before refuses another backward, as torch's (its writes are not torch ops)
            torch.autograd.graph.increment_version(
                [e.param for u in self.units for e in u.trainable_entries()])
        if step_scheduler and self.lr_scheduler is not None and not self.optimizer.overflow:
            self.lr_scheduler.step(**(lr_kwargs or {}))   # a skipped step does not move it
        self.global_steps += 1
        self._record_stats()
        self.report.add_time("step", time.perf_counter() - started)
        self.report.after_step(step=self.global_steps, samples=self.global_samples, lr=lrs,
                               loss_scale=self.loss_scale, grad_norm=self.get_global_grad_norm(),
                               skipped=self.skipped_steps, mom=self.get_mom())
        if self.config.infinity.mmap_threshold_in_use is not None:
            trim()
        if stuck:
            raise FloatingPointError(
                f"the gradients overflowed (inf or NaN) at the minimum loss scale "
                f"(fp16.min_loss_scale = {self.loss_scaler.min_scale:g}), so the scale cannot come "
                "down and every step from here would be skipped; DeepSpeed stops the run here "
                "too. The step was skipped (nothing changed). The model has likely diverged: "
                "lower the learning rate or check the data, and resume from the last checkpoint")

    def _record_stats(self) -> None:
        now = time.perf_counter()
        step_s = now - (self._step_started or now)
        self._step_started = None
        self._last_stats = step_stats(step_s, self.manager, self.optimizer.timers,
                                      self.coordinator.fetch_stats, self.comm.counters)

    def _keep_forward_change(self, unit: Unit) -> None:
        """A module's forward changed ``unit``'s parameters in place (``nn.Embedding`` with
        ``max_norm`` renormalises the rows it looks up): keep the change, as torch does, by
        writing the device copy to every home once the unit's earlier writes have landed."""
        self._settle()
        unit.write_home(self.manager, self.fetch_pool)
        self.optimizer.reload_master(unit)

    def _void_speculation(self) -> None:
        """The model is about to be read before ``step()``: speculated parameters must not be
        seen (see [Note: speculative step] in optim/speculation.py)."""
        if self.optimizer.speculation_pending:
            self.optimizer.void_speculation()
            self._drop_rolled_back()

    def _drop_rolled_back(self) -> None:
        """Release the units whose steps finished in a roll-back, then drop the device copies
        that hold rolled-back values (the next fetch reads the current home)."""
        self.coordinator.reap()
        self.coordinator.discard(self.optimizer.take_rolled_back())

    def flush(self) -> None:
        """Finish the last optimizer step: run the deferred steps still waiting for their units
        to be fetched and wait for every write in flight (the early step returns once every
        unit's parameters are updated and its writes land behind the next forward), then
        release the units they held. For measurements and for reading the swap files."""
        if getattr(self, "coordinator", None) is None:
            return
        self._check_open("flush")
        self.coordinator.step_waiting_units(self.optimizer.waiting_units())
        self._settle()
        self.coordinator.make_whole()   # replicated units gather their step's shards

    def _settle(self) -> None:
        """Wait for the optimizer's writes in flight and release the units they held."""
        self.coordinator.reap(Wait.ALL)

    def step_stats(self) -> dict[str, float]:
        """Timings and bytes of the last optimizer step (see ``_record_stats`` for keys)."""
        return dict(self._last_stats)

    def hook_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """``module``'s forward uses ``param`` of another module: fetch its unit around it
        (``infinity.zero.register_external_parameter``)."""
        unit = next((u for u in self.units if any(e.param is param for e in u.params)), None)
        if unit is not None:
            self.coordinator.hook_module(module, [unit.index])

    def pin_unit(self, unit: Unit, modifying: bool = False) -> None:
        """Fetch ``unit`` and keep it fetched until ``unpin_unit`` (GatheredParameters): a step
        waiting for it runs on the fetch, and no write of the last step is left in flight (a
        change written home must not race it). ``modifying``: the caller changes its values."""
        self._check_open("GatheredParameters")
        check_edit_before_step(self.optimizer.early_step, self._backwards_since_step, modifying)
        self._void_speculation()
        self._settle()
        self.coordinator.pin(unit)
        self._settle()

    def unpin_unit(self, unit: Unit, modified: bool, source_rank: int | None = None,
                   exact: dict | None = None) -> None:
        """Undo ``pin_unit``; with ``modified`` write the values back to every copy first (the
        unit is unpinned even when that fails). With several ranks the values are rank
        ``source_rank``'s (DeepSpeed's ``modifier_rank``), sent to every rank first.
        ``exact``: entry -> the full-precision values written into it (a state dict's), which
        a separate fp32 master takes as they are ([Note: a change by hand reaches the
        master] in optim/master_seed.py)."""
        try:
            if modified:
                exact = {**unit.take_rebound_values(), **(exact or {})}
                if self.comm.active:
                    source = 0 if source_rank is None else source_rank
                    self.comm.broadcast(unit.flat, source)
                    exact = exact_from_source(self.comm, unit, exact, source)
                self.optimizer.reload_master(unit, exact)
                unit.write_home(self.manager, self.fetch_pool)
                torch.autograd.graph.increment_version([e.param for e in unit.params])  # as torch
        finally:
            self.coordinator.unpin(unit)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale now (1 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def close(self) -> None:
        """Remove hooks, free states and delete this run's swap files (once; again is a no-op)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        unregister_engine(self)
        if getattr(self, "report", None) is not None:
            self.report.close()
        unroute_module_methods(self.module)
        try:
            if getattr(self, "coordinator", None) is not None:
                if getattr(self, "_passes", None) is not None:
                    # a forward cut short by a Ctrl-C: its swapper hooks and units go too
                    self._passes.abandon_open(RuntimeError("the engine was closed"))
                    self._passes.remove()
                if getattr(self, "_cast_hook", None) is not None:
                    self._cast_hook.remove()
                self.coordinator.drain()
                self.coordinator.release_all()
                self.coordinator.remove()
                remember_released(u for u in self.units if not u.persistent)
                guard_released(self.module)
        finally:
            try:
                if getattr(self, "activation_swapper", None) is not None:
                    self.activation_swapper.close()
                if getattr(self, "optimizer", None) is not None:
                    self.optimizer.close()
                for unit in getattr(self, "units", None) or ():    # the parameters' homes: an
                    if unit.param_store is not None:    # engine kept in a variable held them
                        unit.param_store.free()
            finally:
                self.manager.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _EngineBackend:
    """The engine's backend for the assembly (engine/assembly.py): the tier manager's bytes,
    host buffer pools, real units and the partitioned optimizer."""

    def __init__(self, engine: Engine, owner: EnginePassOwner, values: UnitValues | None) -> None:
        self.engine, self.owner, self.values = engine, owner, values
        self.manager = engine.manager
        self.device = engine.device

    def pool(self, plan: PoolPlan) -> BufferPool:
        return BufferPool(self.manager, plan.slot_bytes, plan.count, plan.name)

    def unit_factory(self) -> type[Unit]:
        return Unit

    def stepper(self, units: list[Unit], groups: list[dict], plan: RunPlan,
                fetch_pool: BufferPool | None) -> PartitionedOptimizer:
        engine = self.engine
        return PartitionedOptimizer(
            units, groups, self.manager, optimizer_tier=plan.optimizer_tier,
            grad_tier=plan.grad_tier,
            grad_dtype=gradient_home_dtype(plan.sizes, engine.compute_dtype),
            early_step=plan.early_step, sub_group_numel=plan.sizes.sub_group_numel,
            master_separate=plan.master_separate, staging_pool=fetch_pool,
            adamw_mode=engine.optimizer_defaults["adamw_mode"],
            defaults=engine.optimizer_defaults,
            speculation=engine.config.infinity.speculative_step if plan.speculative else "off",
            comm=engine.comm, shard_states=plan.stage >= 1, values=self.values,
            pools=plan.optimizer, clip_norm=engine.config.gradient_clipping, owner=self.owner,
            boundary_steps=plan.boundary_steps)
