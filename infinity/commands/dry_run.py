"""``infinity plan --dry-run``: the engine's own parts run training steps of a model built on
the meta device, over a byte-free backend on a simulated clock.

The parts are built by the engine's own assembly (engine/assembly.py ``assemble``) from the
run plan the engine would build from (planner/run_plan.py): ``zero.partition`` (the units),
``engine.wiring.build_units`` (flat layouts, shards, persistence, homes, speculative copies),
the plan's pools, and ``zero.coordinator.Coordinator`` (the hooks, the recorded traces,
prefetch within the bucket and live limits, keeping units for reuse, releases), driven in the
engine's order of calls around a step (``Engine.forward``/``backward``/``step``). The backend
is what differs: ``infinity.simulate`` (``simulate.backend.SimBackend`` is what the assembly
asks of it, as ``engine.engine._EngineBackend`` is for the engine): the bytes (meta tensors,
no swap files: ``simulate.storage``, which implements storage/protocols.py as the tier manager
does), the disk, the collectives (``simulate.collectives``: with ``overlap_comm``, passed as
the engine passes it, a stage-3 unit's all-gather is issued ahead at the use of the unit
before it and compute waits on its handle, which fires on the clock), the optimizer's step
stream (``simulate.stepper``: its schedule, not its kernels) and, on a GPU, the host <->
device copies (``simulate.copies``: parameters up -- a host-homed unit's as soon as prefetch
picks it, an NVMe-homed one's once its read is over -- gradients down, each direction on its
lane at the link's rate, ordered by their events as the engine's), on a clock
(``simulate.clock``) whose rates are the target's (or this machine's, assumed).

This module is the command's part: the plan's setups and rates, building the parts over the
simulated backend, running the passes in the engine's order, and the report.

The step it predicts is the training thread's time: its compute and its waits on the other
resources (NVMe, copies, collectives, the CPU Adam, slots), i.e. the schedule's critical path,
not the busiest resource times an overlap factor as ``planner.step_time`` predicts.

Not simulated: the step stream's sub-groups (a unit's step is one job), the updated parameters
copied back to a GPU that holds them (the optimizer off the device, parameters on it), the CPU
shared by compute and the CPU Adam on a CPU-only machine, activation swapping (its staging is
counted), a gradient buffer taken outside the pool, the accumulation chunk, and a GPU's
training thread running ahead of its kernels (compute holds the thread here: a wait the thread
makes, e.g. for the next unit's read at an ahead gather, stalls the compute after it).

Compute time: ``simulate.compute.SimCompute`` at ``DryRunRates.compute_flops_per_s`` (each
``nn.Linear`` call's FLOPs, each block's attention, a unit's backward twice its forward).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infinity.base.sizes import format_bytes
from infinity.commands.dry_run_trace import busy_seconds, hidden_share
from infinity.config import InfinityConfig
from infinity.engine.assembly import assemble
from infinity.engine.ranks import collective_bucket_bytes
from infinity.engine.sizing import COMPUTE_DTYPES, gradient_home_dtype
from infinity.planner.engine_sizes import EngineSizes
from infinity.planner.placement import Placement
from infinity.planner.run_plan import RunPlan, plan_run
from infinity.planner.shape import ModelShape
from infinity.simulate.backend import SimBackend
from infinity.simulate.clock import SimClock
from infinity.simulate.collectives import SimCollectives
from infinity.simulate.compute import SimCompute
from infinity.simulate.copies import D2H, H2D, SimCopies
from infinity.simulate.storage import META, SimManager
from infinity.zero.partition import partition

__all__ = ["DryRunRates", "DryRunSetup", "DryRunReport", "StepTrace", "dry_run", "meta_llama",
           "COMPUTE_DTYPES"]


@dataclass(frozen=True, kw_only=True)
class DryRunRates:
    """The simulated clock's rates (per rank; the disk per node divided by its ranks)."""

    compute_flops_per_s: float
    nvme_read_GBps: float
    nvme_write_GBps: float
    adam_params_per_s: float
    """The CPU Adam with fp32 states (the stepper scales it for the run's state format)."""
    net_GBps: float = 0.0
    """Collectives, per rank (ring): only with several ranks."""
    pcie_GBps: float = 0.0
    """Host <-> device copies, each direction, per rank (its GPU's link): needed for a GPU
    device; on a CPU device copies are free and immediate, as the engine's are."""
    host_memory_GBps: float = 0.0
    """The host's memory bandwidth, per rank: the rate of the gradient adds into resident
    host homes (0: they cost nothing)."""


@dataclass(frozen=True, kw_only=True)
class DryRunSetup:
    """What the plan decided (the run plan the engine would build from), and the units."""

    plan: RunPlan
    unit_modules: tuple[str, ...] | None = None

    @property
    def config(self) -> InfinityConfig:
        return self.plan.config

    @property
    def placement(self) -> Placement:
        return self.plan.placement

    @property
    def sizes(self) -> EngineSizes:
        return self.plan.sizes

    @property
    def speculative(self) -> bool:
        return self.plan.speculative

    @property
    def device_is_cpu(self) -> bool:
        """The device is the CPU (direct fetch, the device cache, held gradients)."""
        return self.plan.device_is_cpu


@dataclass
class StepTrace:
    """One simulated step."""

    seconds: float
    io_wait_s: float
    nvme_read_bytes: int
    nvme_write_bytes: int
    comm_bytes: int
    events: list[tuple[str, int]]
    """The coordinator's (kind, unit) of this step, forward then backward then the step."""
    phase_ends: dict[str, int]
    """Index in ``events`` where "forward" and "backward" ended."""
    start: float = 0.0
    """When it began on the simulated clock (seconds; it ended ``seconds`` later)."""


@dataclass
class DryRunReport:
    units: list[dict[str, Any]]
    steps: list[StepTrace]
    peak: dict[str, int]
    """Peak bytes per tier: "host" and "device" (the budgets' peaks, device including the
    cache's kept blocks on a CPU device), "device_in_use", "nvme", "held_gradients"."""
    budgets: dict[str, int | None]
    analytical_s: float | None = None
    notes: list[str] = field(default_factory=list)
    spans: list[tuple[str, float, float, str]] = field(default_factory=list)
    """Every resource's busy intervals, (resource, start, end, what), on the simulated clock:
    the timeline (commands/dry_run_trace.py writes it as a Chrome trace or a picture)."""

    def busy_s(self, step: int = -1) -> dict[str, float]:
        """Seconds each resource was busy within a step (the last by default)."""
        return busy_seconds(self.spans, self.steps[step].start,
                            self.steps[step].start + self.steps[step].seconds)

    def hidden_shares(self, step: int = -1) -> dict[str, float | None]:
        """Each copy row's share of busy time within a step (the last by default) hidden behind
        compute (None: no copies; a CPU device's are free and immediate)."""
        start = self.steps[step].start
        end = start + self.steps[step].seconds
        return {row: hidden_share(self.spans, row, start, end) for row in (H2D, D2H)}

    def as_dict(self, first: int = 24) -> dict[str, Any]:
        names = [u["name"] for u in self.units]
        last = self.steps[-1]
        return {
            "units": self.units, "peak_bytes": self.peak, "budgets": self.budgets,
            "steps": [{"simulated_s": s.seconds, "io_wait_s": s.io_wait_s,
                       "nvme_read_bytes": s.nvme_read_bytes,
                       "nvme_write_bytes": s.nvme_write_bytes, "comm_bytes": s.comm_bytes,
                       "events": len(s.events)} for s in self.steps],
            "order": {phase: [f"{kind} {names[uid]}" for kind, uid in events[:first]]
                      for phase, events in _phases(last).items()},
            "simulated_step_s": last.seconds, "analytical_step_s": self.analytical_s,
            "busy_s": self.busy_s(), "hidden_behind_compute": self.hidden_shares(),
            "notes": self.notes}

    def render(self, first: int = 12) -> str:
        names = [u["name"] for u in self.units]
        last = self.steps[-1]
        lines = [f"dry run: {len(self.units)} units on the meta device, "
                 f"{len(self.steps)} steps simulated (the last one shown)"]
        for phase, events in _phases(last).items():
            shown = ", ".join(f"{kind} {names[uid]}" for kind, uid in events[:first])
            more = f", ... ({len(events) - first} more)" if len(events) > first else ""
            lines.append(f"  {phase:8s} {shown}{more}")
        lines.append("  peak per rank: " + ", ".join(
            f"{tier} {format_bytes(b)}" for tier, b in self.peak.items()))
        lines.append(f"  per step: NVMe read {format_bytes(last.nvme_read_bytes)}, write "
                     f"{format_bytes(last.nvme_write_bytes)}, collectives "
                     f"{format_bytes(last.comm_bytes)}; I/O wait {last.io_wait_s:.2f} s")
        analytic = f"{self.analytical_s:.2f} s" if self.analytical_s is not None else "-"
        busy = self.busy_s()
        lines.append(f"  step time: simulated {last.seconds:.2f} s (the schedule's critical path: "
                     f"compute {busy['compute']:.2f} s + waits {busy['compute waits']:.2f} s), "
                     f"analytical {analytic}")
        lines.append("  busy in the step: " + ", ".join(
            f"{row} {seconds:.2f} s" for row, seconds in busy.items() if seconds))
        hidden = {row: share for row, share in self.hidden_shares().items() if share is not None}
        if hidden:
            lines.append("  copies hidden behind compute: " + ", ".join(
                f"{row} {share:.0%}" for row, share in hidden.items()))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _phases(step: StepTrace) -> dict[str, list[tuple[str, int]]]:
    f, b = step.phase_ends["forward"], step.phase_ends["backward"]
    return {"forward": step.events[:f], "backward": step.events[f:b], "step": step.events[b:]}


def meta_llama(model_kwargs: dict[str, Any]) -> nn.Module:
    """A transformers ``LlamaForCausalLM`` of ``model_kwargs`` on the meta device."""
    import transformers

    cfg = transformers.LlamaConfig(**model_kwargs)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def dry_run(model: nn.Module, setup: DryRunSetup, rates: DryRunRates, *, seq_len: int,
            micro_batch: int, steps: int = 2, shape: ModelShape | None = None,
            instant: bool = False, analytical_s: float | None = None,
            events: list[list[tuple[str, int]]] | None = None,
            accumulate: int = 1) -> DryRunReport:
    """Simulate ``steps`` training steps of ``model`` (on the meta device) under ``setup``,
    each of ``accumulate`` micro-batches (forward and backward) before the optimizer's step,
    as the engine runs them: the step's time is all of them. ``instant``: steps cost nothing
    (see ``simulate.stepper``). A step's events and phase ends are its last micro-batch's
    forward and backward after those of the others."""
    if accumulate < 1:
        raise ValueError(f"dry_run(accumulate={accumulate}): micro-batches a step must be >= 1")
    cfg, lay, es = setup.config, setup.placement, setup.sizes
    world = cfg.world_size
    dtype = COMPUTE_DTYPES[lay.compute_dtype]
    clock = SimClock(spans=[])
    if not setup.device_is_cpu and rates.pcie_GBps <= 0:
        raise ValueError(f"a dry run on a GPU device needs its host <-> device link's rate: "
                         f"DryRunRates.pcie_GBps is {rates.pcie_GBps}")
    copies = SimCopies(clock, 0.0 if setup.device_is_cpu else rates.pcie_GBps * 1e9)
    manager = SimManager(es.host_budget, es.device_budget, clock=clock,
                         read_Bps=rates.nvme_read_GBps * 1e9, write_Bps=rates.nvme_write_GBps * 1e9,
                         device_is_cpu=setup.device_is_cpu, copies=copies)
    comm = SimCollectives(world, clock, rates.net_GBps * 1e9,
                          gather_bucket_bytes=collective_bucket_bytes(cfg)[0])
    compute = SimCompute(clock, rates.compute_flops_per_s)
    plan = setup.plan
    specs = partition(model, list(setup.unit_modules or cfg.infinity.unit_modules or []) or None)
    backend = SimBackend(manager, comm, compute, adam_params_per_s=rates.adam_params_per_s,
                         grad_dtype=gradient_home_dtype(es, dtype), instant=instant,
                         direct=plan.direct_fetch, host_add_Bps=rates.host_memory_GBps * 1e9)
    # one param group of every trainable parameter: the dry run has no optimizer settings
    groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    # ``overlap_comm`` as the engine passes it: stage-3 gathers issued ahead of use
    parts = assemble(model, specs, groups, plan, backend, dtype=dtype, comm=comm,
                     materialize=False, overlap_comm=cfg.zero.overlap_comm)
    units, fetch_pool, stepper = parts.units, parts.fetch_pool, parts.stepper
    comm.unit_names = [u.name for u in units]
    coordinator = parts.coordinator
    coordinator.install()
    compute.install(model, specs, tokens=seq_len * micro_batch, seq_len=seq_len,
                    hidden=shape.hidden if shape is not None else None)
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=META)
    mask = torch.ones(micro_batch, 1, seq_len, seq_len, dtype=torch.bool, device=META)

    traces: list[StepTrace] = []
    for _ in range(steps):
        coordinator.events = log = []
        manager.counters.reset()
        comm_before = comm.counters.sent_bytes
        start, wait_before = clock.now, clock.io_wait_s
        for micro in range(accumulate):
            compute.begin_step()     # a backward costs twice its own micro-batch's forward
            coordinator.begin_forward()
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            coordinator.end_forward()
            forward_end = len(log)
            stepper.begin_backward(boundary=micro == accumulate - 1)
            with coordinator.tracked_backward():
                out.loss.backward()
            stepper.end_backward()
            backward_end = len(log)
        # Engine._step: units a deferred step waits for that the forward did not use, the
        # optimizer's step, then the reaping
        coordinator.step_waiting_units(stepper.waiting_units())
        stepper.step(coordinator.forward_order(), units)
        if not stepper.early_like:
            coordinator.step_waiting_units([u for u in stepper.waiting_units() if u.persistent])
        coordinator.reap()
        traces.append(StepTrace(seconds=clock.now - start, io_wait_s=clock.io_wait_s - wait_before,
                                nvme_read_bytes=manager.counters.nvme_read_bytes,
                                nvme_write_bytes=manager.counters.nvme_write_bytes,
                                comm_bytes=comm.counters.sent_bytes - comm_before,
                                events=log, phase_ends={"forward": forward_end,
                                                        "backward": backward_end},
                                start=start))
        if events is not None:
            events.append(list(log))
    coordinator.events = None
    notes = []
    if fetch_pool is not None and fetch_pool.low == 0:
        notes.append("every fetch slot was in use at some point (prefetch waited for slots)")
    return DryRunReport(
        units=[{"name": u.name, "numel": u.numel, "nbytes": u.nbytes, "persistent": u.persistent}
               for u in units],
        steps=traces,
        peak={"host": manager.host_budget.peak, "device": manager.device_budget.peak,
              "device_in_use": manager.device_cache.peak_in_use, "nvme": manager.nvme_bytes,
              "held_gradients": stepper.held_peak},
        budgets={"host": es.host_budget, "device": es.device_budget},
        analytical_s=analytical_s, notes=notes, spans=clock.spans or [])



# ---- the plan's setups (``infinity plan --dry-run``) ------------------------------------------
LOCAL_PROBE_HIDDEN = 1024
LOCAL_PROBE_TOKENS = 512
"""This machine's dry run measures its compute rate on one block's matrix products at most
this wide and this many tokens (``infinity.train.calibrate.measure_compute``): a fraction of a
second whatever the model, at the rate of matrices large enough to run at a CPU's speed. A fixed
rate was 2.3-5.8x off here, and bf16 runs ~6x fp32 on a CPU with AMX."""
LOCAL_NVME_GBPS = 2.0
"""This machine's dry run: the swap path's read and write GB/s assumed (``infinity nvme-tune``
measures them)."""


def target_setup(memory, target, workload) -> tuple[DryRunSetup, DryRunRates]:
    """The dry run of a target plan's chosen config (``planner.rank_memory.RankMemory``): one
    rank, its GPU at the plan's MFU, its share of the node's NVMe and CPU Adam (cores or memory
    bandwidth, as the analytical step counts it), the ring's bandwidth for the collectives."""
    from infinity.planner.step_time import LINK_EFFICIENCY, adam_rate_factor, cpu_adam_rate

    ranks = target.gpus_per_node
    setup = DryRunSetup(plan=memory.plan,
                        unit_modules=("Linear",) if memory.units_split else None)
    rates = DryRunRates(
        compute_flops_per_s=target.gpu.peak_tflops * 1e12 * target.mfu,
        nvme_read_GBps=target.nvme_read_GBps / ranks, nvme_write_GBps=target.nvme_write_GBps / ranks,
        # DryRunRates holds fp32 states' rate: the stepper applies the format's factor
        adam_params_per_s=cpu_adam_rate(memory.placement, target)[0]
        / adam_rate_factor(memory.placement.state_format) / ranks,
        net_GBps=target.collective_GBps * LINK_EFFICIENCY,
        pcie_GBps=target.gpu.pcie_GBps * LINK_EFFICIENCY,
        host_memory_GBps=target.host_memory_GBps / ranks)
    return setup, rates


def local_compute_rate(shape, compute_dtype: str, tokens: int) -> float:
    """This CPU's FLOP/s for a block's matrix products in ``compute_dtype`` (measured now, on
    at most a ``LOCAL_PROBE_HIDDEN``-wide block at ``LOCAL_PROBE_TOKENS`` tokens)."""
    from infinity.train.calibrate import measure_compute

    hidden = min(shape.hidden, LOCAL_PROBE_HIDDEN) if shape is not None else LOCAL_PROBE_HIDDEN
    ratio = shape.intermediate / shape.hidden if shape is not None else 4
    probe = measure_compute(hidden=hidden, intermediate=max(1, round(hidden * ratio)),
                            tokens=max(1, min(tokens, LOCAL_PROBE_TOKENS)),
                            dtype=compute_dtype, min_s=0.2)
    return probe["flops_per_s"]


def local_setup(cfg: InfinityConfig, stats, hw, shape=None,
                tokens: int = LOCAL_PROBE_TOKENS) -> tuple[DryRunSetup, DryRunRates]:
    """The dry run of a config on this (CPU-only) machine: its compute rate measured
    (``local_compute_rate``), the disk's and CPU Adam's assumed."""
    from infinity.planner.calibration import CPU_COMPUTE_EFFICIENCY
    from infinity.planner.step_time import CPU_ADAM_PARAMS_PER_CORE

    if hw.has_gpu:
        raise ValueError("--dry-run for this machine simulates a CPU-only one; on a GPU machine "
                         "describe it with the target flags (--gpus, --gpu, ...)")
    setup = DryRunSetup(plan=plan_run(cfg, hw, stats=stats))
    measured = local_compute_rate(shape, setup.plan.compute_dtype, tokens)
    rates = DryRunRates(compute_flops_per_s=measured * CPU_COMPUTE_EFFICIENCY,
                        nvme_read_GBps=LOCAL_NVME_GBPS, nvme_write_GBps=LOCAL_NVME_GBPS,
                        adam_params_per_s=CPU_ADAM_PARAMS_PER_CORE * hw.cpu_cores)
    return setup, rates


def local_analytical_s(cfg: InfinityConfig, stats, shape, hw, rates: DryRunRates,
                       workload) -> float | None:
    """``planner.calibration.predict_run``'s step at the dry run's rates (None: no shape)."""
    from infinity.planner.calibration import CPU_COMPUTE_EFFICIENCY, MachineRates, predict_run

    if shape is None:
        return None
    machine = MachineRates(compute_flops_per_s=rates.compute_flops_per_s / CPU_COMPUTE_EFFICIENCY,
                           nvme_read_GBps=rates.nvme_read_GBps,
                           nvme_write_GBps=rates.nvme_write_GBps,
                           adam_params_per_s=rates.adam_params_per_s, runtime_rss_bytes=0)
    return predict_run(cfg, stats, shape, hw, seq_len=workload.seq_len,
                       micro_batch=workload.micro_batch, rates=machine).predicted_s
