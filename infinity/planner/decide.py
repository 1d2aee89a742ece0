"""The decision path for a target machine: one device -> data parallel -> ZeRO-1 -> ZeRO-2 ->
ZeRO-3 -> optimizer offloaded to CPU -> parameters to CPU -> NVMe, the first rung that fits,
and why each rung above it does not; or, when none fits, what to add (GPUs, host memory, disk,
GPU memory) for one to fit.

Each rung is tried as the engine would run it (``rank_memory``): activations without
checkpointing first, then with it (when the workload allows "auto"); at stage 3, the model's
default units first, then one unit per parameter (``infinity.unit_modules: ["Linear"]``) when a
whole block is too large for the GPU. A rung is chosen only when nothing is over: the plan never
recommends a config its own checks contradict. Nor one the engine refuses: a rung where the
config's Adam state format cannot run (``run_plan.state_format_refusal``: formats with the
optimizer on the GPU, a bf16 master on a GPU) does not fit, for that reason; a bf16 master on
GPUs is planned only as a projection (``project_gpu_master``), which recommends no config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.inputs import ModelStats
from infinity.planner.placement import place
from infinity.planner.rank_memory import RankMemory, rank_memory
from infinity.planner.run_plan import state_format_refusal
from infinity.planner.shape import ModelShape
from infinity.planner.target import Target, Workload
from infinity.planner.tiers import Tier

__all__ = ["Rung", "Decision", "RUNGS", "decide", "candidate_config", "TARGET_SWAP_DIR",
           "format_refusal", "try_rung", "rung_number"]

TARGET_SWAP_DIR = "/local_nvme"
"""The swap directory written into a target's ds_config when none is given (DeepSpeed's docs'
name for a local NVMe mount): a path on the target, not on this machine."""

RUNGS: tuple[tuple[str, int, str, str], ...] = (
    ("stage 0: the whole model on each GPU (one device, or plain data parallel)", 0, "none", "none"),
    ("ZeRO-1: optimizer states sharded over the GPUs", 1, "none", "none"),
    ("ZeRO-2: optimizer states and gradients sharded", 2, "none", "none"),
    ("ZeRO-3: parameters sharded too", 3, "none", "none"),
    ("ZeRO-3, optimizer states offloaded to CPU", 3, "none", "cpu"),
    ("ZeRO-3, parameters and optimizer states on CPU", 3, "cpu", "cpu"),
    ("ZeRO-Infinity: optimizer states on NVMe, parameters on CPU", 3, "cpu", "nvme"),
    ("ZeRO-Infinity: parameters and optimizer states on NVMe", 3, "nvme", "nvme"),
)
"""(what it is, stage, offload_param.device, offload_optimizer.device), shallowest first."""


@dataclass(frozen=True, kw_only=True)
class Rung:
    """One rung of the path as tried."""

    label: str
    memory: RankMemory
    """The variant that fits, or the last one tried (every remedy applied) when none does."""
    tried: int
    """Variants tried (checkpointing on/off, units split or not)."""

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def why(self) -> str:
        """One line: what fits, or the first reason it does not."""
        m = self.memory
        remedies = [r for r, on in (("activation checkpointing", m.checkpointing),
                                    ("one unit per parameter", m.units_split)) if on]
        with_ = f" (with {' and '.join(remedies)})" if remedies else ""
        if m.fits:
            return (f"fits{with_}: {format_bytes(m.device_total)} per GPU, "
                    f"{format_bytes(m.node_host)} host and {format_bytes(m.node_nvme)} NVMe per node")
        return f"does not fit{', even' + with_ if with_ else ''}: " + "; ".join(m.problems)


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The path for a model on a target: every rung tried, the chosen one, what to add."""

    stats: ModelStats
    shape: ModelShape
    target: Target
    workload: Workload
    rungs: tuple[Rung, ...]
    chosen: RankMemory | None
    """The shallowest rung that fits; None: infeasible."""
    additions: tuple[str, ...]
    """When infeasible: each way to make it fit (more nodes, host memory, NVMe, GPU memory)."""
    project_gpu_master: bool = False
    """A bf16 master was planned on the GPUs though the engine refuses it there for now: a
    projection (no config is recommended)."""

    @property
    def feasible(self) -> bool:
        return self.chosen is not None


def candidate_config(base: InfinityConfig, target: Target, workload: Workload, stage: int,
                     param: str, opt: str, nvme_path: str | None) -> InfinityConfig:
    """``base`` with a rung's stage and offload devices, the target's 16-bit compute type and
    world size, and the workload's batch shape."""
    path = nvme_path or TARGET_SWAP_DIR
    z = base.zero
    zero = dataclasses.replace(
        z, stage=stage, overlap_comm=stage == 3,
        offload_param=dataclasses.replace(z.offload_param, device=param,
                                          nvme_path=path if param == "nvme" else None),
        offload_optimizer=dataclasses.replace(z.offload_optimizer, device=opt,
                                              nvme_path=path if opt == "nvme" else None))
    fp16 = dataclasses.replace(base.fp16, enabled=target.gpu.dtype == "fp16")
    bf16 = dataclasses.replace(base.bf16, enabled=target.gpu.dtype == "bf16")
    inf = dataclasses.replace(base.infinity, compute_dtype="auto")
    return dataclasses.replace(
        base, zero=zero, fp16=fp16, bf16=bf16, infinity=inf, world_size=target.world_size,
        train_batch_size=workload.micro_batch * workload.gradient_accumulation_steps * target.world_size,
        train_micro_batch_size_per_gpu=workload.micro_batch,
        gradient_accumulation_steps=workload.gradient_accumulation_steps)


def format_refusal(cfg: InfinityConfig, stats: ModelStats, target: Target,
                   project_gpu_master: bool = False) -> tuple[str, str] | None:
    """Why the engine would refuse ``cfg``'s Adam state format on ``target``'s GPUs, as
    (a few words, the whole message), or None (``run_plan.state_format_refusal``)."""
    if cfg.infinity.optimizer_moments == "fp32" and cfg.infinity.optimizer_master == "fp32":
        return None
    lay = place(cfg, stats, target.hardware(None), cpu_device=False)
    return state_format_refusal(cfg, lay, False, project_gpu_master=project_gpu_master)


def rung_number(memory: RankMemory) -> int | None:
    """The position (1-based) in RUNGS of a memory's stage and offload devices."""
    z = memory.candidate.zero
    for i, (_, stage, param, opt) in enumerate(RUNGS, 1):
        if (stage, param, opt) == (z.stage, z.offload_param.device, z.offload_optimizer.device):
            return i
    return None


def try_rung(base: InfinityConfig, stats: ModelStats, shape: ModelShape, target: Target,
             workload: Workload, label: str, stage: int, param: str, opt: str,
             nvme_path: str | None, project_gpu_master: bool = False) -> Rung:
    """One rung as the engine would run it: checkpointing off then on (as the workload allows),
    the default units then one per parameter; the first variant that fits, else the last."""
    cfg = candidate_config(base, target, workload, stage, param, opt, nvme_path)
    refusal = format_refusal(cfg, stats, target, project_gpu_master)
    if refusal is not None:
        # the engine would refuse the config at start: the rung cannot be chosen (its bytes,
        # for the record, are those of the fp32 formats)
        plain = dataclasses.replace(cfg, infinity=dataclasses.replace(
            cfg.infinity, optimizer_moments="fp32", optimizer_master="fp32"))
        memory = rank_memory(plain, stats, shape, target, workload,
                             checkpointing=workload.activation_checkpointing == "on")
        label_ = f"{cfg.infinity.optimizer_moments} moments, {cfg.infinity.optimizer_master} master"
        memory = dataclasses.replace(memory, candidate=cfg, problems=(
            f"the engine refuses the Adam state format ({label_}) here: {refusal[0]}",))
        return Rung(label=label, memory=memory, tried=0)
    lay = place(cfg, stats, target.hardware(None), cpu_device=False)
    if stage == 3 and lay.param_tier is not Tier.from_offload_device(param):
        # a single copy (a bf16 master, projected) lives in the deeper of the two tiers: this
        # rung is a deeper one's layout, which that rung plans under its own name
        memory = rank_memory(cfg, stats, shape, target, workload,
                             checkpointing=workload.activation_checkpointing == "on",
                             project_gpu_master=project_gpu_master)
        memory = dataclasses.replace(memory, problems=(
            f"the parameters are their own master (a bf16 master), kept with the optimizer "
            f"states on {lay.param_tier}: a deeper rung's layout",))
        return Rung(label=label, memory=memory, tried=0)
    checkpointing = {"off": (False,), "on": (True,), "auto": (False, True)}[workload.activation_checkpointing]
    splits = [False]
    if stage == 3 and stats.param_numels is not None and stats.largest_param < stats.largest_unit_params:
        splits.append(True)
    last = None
    tried = 0
    for split in splits:
        for ckpt in checkpointing:
            last = rank_memory(cfg, stats, shape, target, workload, checkpointing=ckpt,
                               split_units=split, project_gpu_master=project_gpu_master)
            tried += 1
            if last.fits:
                return Rung(label=label, memory=last, tried=tried)
    assert last is not None
    return Rung(label=label, memory=last, tried=tried)


def _path(base: InfinityConfig, stats: ModelStats, shape: ModelShape, target: Target,
          workload: Workload, nvme_path: str | None, stop_at_fit: bool = True,
          ladder: tuple[tuple[str, int, str, str], ...] = RUNGS,
          project_gpu_master: bool = False) -> list[Rung]:
    rungs = []
    for label, stage, param, opt in ladder:
        rung = try_rung(base, stats, shape, target, workload, label, stage, param, opt, nvme_path,
                        project_gpu_master)
        rungs.append(rung)
        if rung.fits and stop_at_fit:
            break
    return rungs


def _first_fit(base: InfinityConfig, stats: ModelStats, shape: ModelShape, target: Target,
               workload: Workload, nvme_path: str | None,
               ladder: tuple[tuple[str, int, str, str], ...],
               project_gpu_master: bool = False) -> Rung | None:
    for rung in _path(base, stats, shape, target, workload, nvme_path, ladder=ladder,
                      project_gpu_master=project_gpu_master):
        if rung.fits:
            return rung
    return None


def _smallest(lo: int, hi: int, fits) -> int | None:
    """The smallest value in (lo, hi] (within 1%) for which ``fits``, or None."""
    if not fits(hi):
        return None
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _additions(base: InfinityConfig, stats: ModelStats, shape: ModelShape, target: Target,
               workload: Workload, nvme_path: str | None,
               ladder: tuple[tuple[str, int, str, str], ...],
               project_gpu_master: bool = False) -> tuple[str, ...]:
    """Each single change that makes some rung fit, and the rung it makes fit."""
    def fit(t: Target) -> Rung | None:
        return _first_fit(base, stats, shape, t, workload, nvme_path, ladder, project_gpu_master)

    out: list[str] = []
    for nodes in (2, 4, 8, 16, 32, 64, 128):
        more = target.with_(nodes=target.nodes * nodes)
        rung = fit(more)
        if rung is not None:
            out.append(f"more GPUs: {more.nodes} nodes ({more.world_size} GPUs) -> {rung.label}")
            break
    host = _smallest(target.host_memory_bytes, max(target.host_memory_bytes, 1 << 30) * 64,
                     lambda b: fit(target.with_(host_memory_bytes=b)) is not None)
    if host is not None:
        rung = fit(target.with_(host_memory_bytes=host))
        out.append(f"host memory: {format_bytes(host)} per node (has "
                   f"{format_bytes(target.host_memory_bytes)}) -> {rung.label if rung else ''}")
    nvme = _smallest(target.nvme_bytes, max(target.nvme_bytes, 1 << 40) * 1024,
                     lambda b: fit(target.with_(nvme_bytes=b)) is not None)
    if nvme is not None:
        rung = fit(target.with_(nvme_bytes=nvme))
        out.append(f"NVMe: {format_bytes(nvme)} per node (has {format_bytes(target.nvme_bytes)})"
                   f" -> {rung.label if rung else ''}")
    if host is None and nvme is None:
        both = target.with_(host_memory_bytes=max(target.host_memory_bytes, 1 << 30) * 64,
                            nvme_bytes=max(target.nvme_bytes, 1 << 40) * 1024)
        if fit(both) is not None:
            host = _smallest(target.host_memory_bytes, both.host_memory_bytes,
                             lambda b: fit(both.with_(host_memory_bytes=b)) is not None)
            need = both.with_(host_memory_bytes=host or both.host_memory_bytes)
            rung = fit(need)
            nvme_need = rung.memory.node_nvme if rung else 0
            out.append(f"host memory and NVMe together: {format_bytes(need.host_memory_bytes)} "
                       f"and {format_bytes(nvme_need)} per node -> {rung.label if rung else ''}")
    deepest = try_rung(base, stats, shape, target, workload, *ladder[-1], nvme_path,
                       project_gpu_master).memory
    if any(p.startswith("GPU memory") for p in deepest.problems):
        unit = deepest.stats.largest_unit_params
        need = format_bytes(2 * deepest.placement.c * unit)
        if stats.param_numels is None:
            out.append(f"smaller units: the largest unit ({unit:,} elements) takes {need} on a GPU "
                       "fetched with its gradient, before prefetch and activations; name smaller "
                       "modules in infinity.unit_modules (plan with --hf-config and the plan sizes "
                       "one unit per parameter)")
        elif deepest.units_split:
            out.append(f"a single parameter of {unit:,} elements takes {need} on a GPU with its "
                       "gradient: splitting one weight (the paper's memory-centric tiling) is not "
                       "implemented")
    gpu = target.gpu
    mem = _smallest(gpu.memory_bytes, gpu.memory_bytes * 16,
                    lambda b: fit(target.with_(gpu=dataclasses.replace(gpu, memory_bytes=b))) is not None)
    if mem is not None:
        out.append(f"GPU memory: GPUs of {format_bytes(mem)} (have {format_bytes(gpu.memory_bytes)})")
    return tuple(out)


def decide(stats: ModelStats, shape: ModelShape, target: Target, workload: Workload,
           base: InfinityConfig | None = None, nvme_path: str | None = None,
           as_written: bool = False, project_gpu_master: bool = False) -> Decision:
    """Walk the rungs for ``stats`` on ``target``; the first that fits is chosen (``base``
    keeps its optimizer, clipping and infinity settings, the Adam state formats among them;
    stage, offload devices, budgets and sizes are the plan's). ``as_written``: the one rung of
    ``base``'s own stage and offload devices (``infinity plan --config``).
    ``project_gpu_master``: plan a bf16 master on the GPUs, which the engine refuses for now
    (a projection: its choice is no config to run)."""
    base = base or InfinityConfig()
    ladder = RUNGS
    if as_written:
        z = base.zero
        ladder = ((f"the config as written: stage {z.stage}, offload_param {z.offload_param.device}, "
                   f"offload_optimizer {z.offload_optimizer.device}", z.stage, z.offload_param.device,
                   z.offload_optimizer.device),)
        nvme_path = nvme_path or z.swap_path
    rungs = _path(base, stats, shape, target, workload, nvme_path, ladder=ladder,
                  project_gpu_master=project_gpu_master)
    chosen = rungs[-1].memory if rungs and rungs[-1].fits else None
    additions = () if chosen is not None else _additions(base, stats, shape, target, workload,
                                                         nvme_path, ladder, project_gpu_master)
    return Decision(stats=stats, shape=shape, target=target, workload=workload,
                    rungs=tuple(rungs), chosen=chosen, additions=additions,
                    project_gpu_master=project_gpu_master)
