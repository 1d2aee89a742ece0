"""The memory one rank of a target machine needs for a config: device, host and NVMe bytes by
what they hold, the node's totals (its ranks together), and why it does not fit, if it does not.

Every size is the engine's own: the run plan (``run_plan.plan_run``, what the engine builds
from at start) gives the states' homes, the derived sizes, the engine's pools and the swap-file
bytes for the model's units. Only the activations (``shape.activation_bytes``) and the runtime's
own memory are added here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.engine_sizes import EngineSizes
from infinity.planner.inputs import ModelStats
from infinity.planner.placement import Placement, place, resident_bytes
from infinity.planner.run_plan import RunPlan, plan_run
from infinity.planner.shape import ModelShape, activation_bytes
from infinity.planner.sizes import (
    HOST_BUDGET_FRACTION,
    DerivedSizes,
    device_working,
)
from infinity.planner.target import Target, Workload
from infinity.planner.tiers import Tier

__all__ = ["RankMemory", "rank_memory", "GPU_RUNTIME_HOST_BYTES"]

GPU_RUNTIME_HOST_BYTES = 4 << 30
"""Host memory of one GPU rank's process besides the engine's pools: Python, torch and the CUDA
libraries (cuBLAS, cuDNN, NCCL) mapped and touched, the CUDA context's host side (an assumption:
2-5 GiB is the usual resident set of a CUDA PyTorch process)."""


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's bytes per tier for a config on a target, and the node's totals."""

    config: InfinityConfig
    """The config with every size written in (budgets, sub-group, buffers)."""
    candidate: InfinityConfig
    """The config as given to ``rank_memory`` (a rung's stage and tiers, sizes "auto")."""
    stats: ModelStats
    """The model's units as planned (split into parameters when ``units_split``)."""
    plan: RunPlan
    """The run plan of ``config`` on the target (what the engine would build there)."""
    placement: Placement
    derived: DerivedSizes
    engine: EngineSizes
    units_split: bool
    """Every parameter is its own unit (the default units did not fit the device)."""
    checkpointing: bool
    """Activations recomputed per block in backward."""
    speculative: bool
    """The speculative step's second copies are on the NVMe."""
    device: dict[str, int]
    """Bytes on one GPU: "states", "working" (fetched units, prefetch, gradients), "activations"."""
    host: dict[str, int]
    """Bytes of one rank's host memory: "states", "buffers", "runtime"."""
    nvme: int
    """Bytes of one rank's swap files."""
    node_host: int
    """Host bytes of a node's ranks together."""
    node_nvme: int
    """Swap bytes of a node's ranks together."""
    problems: tuple[str, ...]
    """Why it does not fit, each naming the bytes and the budget; empty when it fits."""

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def bytes_per_param(self) -> dict[str, float]:
        """Bytes this engine stores per parameter, by state: the 16-bit parameter (or the
        master stored once: fp32 compute, or a bf16 master), the Adam states (the fp32 master
        unless single, m and v in their format, int8 scales included), the gradient (fp32,
        none under the early step) -- against the paper's 2 + 2 + 12 = 16."""
        lay = self.placement
        opt = lay.optimizer_state_bytes
        return {"params": lay.c,
                "optimizer_states": int(opt) if float(opt).is_integer() else round(opt, 4),
                "grads": 0 if lay.early_step else 4}

    def states_note(self) -> str:
        """What the optimizer states per parameter are: "fp32 master, m, v", "fp32 master,
        int8 m, v + scales", "bf16 m, v" (a single copy: the parameter is the master)."""
        lay = self.placement
        fmt = lay.state_format
        moments = "m, v" if fmt.is_default else f"{fmt.moments} m, v" + (
            " + scales" if fmt.moments == "int8" else "")
        return f"fp32 master, {moments}" if not lay.single_copy else moments

    @property
    def model_states_bytes(self) -> int:
        """The whole model's states over all ranks (no padding, no buffers)."""
        per = self.bytes_per_param()
        return int(per["params"] * self.stats.total_params
                   + (per["optimizer_states"] + per["grads"]) * self.stats.trainable_params)

    def per_tier(self) -> dict[str, int]:
        """tier -> bytes of one rank (``--json``'s ``per_rank``)."""
        return {Tier.DEVICE: self.device_total, Tier.HOST: self.host_total, Tier.NVME: self.nvme}


def rank_memory(cfg: InfinityConfig, stats: ModelStats, shape: ModelShape, target: Target,
                workload: Workload, *, checkpointing: bool, split_units: bool = False,
                speculative: bool | None = None, project_gpu_master: bool = False) -> RankMemory:
    """The bytes one rank of ``target`` holds under ``cfg`` (whose stage and offload devices are
    the candidate's; budgets and sizes are filled in here), and whether they fit.

    ``speculative`` None: as the engine decides (``plan_run``: "auto" takes the second copies
    only where the NVMe has room for them). ``project_gpu_master``: a bf16 master is planned
    though the engine refuses it on a GPU for now (``plan_run``)."""
    candidate = cfg
    if split_units:
        stats = stats.split_into_parameters()
    hw = target.hardware(cfg.zero.swap_path)
    acts = activation_bytes(shape, workload.seq_len, workload.micro_batch, checkpointing,
                            place(cfg, stats, hw).c)
    host_budget = int(HOST_BUDGET_FRACTION * target.host_memory_bytes) // target.gpus_per_node
    inf = dataclasses.replace(cfg.infinity, host_memory_budget=host_budget,
                              device_memory_budget=max(0, target.device_budget_bytes - acts),
                              unit_modules=["Linear"] if split_units else cfg.infinity.unit_modules)
    cfg = dataclasses.replace(cfg, infinity=inf)
    plan = plan_run(cfg, hw, stats=stats, speculative=speculative,
                    project_gpu_master=project_gpu_master)
    lay, derived, es = plan.placement, plan.derived, plan.sizes
    # the engine's sub-group (what the host budget leaves for the step stream's slots)
    cfg = derived.apply(cfg)
    cfg = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, sub_group_size=es.sub_group_numel))

    resident = resident_bytes(lay)
    device_states = sum(b for (comp, tier), b in resident.items()
                        if tier == Tier.DEVICE and comp != "grads")
    working = device_working(lay, derived.unit_device_bytes, derived.prefetch_device_bytes,
                             derived.persistent_device_bytes, derived.reduce_bucket_size)
    # with several ranks on a GPU each unit's gradient is reduced in device buffers (see [Note:
    # gradients reduced on the device] in optim/device_gradients.py)
    device = {"states": device_states, "working": working,
              "gradients": es.device_gradient_bytes, "activations": acts}
    host = {"states": es.host_home_bytes, "buffers": es.host_buffer_bytes,
            "runtime": GPU_RUNTIME_HOST_BYTES}
    node_host = target.gpus_per_node * sum(host.values())
    node_nvme = target.gpus_per_node * es.nvme_bytes

    problems: list[str] = []
    over = sum(device.values()) - target.device_budget_bytes
    if over > 0:
        parts = ", ".join(f"{name} {format_bytes(b)}" for name, b in device.items() if b)
        problems.append(f"GPU memory: needs {format_bytes(sum(device.values()))} per GPU ({parts}), "
                        f"{format_bytes(over)} more than the {format_bytes(target.device_budget_bytes)} "
                        "one GPU offers")
    if derived.device_room_warning:     # the user's prefetch bucket beside the gradient buffers
        problems.append(f"GPU memory: {derived.device_room_warning}")
    engine_host = es.host_home_bytes + es.host_buffer_bytes
    if engine_host > host_budget:
        problems.append(f"host memory: a rank needs {format_bytes(engine_host)} (states "
                        f"{format_bytes(es.host_home_bytes)}, buffers {format_bytes(es.host_buffer_bytes)}) "
                        f"but its share of the node is {format_bytes(host_budget)} "
                        f"({HOST_BUDGET_FRACTION:.0%} of {format_bytes(target.host_memory_bytes)} "
                        f"over {target.gpus_per_node} ranks)")
    elif node_host > target.host_memory_bytes:
        problems.append(f"host memory: the node's {target.gpus_per_node} ranks need "
                        f"{format_bytes(node_host)} with their runtimes, more than its "
                        f"{format_bytes(target.host_memory_bytes)}")
    if node_nvme > target.nvme_bytes:
        have = format_bytes(target.nvme_bytes) if target.nvme_bytes else "no NVMe (--nvme)"
        problems.append(f"NVMe: the node's swap files need {format_bytes(node_nvme)}, it has {have}")
    return RankMemory(config=cfg, candidate=candidate, stats=stats, plan=plan, placement=lay,
                      derived=derived, engine=es,
                      units_split=split_units, checkpointing=checkpointing,
                      speculative=plan.speculative, device=device, host=host, nvme=es.nvme_bytes,
                      node_host=node_host, node_nvme=node_nvme, problems=tuple(problems))
