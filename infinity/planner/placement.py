"""Where each kind of state lives for a config on a machine, and its bytes there (per rank).

Byte math (N = world size; P = parameters, T = trainable parameters):

* fp32 Adam states are 12 B per trainable parameter (master 4 + m 4 + v 4), sharded over N from
  stage 1; fp32 gradients add 4 B (their home sharded from stage 1 too: each rank keeps the
  averaged gradient of the shard it steps; autograd's whole gradient of a unit is transient
  device memory); a 16-bit compute copy of the parameters adds 2 B (sharded at stage 3).
  Mixed precision: 18 B/param.
* On a CPU device with fp32 compute the fp32 master *is* the parameter and is stored once (at
  stage 3 in the deeper of the two tiers; below it in the device pool, which is host memory):
  16 B/param with gradients, not the 20 B DeepSpeed keeps (see shared/peers/DS_E2E.md). On a
  GPU the master is separate from the compute copy in fp32 too. ``state_homes`` is that rule,
  the one the engine and the plan both read.
* With the early step (the optimizer steps a unit as soon as its gradient shard arrives) the
  gradients have no home at all; only one sub-group's staging buffer exists.
* A gradient home in host memory is 2 B/param instead of 4 where it never sums anything: 16-bit
  compute, one micro-step, one rank (see [Note: the gradient home in the compute dtype]).
* The Adam states may be stored in fewer bytes (``optimizer_moments``, ``optimizer_master``;
  planner/state_format.py): m + v in 4 (bf16) or 2 (int8) B instead of 8, the int8 scales
  (8 B per 2048 elements) in host memory whatever the optimizer's tier, and a bf16 master is
  the bf16 parameter itself (single copy, no 4-byte master). Each unit takes its format by the
  optimizer's rule (``state_bytes``): a small one asked for int8 keeps fp32 moments and master.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from infinity.config import InfinityConfig
from infinity.planner.inputs import Hardware, ModelStats
from infinity.planner.state_format import (
    FP32_STATES,
    QBLOCK,
    StateFormat,
    int8_blocks,
    keeps_fp32_master,
    unit_format,
)
from infinity.planner.tiers import Tier, deeper

__all__ = ["Placement", "StateBytes", "state_bytes", "COMPONENTS", "place", "state_homes",
           "resident_bytes",
           "choose_compute_dtype",
           "compute_dtype_choice", "choose_early_step", "choose_boundary_steps",
           "gradient_home_itemsize", "separate_master_tier"]

COMPONENTS = ("params", "grads", "optimizer_states", "buffers")


@dataclass(frozen=True)
class StateBytes:
    """One rank's Adam states in their format (see planner/state_format.py), unit by unit."""

    optimizer: int
    """Bytes in the optimizer's tier: m and v in their format, and the fp32 masters kept."""
    scales: int = 0
    """Bytes of the int8 moments' scales, which stay in host memory whatever the tier."""
    kept_fp32: int = 0
    """Units asked for int8 moments that keep fp32 ones (under ``MIN_INT8_NUMEL`` elements)."""


def state_bytes(fmt: StateFormat, units: list[tuple[int, int]], *, ranks: int, sharded: bool,
                master_separate: bool, compute_itemsize: int) -> StateBytes:
    """The Adam states' bytes of one rank for ``units``, each as (trainable elements, the range
    of them this rank steps, padded as the unit's flat layout pads it): each unit takes its
    format by the optimizer's rule (``unit_format``: int8 asked of a small range keeps fp32,
    and with it an fp32 master: ``keeps_fp32_master``); the elements of each kind are shared
    over ``ranks`` when ``sharded`` (stages 1-3), as the plan's element counts are, and each
    int8 range has its scales (one fp32 per 2048 elements of m and of v)."""
    # (span, the unit's format: decided on its trainable elements, the same on every rank) ->
    # [units, trainable elements]: few keys
    by_span: dict[tuple[int, StateFormat], list[int]] = {}
    for trainable, span in units:
        if trainable > 0:
            entry = by_span.setdefault((span, unit_format([fmt], trainable)), [0, 0])
            entry[0] += 1
            entry[1] += trainable
    kinds: dict[tuple[int, bool], int] = {}
    scales = kept = 0
    for (span, unit), (count, trainable) in by_span.items():
        kept += count if fmt.moments == "int8" and unit.moments != "int8" else 0
        master = keeps_fp32_master(unit, master_separate=master_separate,
                                   compute_itemsize=compute_itemsize)
        key = (unit.moment_itemsize, master)
        kinds[key] = kinds.get(key, 0) + trainable
        if unit.moments == "int8":
            scales += count * 2 * 4 * int8_blocks(span)
    optimizer = sum((2 * itemsize + 4 * master) * (-(-elems // ranks) if sharded else elems)
                    for (itemsize, master), elems in kinds.items())
    return StateBytes(optimizer=optimizer, scales=scales, kept_fp32=kept)


@dataclass(frozen=True)
class Placement:
    """Where each kind of state lives, and how many elements of each this rank holds."""

    stage: int
    compute_dtype: str
    c: int                  # bytes per element of the compute dtype
    param_tier: Tier        # home of the compute copy of the parameters
    opt_tier: Tier          # home of m and v (and the master unless single_copy)
    single_copy: bool       # the master is the parameter, stored once: fp32 compute on a CPU
    #                         device, or a bf16 master (optimizer_master "bf16")
    early_step: bool
    param_elems: int        # per rank
    opt_elems: int          # per rank
    grad_elems: int         # per rank
    grad_itemsize: int = 4  # bytes per element of a gradient home in host memory
    grad_home: Tier | None = None   # the gradients' tier as the engine's sizes decided it
    state_format: StateFormat = FP32_STATES   # the config's (see planner/state_format.py)
    unit_states: StateBytes | None = None
    """The states' bytes unit by unit (``state_bytes``), where the run plan knew the units;
    None: from the element counts (``states``)."""
    boundary_steps: bool = False
    """The deferred schedule steps each unit in the last micro-batch's backward
    (``choose_boundary_steps``)."""

    @property
    def optimizer_state_bytes(self) -> float:
        """Bytes per trainable element of the Adam states: m and v in their format (int8
        scales included), and the fp32 master unless the parameter is its own master."""
        return self.state_format.moment_bytes_per_param() + (0 if self.single_copy else 4)

    @property
    def states(self) -> StateBytes:
        """One rank's Adam states: unit by unit where the run plan counted them, else from
        the element count at the format's bytes per element."""
        if self.unit_states is not None:
            return self.unit_states
        fmt = self.state_format
        per = 2 * fmt.moment_itemsize + (0 if self.single_copy else 4)
        scales = math.ceil(8 * self.opt_elems / QBLOCK) if fmt.moments == "int8" else 0
        return StateBytes(optimizer=per * self.opt_elems, scales=scales)

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the gradients at their home: ``grad_itemsize`` in host memory,
        float32 on NVMe (the engine's NVMe home goes through float32 slots)."""
        return self.grad_itemsize if self.grads_tier == Tier.HOST else 4

    @property
    def master_tier(self) -> Tier:
        return self.param_tier if self.single_copy else self.opt_tier

    @property
    def grads_tier(self) -> Tier | None:
        """Where the deferred schedule keeps gradients: where the engine's sizes put them
        (``grad_home``, see ``with_gradient_home``: host memory unless the host budget cannot
        hold them beside the optimizer's slots); before those sizes are known, the deepest
        the engine might use, beside offloaded Adam states (host memory when the states stay
        on the device)."""
        if self.early_step:
            return None
        if self.grad_home is not None:
            return self.grad_home
        return Tier.HOST if self.opt_tier == Tier.DEVICE else self.opt_tier

    def with_gradient_home(self, tier: Tier, itemsize: int) -> "Placement":
        """This placement with the gradients' home the engine's sizes decided
        (``EngineSizes.grad_tier`` and ``grad_home_itemsize``)."""
        return dataclasses.replace(self, grad_home=tier, grad_itemsize=itemsize)


# [Note: the gradient home in the compute dtype]
# The deferred schedule keeps each parameter's gradient at home from the backward to the step.
# With 16-bit compute, one micro-step a step and one rank, that home never sums anything: it
# receives each parameter's gradient once, as autograd made it in the compute dtype, and the
# step reads it back. A float32 home then holds the same values in twice the bytes, so it is
# kept in the compute dtype: at 85M under a 512 MiB host budget the 170 MB it frees is a third
# of the budget, and the optimizer's slots take it (larger sub-groups: the step's 2.2 GB of
# Adam-state I/O ran at 60% of the disk's rate through 2 MiB pieces). Where a home sums --
# gradient accumulation over micro-steps, the average over ranks -- it stays float32, as
# DeepSpeed's default ``grad_accum_dtype`` does; and a home on NVMe stays float32 (its pool's
# slots are float32). The one sum left: a parameter used twice in one backward (a tied
# weight) has its two gradients added in the compute dtype, as autograd itself adds them for a
# 16-bit parameter; so are two backwards before one step (a torch-style loop that accumulates
# by calling backward twice).
def gradient_home_itemsize(compute_itemsize: int, accumulation_steps: int,
                           world_size: int) -> int:
    """Bytes per element of a gradient home in host memory: the compute dtype's where the home
    never sums (16-bit compute, one micro-step, one rank), else 4 (float32); see [Note: the
    gradient home in the compute dtype]."""
    if compute_itemsize < 4 and accumulation_steps <= 1 and world_size <= 1:
        return compute_itemsize
    return 4


def separate_master_tier(optimizer_tier: Tier, cpu_device: bool) -> Tier:
    """Where the optimizer's states live when the fp32 master is separate from the compute copy:
    on a CPU device, "none" (the device tier) is host memory -- the emulated device pool holds
    the units' compute copies only -- so the engine and the planner both count them there."""
    return Tier.HOST if cpu_device and optimizer_tier == Tier.DEVICE else optimizer_tier


def state_homes(cfg: InfinityConfig, compute_dtype: str,
                cpu_device: bool) -> tuple[Tier, Tier, bool]:
    """(parameter tier, optimizer tier, single copy) for ``cfg`` computing in
    ``compute_dtype`` on a CPU device or a GPU: the one rule for the states' home tiers and
    whether the master is a copy of its own, read by ``place`` for the run plan
    (planner/run_plan.py), which the engine builds from. Single
    copy: fp32 on a CPU device, where the master is the parameter (DESIGN.md "fp32 on CPU"), stored in the
    deeper of the two tiers at stage 3; so is a bf16 master (``optimizer_master`` "bf16" with
    bf16 compute; ``check_state_format`` refuses it off a CPU device, where the planner only
    projects it)."""
    z = cfg.zero
    single = (cpu_device and compute_dtype == "fp32") or (
        compute_dtype == "bf16" and cfg.infinity.optimizer_master == "bf16")
    opt_tier = Tier.from_offload_device(z.offload_optimizer.device)
    param_tier = Tier.from_offload_device(z.offload_param.device) if z.stage == 3 else Tier.DEVICE
    if single and z.stage == 3:
        param_tier = deeper(param_tier, opt_tier)
    if not single:
        opt_tier = separate_master_tier(opt_tier, cpu_device=cpu_device)
    return param_tier, opt_tier, single


def choose_compute_dtype(cfg: InfinityConfig, hw: Hardware) -> str:
    """The config's compute dtype, or for "auto" the one this machine computes fastest in."""
    return compute_dtype_choice(cfg, hw)[0]


def compute_dtype_choice(cfg: InfinityConfig, hw: Hardware) -> tuple[str, str]:
    """The compute dtype and one line saying why. An explicit ``infinity.compute_dtype`` always
    wins. "auto": on a GPU, bf16/fp16 as ``bf16.enabled``/``fp16.enabled`` say (else fp32); on a
    CPU-only machine bf16 where the CPU multiplies bf16 natively (``hw.cpu_bf16``; ~3x faster than
    fp32 there, ~45x slower elsewhere: see [Note: bf16 on CPUs] in infinity/base/cpu_bf16.py)
    unless fp16 loss scaling is asked for or ``bf16.enabled`` is false, else fp32."""
    asked = cfg.infinity.compute_dtype
    if asked != "auto":
        return asked, f"infinity.compute_dtype is {asked!r} in the config"
    why = f" ({hw.cpu_bf16_reason})" if hw.cpu_bf16_reason else ""
    if not hw.has_gpu:
        if not hw.cpu_bf16:
            return "fp32", f"auto: CPU-only, and the CPU has no native bf16{why}"
        if cfg.fp16.enabled:
            return "fp32", ("auto: CPU-only; fp16.enabled asks for fp16, which CPUs multiply far "
                            "slower than fp32, and bf16 would contradict it")
        if cfg.bf16.enabled is False:
            return "fp32", "auto: CPU-only, and the config's bf16.enabled is false"
        return "bf16", f"auto: CPU-only, and the CPU multiplies bf16 natively{why}"
    if cfg.bf16.enabled:
        return "bf16", "auto: GPU, bf16.enabled"
    if cfg.fp16.enabled:
        return "fp16", "auto: GPU, fp16.enabled"
    return "fp32", "auto: GPU, neither bf16 nor fp16 enabled"


def choose_early_step(cfg: InfinityConfig, dtype: str) -> bool:
    """Whether a unit's optimizer step runs as soon as its gradients arrive (one micro-batch a
    step; with several, "auto" and "on" mean ``choose_boundary_steps``)."""
    if (cfg.gradient_accumulation_steps or 1) > 1:
        return False
    if cfg.infinity.early_step != "auto":
        return cfg.infinity.early_step == "on"
    return _steps_need_no_whole_gradient(cfg, dtype)


def _steps_need_no_whole_gradient(cfg: InfinityConfig, dtype: str) -> bool:
    """A unit may be stepped before the whole model's gradient exists: the partitioned
    (offloaded) optimizer, no clipping (global norm), no fp16 (overflow check)."""
    return (cfg.zero.offload_optimizer.device != "none" and cfg.gradient_clipping == 0
            and not cfg.fp16.enabled and dtype != "fp16")


def choose_boundary_steps(cfg: InfinityConfig, dtype: str) -> bool:
    """Whether, under gradient accumulation, the last micro-batch's backward steps each unit as
    its gradient completes (see [Note: the last micro-batch steps early] in
    optim/boundary_steps.py): what ``early_step`` "auto" or "on" asks for where gradients must
    be kept, under the early step's own conditions (no clipping, no fp16 overflow check, an
    offloaded optimizer)."""
    if cfg.infinity.early_step == "off" or (cfg.gradient_accumulation_steps or 1) <= 1:
        return False
    return _steps_need_no_whole_gradient(cfg, dtype)


def place(cfg: InfinityConfig, stats: ModelStats, hw: Hardware,
          cpu_device: bool | None = None) -> Placement:
    """Where the states of ``stats``' model live under ``cfg`` on ``hw``; ``cpu_device``: the
    model computes on the CPU (None: where ``hw`` has no GPU). The compute dtype follows the
    machine either way (a model left on a GPU machine's CPU keeps the GPU's rules, as
    ``bf16.enabled`` asks)."""
    z, n = cfg.zero, cfg.world_size
    dtype = choose_compute_dtype(cfg, hw)
    param_tier, opt_tier, single = state_homes(
        cfg, dtype, cpu_device=not hw.has_gpu if cpu_device is None else cpu_device)
    shard = lambda elems, from_stage: -(-elems // n) if z.stage >= from_stage else elems  # noqa: E731
    c = 4 if dtype == "fp32" else 2
    return Placement(stage=z.stage, compute_dtype=dtype, c=c,
                     param_tier=param_tier, opt_tier=opt_tier, single_copy=single,
                     early_step=choose_early_step(cfg, dtype),
                     param_elems=shard(stats.total_params, 3), opt_elems=shard(stats.trainable_params, 1),
                     grad_elems=shard(stats.trainable_params, 1),
                     grad_itemsize=gradient_home_itemsize(c, cfg.gradient_accumulation_steps or 1,
                                                          n),
                     state_format=StateFormat(cfg.infinity.optimizer_moments,
                                              cfg.infinity.optimizer_master),
                     boundary_steps=choose_boundary_steps(cfg, dtype))


def resident_bytes(lay: Placement, scales: bool = True) -> dict[tuple[str, Tier], int]:
    """Bytes of params, grads and optimizer states at their home tiers (``scales``: with the
    int8 moments' scales, optimizer states in host memory)."""
    out: dict[tuple[str, Tier], int] = {}

    def add(component: str, tier: Tier | None, nbytes: int) -> None:
        if tier is not None and nbytes:
            out[(component, tier)] = out.get((component, tier), 0) + nbytes
    states = lay.states
    add("params", lay.param_tier, lay.c * lay.param_elems)
    add("optimizer_states", lay.opt_tier, states.optimizer)
    if scales:
        add("optimizer_states", Tier.HOST, states.scales)
    add("grads", lay.grads_tier, lay.grad_bytes * lay.grad_elems)
    return out
