"""A plan for a target machine: the decision path (``decide``), the chosen config's memory per
rank and node, its predicted step time (``step_time``), what each Adam state format would
change (``formats``), the notes that explain the choices, and the JSON of ``infinity plan
--json`` with target flags (``TargetPlan.as_dict``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.decide import (
    RUNGS,
    TARGET_SWAP_DIR,
    Decision,
    candidate_config,
    decide,
    format_refusal,
)
from infinity.planner.formats import FormatRow, config_format, target_formats
from infinity.planner.inputs import ModelStats
from infinity.planner.rank_memory import (
    GPU_RUNTIME_HOST_BYTES,
    RankMemory,
    rank_memory,
)
from infinity.planner.shape import ModelShape
from infinity.planner.step_time import StepTime, predict_step
from infinity.planner.target import DEVICE_RESERVE_BYTES, Target, Workload

__all__ = ["TargetPlan", "plan_target", "PAPER_BYTES_PER_PARAM", "DS_CONFIG_KEYS"]

PAPER_BYTES_PER_PARAM = {"params": 2, "grads": 2, "optimizer_states": 12}
"""ZeRO's (and ZeRO-Infinity's) count of mixed-precision Adam model states: fp16 parameters and
gradients, fp32 master, momentum and variance: 16 B per parameter."""
DS_CONFIG_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
                  "zero_optimization", "infinity")
"""The ds_config sections a plan prints (the rest are the defaults)."""


@dataclass(frozen=True, kw_only=True)
class TargetPlan:
    """The decision, the step time of its choice, and what to know about both."""

    decision: Decision
    step: StepTime | None
    """None when infeasible."""
    notes: tuple[str, ...]
    formats: tuple[FormatRow, ...] = ()
    """What each Adam state format would change at the plan's rung (``formats``)."""

    @property
    def chosen(self) -> RankMemory | None:
        return self.decision.chosen

    @property
    def reference(self) -> RankMemory:
        """The chosen rung's memory, or the deepest rung's when none fits."""
        return self.decision.chosen or self.decision.rungs[-1].memory

    @property
    def projection(self) -> bool:
        """The chosen config has a bf16 master on the GPUs, which the engine refuses for now:
        its figures are a projection, and it is no config to run."""
        return self.decision.project_gpu_master and \
            self.reference.placement.state_format.master == "bf16"

    def ds_config(self) -> dict[str, Any]:
        """The chosen config's sections, ready to paste (empty when infeasible or a
        projection)."""
        if self.chosen is None or self.projection:
            return {}
        full = self.chosen.config.to_dict()
        out = {key: full[key] for key in DS_CONFIG_KEYS if key in full}
        for dtype in ("fp16", "bf16"):
            if not full[dtype]["enabled"]:
                out.pop(dtype, None)
        zero = self.chosen.config.zero
        if self.decision.target.aio and "nvme" in (zero.offload_param.device,
                                                   zero.offload_optimizer.device):
            out["aio"] = dict(self.decision.target.aio)   # the settings its rates were measured at
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``infinity plan --json`` with target flags)."""
        d, ref = self.decision, self.reference
        t = d.target
        fmt = ref.placement.state_format
        return {
            "feasible": d.feasible,
            "recommended": d.rungs[-1].label if d.feasible and not self.projection else None,
            "projection": self.projection,
            "model": {"total_params": d.stats.total_params, "trainable_params": d.stats.trainable_params,
                      "n_units": d.stats.n_units, "largest_unit_params": d.stats.largest_unit_params,
                      "shape": dataclasses.asdict(d.shape)},
            "target": {**{k: v for k, v in dataclasses.asdict(t).items() if k != "gpu"},
                       "gpu": dataclasses.asdict(t.gpu), "world_size": t.world_size,
                       "device_budget_bytes": t.device_budget_bytes},
            "workload": dataclasses.asdict(d.workload),
            "decision": [{"rung": r.label, "fits": r.fits, "why": r.why(),
                          "stage": r.memory.placement.stage,
                          "offload_param": r.memory.config.zero.offload_param.device,
                          "offload_optimizer": r.memory.config.zero.offload_optimizer.device}
                         for r in d.rungs],
            "state_format": {"optimizer_moments": fmt.moments, "optimizer_master": fmt.master,
                             "label": fmt.label, "states_per_rank": dataclasses.asdict(
                                 ref.placement.states)},
            "formats": [row.as_dict() for row in self.formats],
            "model_states_bytes": ref.model_states_bytes,
            "bytes_per_param": {"this_engine": ref.bytes_per_param(), "paper": PAPER_BYTES_PER_PARAM},
            "per_rank": ref.per_tier(),
            "per_rank_detail": {"device": ref.device, "host": ref.host, "nvme": ref.nvme},
            "per_node": {"host": ref.node_host, "nvme": ref.node_nvme,
                         "host_memory": t.host_memory_bytes, "nvme_space": t.nvme_bytes},
            "activation_checkpointing": ref.checkpointing,
            "units_split": ref.units_split,
            "speculative_step": ref.speculative,
            "links": {} if self.step is None else {l.name: l.seconds for l in self.step.links},
            "links_detail": [] if self.step is None else [
                {"name": l.name, "amount": l.amount, "unit": l.unit, "per": l.per,
                 "seconds": l.seconds, "note": l.note} for l in self.step.links],
            "bottleneck": None if self.step is None else self.step.bottleneck,
            "bound_s": None if self.step is None else self.step.bound_s,
            "predicted_step_s": None if self.step is None else self.step.predicted_s,
            "tokens_per_s": None if self.step is None else self.step.tokens_per_s,
            "tflops_per_gpu": None if self.step is None else self.step.tflops_per_gpu,
            "additions": list(d.additions),
            "notes": list(self.notes),
            "ds_config": self.ds_config(),
        }

    def render(self) -> str:
        """Text for people."""
        from infinity.planner.explain import render_target_plan

        return render_target_plan(self)


def _notes(d: Decision) -> list[str]:
    notes: list[str] = []
    t = d.target
    if t.assumed:
        notes.append("assumed (not given): " + ", ".join(t.assumed))
    notes.append(f"assumed overheads: {format_bytes(DEVICE_RESERVE_BYTES)} of each GPU kept out of "
                 f"the plan (CUDA context, NCCL, allocator); {format_bytes(GPU_RUNTIME_HOST_BYTES)} "
                 "of host memory per rank beside the engine's pools (Python, torch, CUDA libraries)")
    paths = {m.config.zero.offload_param.nvme_path, m.config.zero.offload_optimizer.nvme_path} \
        if (m := d.chosen) is not None else set()
    if TARGET_SWAP_DIR in paths:
        notes.append(f"nvme_path {TARGET_SWAP_DIR} stands for the target's NVMe mount (set it, or "
                     "pass --nvme-path)")
    if d.shape.estimated:
        sh = d.shape
        notes.append(f"model shape estimated from the parameter count: {sh.layers} layers of width "
                     f"{sh.hidden} (MLP {sh.intermediate}, vocabulary {sh.vocab}; "
                     f"{sh.llama_params() / 1e9:,.2f}B parameters as a Llama), "
                     f"{sh.source or 'from the count'}: pass --hf-config for the model's own shape")
    if t.gpu.dtype == "fp16":
        notes.append(f"{t.gpu.name} has no bf16: fp16 compute with dynamic loss scaling "
                     "(fp16.enabled, loss_scale 0); the early step is off (the overflow check "
                     "needs every gradient first), so gradients are kept")
    else:
        notes.append("bf16 compute on the GPUs")
    lay = (d.chosen or d.rungs[-1].memory).placement
    fmt = lay.state_format
    if fmt.is_default:
        notes.append("fp32 master weights and Adam states (see the formats below for fewer "
                     "bytes: infinity.optimizer_moments / optimizer_master)")
    else:
        notes.append(f"Adam states stored as {fmt.describe()}; stepped by the CPU Adam in fp32")
    if d.project_gpu_master and fmt.master == "bf16":
        notes.append("PROJECTION: a bf16 master (optimizer_master \"bf16\") is not available on "
                     "GPUs yet (the engine refuses it there); the figures are what it would take, "
                     "and no ds_config is given")
    if d.chosen is None:
        return notes
    m = d.chosen
    if lay.early_step:
        notes.append("early step: each unit's shard is stepped as its gradient arrives, "
                     "gradients have no home (no clipping, no fp16, no accumulation)")
    if m.speculative:
        notes.append("speculative step: second copies of the NVMe parameters and Adam states "
                     "(counted in the NVMe bytes)")
    elif m.plan.speculation_possible:
        notes.append("speculative step off: the node's NVMe lacks the room for its second copies")
    if m.checkpointing and d.workload.activation_checkpointing == "auto":
        plain = rank_memory(m.candidate, d.stats, d.shape, t, d.workload, checkpointing=False,
                            split_units=m.units_split, project_gpu_master=d.project_gpu_master)
        notes.append(f"activation checkpointing is needed: without it the activations take "
                     f"{format_bytes(plain.device['activations'])} per GPU; enable it in the model "
                     "(transformers: model.gradient_checkpointing_enable()); the engine does not "
                     "recompute by itself")
    elif m.checkpointing:
        notes.append("activation checkpointing: enable it in the model (transformers: "
                     "model.gradient_checkpointing_enable())")
    if m.units_split:
        whole = rank_memory(m.candidate, d.stats, d.shape, t, d.workload,
                            checkpointing=m.checkpointing, split_units=False,
                            project_gpu_master=d.project_gpu_master)
        over = whole.device_total - t.device_budget_bytes
        notes.append(f"a whole block ({d.stats.largest_unit_params:,} parameters) is too large to "
                     f"stream: fetched with its gradient and prefetch it needs "
                     f"{format_bytes(whole.device_total)} on a GPU, "
                     + (f"{format_bytes(over)} over its {format_bytes(t.device_budget_bytes)}"
                        if over > 0 else "and its host buffers do not fit")
                     + f"; the plan makes every parameter its own unit (infinity.unit_modules "
                     f"[\"Linear\"] for Llama), largest {d.stats.largest_param:,} elements")
    return notes


def plan_target(stats: ModelStats, shape: ModelShape, target: Target, workload: Workload,
                base: InfinityConfig | None = None, nvme_path: str | None = None,
                as_written: bool = False, formats: bool = True) -> TargetPlan:
    """The decision path, step time, notes and (``formats``) the Adam state formats' rows for
    ``stats`` on ``target`` (``as_written``: only ``base``'s own stage and offload devices). A
    ``base`` asking for a bf16 master is planned as a projection: the engine does not run one
    on GPUs yet."""
    base = base or InfinityConfig()
    project = config_format(base).master == "bf16"
    # a format no rung can run (a bf16 master with fp32 moments or without bf16 compute; the
    # config as written with the optimizer on the GPU) is refused with its reason at once
    z = base.zero
    stage, param, opt = ((z.stage, z.offload_param.device, z.offload_optimizer.device)
                         if as_written else RUNGS[-1][1:])
    refusal = format_refusal(candidate_config(base, target, workload, stage, param, opt,
                                              nvme_path), stats, target, project)
    if refusal is not None:
        raise ValueError(refusal[1])
    decision = decide(stats, shape, target, workload, base, nvme_path, as_written,
                      project_gpu_master=project)
    step = None if decision.chosen is None else predict_step(decision.chosen, shape, target, workload)
    rows = target_formats(decision, step, base, nvme_path, as_written) if formats else ()
    return TargetPlan(decision=decision, step=step, notes=tuple(_notes(decision)), formats=rows)
