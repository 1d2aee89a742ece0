"""The step time and peak host memory of a run on a CPU-only machine (the device is the CPU, as in
this project's benches and CI), predicted from rates measured on that machine, and the constants
of the prediction fitted to measured runs.

Pure. ``tools/bench/plan_calibration.py`` measures the rates (``infinity.train.calibrate``) and
the out-of-core bench's runs, fits ``Constants`` on one model size and checks the prediction on
another held out (BENCHMARKS.md, "Plan calibration"); the CI test does the same for the 85M
main job. The sizes are the engine's own (``derive_sizes`` + ``engine_sizes`` with the direct
fetch of a CPU device, as ``infinity.engine.sizing`` calls them), the traffic is
``step_time.nvme_traffic``, the FLOPs ``shape.flops_per_token``.

Step time. Three amounts, each at its measured rate:

* compute: the forward and backward's FLOPs at ``compute_efficiency`` x the FLOP/s of the
  block's matrix products in the compute dtype (the rest of a training step: norms, attention,
  activations, autograd, the fetch copies);
* CPU Adam: the optimizer's elements at the measured parameters per second;
* NVMe: the step's reads at the read rate, then its writes at the write rate (one disk serves
  both: their times add).

Compute and the CPU Adam run on the same cores (a CPU-only machine has no other), so their times
add into one lane; the disk is the other lane. The step is ``overlap`` x the slower lane.

Peak host memory (resident set): the process's runtime (torch, transformers, infinity imported:
measured), the host pools the tier manager reserves (its host budget's holdings), the emulated
device pool (its budget), the activations autograd saves (``shape.activation_bytes`` in the
compute dtype), the gradients the early or the speculative step holds outside the budget (the
engine's allowance of two units' gradients, ``engine_sizes``), and ``rss_residual_bytes``
(the allocator's and autograd's other temporaries, fitted).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Sequence

from infinity.config import InfinityConfig
from infinity.planner.engine_sizes import EngineSizes, gradient_buffer_bytes
from infinity.planner.inputs import Hardware, ModelStats
from infinity.planner.placement import Placement
from infinity.planner.run_plan import plan_run, units_of_stats
from infinity.planner.shape import ModelShape, activation_bytes, flops_per_token
from infinity.planner.sizes import DerivedSizes
from infinity.planner.step_time import (
    OVERLAP_FACTOR,
    Link,
    adam_rate_factor,
    nvme_traffic,
    reuse_bytes,
)
from infinity.planner.tiers import Tier

__all__ = ["MachineRates", "Constants", "RunPrediction", "predict_run", "run_sizes", "fit_constants",
           "CPU_COMPUTE_EFFICIENCY", "RSS_RESIDUAL_BYTES", "HELD_GRADIENT_UNITS"]

CPU_COMPUTE_EFFICIENCY = 1.02
"""A training forward + backward's FLOP/s over those of its blocks' matrix products alone
(``infinity.train.calibrate.measure_compute``, at the run's tokens), on a CPU: fitted on the
0.49B out-of-core model (BENCHMARKS.md, "Plan calibration": the forward and backward take the
time of their matrix products at the probe's rate; norms, attention and autograd cost what the
probe's smaller working set gains)."""
RSS_RESIDUAL_BYTES = 437 << 20
"""Peak resident bytes beyond the parts ``predict_run`` names, fitted on the 0.49B model (the
same bench): the engine process's threads, modules and what the allocator keeps of the
backward's temporaries (a plain torch forward + backward keeps less; see BENCHMARKS.md). At
85M it is ~230 MiB (tests/integration/test_plan_calibration.py fits it there)."""
HELD_GRADIENT_UNITS = 1
"""Largest units' gradients (in the compute dtype, as autograd makes them) the early or the
speculative step holds outside the host budget on a CPU device at the peak: the held room's
capacity (optim/held_room.py, ``HELD_ROOM_UNITS``). It holds up to one part more when no step is
running as a part arrives (measured on the out-of-core bench: 1.0-1.7 units at the peak)."""


@dataclass(frozen=True, kw_only=True)
class MachineRates:
    """What was measured on the machine (``infinity.train.calibrate``)."""

    compute_flops_per_s: float
    """FLOP/s of one block's matrix products (forward and both backward ones) in the compute
    dtype, at the run's tokens per micro-step."""
    nvme_read_GBps: float
    """Cold O_DIRECT reads of the swap path at the engine's aio settings (1e9 B/s)."""
    nvme_write_GBps: float
    """Writes of the swap path at the engine's aio settings (1e9 B/s)."""
    adam_params_per_s: float
    """CPU Adam elements per second, all cores."""
    runtime_rss_bytes: int
    """Resident set of a process with torch, transformers and infinity imported."""
    layer_rss_bytes: int | None = None
    """Resident bytes one block adds to a forward + backward's peak, its parameters'
    gradients aside (``measure_layer_memory``); None: ``shape.activation_bytes``' count."""


@dataclass(frozen=True, kw_only=True)
class Constants:
    """What the rates do not tell, fitted to measured runs (``fit_constants``)."""

    compute_efficiency: float = CPU_COMPUTE_EFFICIENCY
    """Training forward + backward FLOP/s over the matrix products' FLOP/s."""
    overlap: float = OVERLAP_FACTOR
    """Step / the slower lane."""
    rss_residual_bytes: int = RSS_RESIDUAL_BYTES
    """Peak resident bytes beyond the named parts."""


@dataclass(frozen=True, kw_only=True)
class RunPrediction:
    """One configuration's predicted step and peak host memory, with its parts."""

    placement: Placement
    sizes: EngineSizes
    speculative: bool
    grads_held: bool
    """Autograd's gradients are held until their step (outside the host budget)."""
    flops: float
    """Forward + backward FLOPs of one optimizer step."""
    reused_bytes: int
    """Parameter bytes still fetched at each turn (not read again)."""
    nvme_read_bytes: float
    nvme_write_bytes: float
    links: tuple[Link, ...]
    lanes: dict[str, float]
    """Seconds per lane: "CPU" (compute + Adam, the same cores) and "NVMe" (reads + writes)."""
    bound_s: float
    predicted_s: float
    bottleneck: str
    rss_parts: dict[str, int]
    peak_rss_bytes: int

    products_s: float
    """The FLOPs at the measured matrix-product rate (an efficiency of 1)."""

    @property
    def compute_s(self) -> float:
        """The compute link's seconds (forward and backward alone)."""
        return next(link.seconds for link in self.links if link.name == "compute")

    def as_dict(self) -> dict:
        return {"compute_dtype": self.placement.compute_dtype,
                "early_step": self.placement.early_step, "speculative": self.speculative,
                "grads_held": self.grads_held, "flops": self.flops,
                "reused_bytes": self.reused_bytes, "nvme_read_bytes": self.nvme_read_bytes,
                "nvme_write_bytes": self.nvme_write_bytes,
                "links": {link.name: link.seconds for link in self.links}, "lanes": self.lanes,
                "bound_s": self.bound_s, "predicted_s": self.predicted_s,
                "bottleneck": self.bottleneck, "rss_parts": self.rss_parts,
                "peak_rss_bytes": self.peak_rss_bytes,
                "sizes": {k: (v.name if hasattr(v, "name") else v)
                          for k, v in dataclasses.asdict(self.sizes).items()}}


def run_sizes(cfg: InfinityConfig, stats: ModelStats, hw: Hardware,
              speculative: bool | None = None,
              derived: DerivedSizes | None = None) -> tuple[Placement, EngineSizes, bool]:
    """Where the states live, the engine's sizes and whether it speculates, for ``cfg`` on a
    CPU-only ``hw``: the run plan's (``run_plan.plan_run``, as the engine makes it).
    ``speculative`` None: as the engine decides. ``derived``: the planner's sizes for them,
    where the caller has them already."""
    plan = plan_run(cfg, hw, stats=stats, speculative=speculative, derived=derived)
    return plan.placement, plan.sizes, plan.speculative


def predict_run(cfg: InfinityConfig, stats: ModelStats, shape: ModelShape, hw: Hardware, *,
                seq_len: int, micro_batch: int, rates: MachineRates,
                constants: Constants = Constants(), speculative: bool | None = None,
                device_pool_bytes: int | None = None) -> RunPrediction:
    """Step time and peak RSS of ``cfg`` training ``stats``' model on ``hw`` (CPU-only, one
    rank), ``micro_batch`` x ``seq_len`` tokens a micro-step. ``speculative`` None: as the
    engine decides (the deferred schedule with parameters and Adam states on NVMe, when the
    disk has room for the second copies). ``device_pool_bytes``: the emulated device pool's
    peak as ``infinity plan --dry-run`` finds it (the tier manager's own, see its tests);
    None: its budget, an upper bound."""
    if hw.has_gpu:
        raise ValueError("predict_run models a CPU-only machine (the device is the CPU); plan a "
                         "GPU machine with infinity.planner.target_plan")
    if cfg.world_size != 1:
        raise ValueError(f"predict_run models one rank; world_size is {cfg.world_size}")
    lay, es, speculative = run_sizes(cfg, stats, hw, speculative)
    units = [list(u.params) for u in units_of_stats(stats)]
    accum = cfg.gradient_accumulation_steps or 1
    grads_held = lay.early_step or speculative     # optim: holds_grads on a CPU device

    # traffic: the units kept fetched at a turn are what the device pool holds beside the unit
    # being fetched and the prefetch (with a direct fetch the pool keeps all it can)
    unit_bytes = es.max_unit_bytes
    param_bytes = lay.c * lay.param_elems
    room = (es.device_budget or 0) - es.prefetch_bucket_numel * lay.c - unit_bytes
    reused = reuse_bytes(es.max_reuse_numel * lay.c, room, param_bytes) \
        if lay.stage == 3 and lay.param_tier != Tier.DEVICE else 0
    read, write = nvme_traffic(lay, es.grad_tier, accum, grads_held=grads_held, reused=reused)

    tokens = seq_len * micro_batch * accum
    flops = tokens * flops_per_token(stats.total_params, shape, seq_len)
    compute_rate = rates.compute_flops_per_s * constants.compute_efficiency
    links = [Link(name="compute", amount=flops, unit="FLOP", rate=compute_rate, per="node",
                  note=f"{constants.compute_efficiency:.0%} of the measured "
                       f"{rates.compute_flops_per_s / 1e9:.0f} GFLOP/s of the block's products "
                       f"({lay.compute_dtype})")]
    if lay.opt_tier != Tier.DEVICE or lay.single_copy:
        fmt = lay.state_format        # the rate is measured with fp32 states
        links.append(Link(name="CPU Adam", amount=lay.opt_elems, unit="param",
                          rate=rates.adam_params_per_s * adam_rate_factor(fmt), per="node",
                          note=f"measured {rates.adam_params_per_s / 1e9:.2f} G params/s"
                               + ("" if fmt.is_default else
                                  f" in fp32, x {adam_rate_factor(fmt):.2f} for {fmt.label}")))
    if read or write:
        links.append(Link(name="NVMe read", amount=read, unit="B", rate=rates.nvme_read_GBps * 1e9,
                          per="node", note=f"measured {rates.nvme_read_GBps:.2f} GB/s"))
        links.append(Link(name="NVMe write", amount=write, unit="B",
                          rate=rates.nvme_write_GBps * 1e9, per="node",
                          note=f"measured {rates.nvme_write_GBps:.2f} GB/s"))
    seconds = {link.name: link.seconds for link in links}
    lanes = {"CPU": seconds["compute"] + seconds.get("CPU Adam", 0.0),
             "NVMe": seconds.get("NVMe read", 0.0) + seconds.get("NVMe write", 0.0)}
    bottleneck = max(lanes, key=lanes.get)
    bound = lanes[bottleneck]

    # peak resident set
    max_trainable = max((sum(n for n, trainable in unit if trainable) for unit in units),
                        default=0)
    allowance = gradient_buffer_bytes(max_trainable)   # what engine_sizes budgets for them
    counted = lay.early_step or es.grad_tier == Tier.NVME or speculative   # in engine_sizes
    reserved_grad_pool = es.grad_tier == Tier.NVME and not lay.early_step
    host_pools = es.host_home_bytes + es.host_buffer_bytes
    if counted and not reserved_grad_pool:
        host_pools -= allowance        # budgeted, but held as autograd's tensors, not reserved
    held = HELD_GRADIENT_UNITS * max_trainable * lay.c if grads_held else 0
    acts = activation_bytes(shape, seq_len, micro_batch, False, lay.c)
    if rates.layer_rss_bytes is not None:     # measured per block; the logits as counted
        acts += shape.layers * (rates.layer_rss_bytes - activation_bytes(
            dataclasses.replace(shape, layers=1, vocab=0), seq_len, micro_batch, False, lay.c))
    mode = cfg.infinity.offload_activations
    # "auto" offloads when they exceed the room the engine's sizes leave (engine/
    # activation_policy.py, there from the exact count; here from this estimate)
    if mode == "nvme" or (mode == "auto" and es.activation_staging and
                          es.activation_room is not None and acts > es.activation_room):
        acts = activation_bytes(shape, seq_len, micro_batch, True, lay.c)   # one block's set
    pool = (es.device_budget or 0) if device_pool_bytes is None else device_pool_bytes
    parts = {"runtime": rates.runtime_rss_bytes, "host pools": host_pools, "device pool": pool,
             "activations": acts, "held gradients": held,
             "residual": constants.rss_residual_bytes}
    return RunPrediction(placement=lay, sizes=es, speculative=speculative, grads_held=grads_held,
                         flops=flops, reused_bytes=reused, nvme_read_bytes=read,
                         nvme_write_bytes=write, links=tuple(links), lanes=lanes, bound_s=bound,
                         predicted_s=constants.overlap * bound, bottleneck=bottleneck,
                         rss_parts=parts, peak_rss_bytes=sum(parts.values()),
                         products_s=flops / rates.compute_flops_per_s)


def fit_constants(runs: Sequence[tuple[RunPrediction, float, int]],
                  compute_alone: Sequence[tuple[RunPrediction, float]]) -> Constants:
    """Constants from measured runs of one model: ``compute_alone`` pairs a prediction with the
    seconds of the same model's forward + backward alone (plain torch, in RAM); ``runs`` pairs
    each configuration's prediction with its measured step seconds and peak RSS bytes.

    efficiency = the FLOPs at the matrix products' rate / the measured compute seconds
    (median); overlap = measured step / the slower lane at that efficiency (median); residual =
    measured peak RSS - the named parts (median)."""
    if not runs or not compute_alone:
        raise ValueError("fit_constants needs at least one run and one compute-alone measurement")
    eff = statistics.median(p.products_s / seconds for p, seconds in compute_alone)
    overlaps, residuals = [], []
    for p, step_s, rss in runs:
        cpu = p.products_s / eff + p.lanes["CPU"] - p.compute_s
        overlaps.append(step_s / max(cpu, p.lanes["NVMe"]))
        residuals.append(rss - (p.peak_rss_bytes - p.rss_parts["residual"]))
    return Constants(compute_efficiency=eff, overlap=statistics.median(overlaps),
                     rss_residual_bytes=int(statistics.median(residuals)))
