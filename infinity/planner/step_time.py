"""Predicted step time of a plan on its target: per link, the bytes (or FLOPs) one optimizer
step moves over it and the seconds they take; the busiest resource bounds the step (the NVMe
read and write links share the drives: ``slowest_lane``), and the engine's measured overlap
turns the bound into the expected step.

Pure. Traffic per step of one rank (N ranks, P parameters, c bytes of the 16-bit type, A
micro-steps of accumulation):

* GPU compute: tokens x ``shape.flops_per_token`` (with recomputation under checkpointing) at
  ``Target.mfu`` of the GPU's peak.
* PCIe, host <-> device: a parameter shard homed off the GPU is fetched in the forward and again
  in the backward (2 c P / N per micro-step); a gradient shard kept off the GPU goes down in
  the communication dtype with several ranks (``communication_data_type``, unset the compute
  dtype: g P / N per micro-step, g = 2 for bf16, widened on the host; reduce-scatter -> shard
  -> host), in fp32 with one (4 P per micro-step);
  parameters homed on the GPU under an offloaded optimizer come back up updated (c per element
  of the rank's parameters). The two directions are separate lanes: the larger one counts.
* NVMe, per node (its ranks share the drives): parameter shards on NVMe are read at each fetch
  (2 c P / N per micro-step, less the units still fetched at a turn: ``reuse_bytes``) and written
  once updated (c P / N); Adam states on NVMe are read and written once per step in their
  format (``Placement.states``: m + v in 8, 4 or 2 B per element as fp32, bf16 or int8, the
  int8 scales staying in host memory, and 4 more for a separate fp32 master: 12 B with fp32
  states beside 16-bit compute, 8 when the fp32 parameter is the master, 2 for int8 moments
  with a bf16 master, which is the 16-bit parameter itself); gradients kept
  on NVMe are written per micro-step and read at the step (4 B each way), unless the early or
  the speculative step holds them (``nvme_traffic``).
* Reuse: at REUSE_TURNS points of a step the units used last are the first used next (the
  forward's last blocks begin the backward; the step's last units begin the next forward), and
  the coordinator keeps what the device has room for fetched (see [Note: keeping units for
  reuse] in zero/coordinator.py): those bytes are not read again. Measured on the out-of-core
  bench (tools/bench/plan_calibration.py): 0.49B reads 5.62 GB a step, not the 7.76 GB of two
  whole fetches plus the Adam states.
* Collectives, per GPU: ring all-gather and reduce-scatter move (N-1)/N of the buffer:
  stage 3 gathers parameters twice per micro-step and reduce-scatters gradients once; stages
  1-2 reduce-scatter gradients per micro-step and gather the updated parameters once per step;
  stage 0 all-reduces gradients (twice the bytes) per micro-step. Parameters in the compute
  dtype; gradients in fp32, as the engine collects them (optim/gradients.py, [Note: gradients
  over ranks]) -- the dry run's collectives showed the 16-bit count 2x short.
* CPU Adam, per node: the node's optimizer elements at ``CPU_ADAM_PARAMS_PER_CORE`` per core, or
  at the host memory bandwidth for ``CPU_ADAM_BYTES_PER_PARAM`` bytes each (and a host
  gradient home's bytes, written back at zero: ``adam_bytes_per_param``), the slower. With
  other Adam state formats, the per-core rate has the fp32 kernel's time per element replaced by
  the format's (``adam_params_per_core``: int8 is ~4x slower a core) and the bytes are the
  format's (``adam_bytes_per_param``).
"""
from __future__ import annotations

from dataclasses import dataclass

from infinity.planner.placement import Placement
from infinity.planner.rank_memory import RankMemory
from infinity.planner.shape import ModelShape, flops_per_token
from infinity.planner.sizes import DTYPE_BYTES
from infinity.planner.state_format import StateFormat
from infinity.planner.target import Target, Workload
from infinity.planner.tiers import Tier

__all__ = ["Link", "StepTime", "predict_step", "nvme_traffic", "reuse_bytes", "slowest_lane",
           "cpu_adam_rate",
           "OVERLAP_FACTOR", "KERNEL_ELEMENTS_PER_S", "adam_params_per_core", "adam_rate_factor",
           "adam_bytes_per_param",
           "CPU_ADAM_PARAMS_PER_CORE", "CPU_ADAM_BYTES_PER_PARAM", "LINK_EFFICIENCY", "REUSE_TURNS"]

CPU_ADAM_PARAMS_PER_CORE = 0.9e9
"""Parameters per second per core of the engine's CPU Adam: BENCHMARKS.md, "Out-of-core (stage
3)", its "optimizer alone" row: 0.485B parameters in 0.27 s and 1.04B in 0.55 s on 2
cores, 0.90 and 0.95 G/s per core."""
CPU_ADAM_BYTES_PER_PARAM = 30
"""Memory traffic of one parameter's Adam step with the 16-bit copy written (BENCHMARKS.md,
"CPU Adam": ``ours_bf16copy``, 30 B/param)."""
OVERLAP_FACTOR = 1.08
"""Expected step / the busiest resource (``slowest_lane``): fitted on the out-of-core bench's
0.49B model, both schedules, with the step's inputs measured in the same run, and checked on
1.04B held out (-8% and +4%: BENCHMARKS.md, "Plan calibration"; measured on a 2-core CPU
machine, where compute and the CPU Adam share the cores). On a GPU the dry run's critical path
is the prediction that matters: within 9% of the H200's measured step (BENCHMARKS.md, "The
fourth H200 pass")."""
LINK_EFFICIENCY = 0.8
"""Share of a link's theoretical bandwidth a bulk transfer reaches (PCIe pinned copies, NCCL
ring collectives): an assumption, typical of published measurements."""
REUSE_TURNS = 2
"""Points per step where units stay fetched for their next use: forward -> backward, and the
end of backward (the step) -> the next forward."""
KERNEL_ELEMENTS_PER_S = {"fp32": 1.7e9, "bf16": 1.5e9, "int8": 0.49e9}
"""Elements per second of one core of the fused Adam kernel by moments format: the fp32
kernel's rate, and the others' at their measured ratio to it in the same process (bf16 moments,
rounded stochastically, 0.77x; int8 0.24x: tools/bench/adam_formats_kernels.py, one thread,
AVX-512, AMD EPYC, 16M elements, BENCHMARKS.md "Adam state format kernels", commit 7bbff16).
bf16 is the fp32-master case, the common one: since 2f961ff its v's rounding takes the top half
of the element's hash instead of a second mix, measured 1.16x the kernel before it (the same
tool, 70 rounds alternating with the previous build, load 2.8 on a shared 2-core machine: noisy,
the unchanged kernels moved by 0.99-1.06x), so 0.77x * 1.16 = 0.89x. With a bf16 master bf16
moments still run at ~0.75x (1.3e9); the table has one figure per moments format. int8: since
the AVX-512 kernel dequantizes by permutes instead of gathers and codes m and v in one loop, 0.29x
(bf16 master) to 0.33x (fp32 master) of fp32's rate in the same process, against 0.25x before
(the same tool, 10 rounds alternating with the previous build, load 1.2): 0.29x, 0.49e9."""


def adam_params_per_core(fmt: StateFormat) -> float:
    """The engine's CPU Adam per core in ``fmt``: its measured fp32 rate
    (``CPU_ADAM_PARAMS_PER_CORE``, kernel and the rest of the step) with the fp32 kernel's
    time per element replaced by the format's kernel's (an estimate: the engine's step in the
    formats has not been measured end to end)."""
    rest = 1 / CPU_ADAM_PARAMS_PER_CORE - 1 / KERNEL_ELEMENTS_PER_S["fp32"]
    return 1 / (rest + 1 / KERNEL_ELEMENTS_PER_S[fmt.moments])


def adam_rate_factor(fmt: StateFormat) -> float:
    """A CPU Adam rate measured with fp32 states, times this, is the rate in ``fmt``."""
    return adam_params_per_core(fmt) / CPU_ADAM_PARAMS_PER_CORE


def adam_bytes_per_param(lay: Placement) -> float:
    """Host memory traffic of one parameter's Adam step: the master read and written (fp32,
    or the parameter itself where it is its own), m and v read and written in their format,
    the fp32 gradient read, the updated 16-bit copy written (none for a single copy): 30 B
    with fp32 states beside 16-bit compute (``CPU_ADAM_BYTES_PER_PARAM``), 12 for int8
    moments with a bf16 master. A gradient home in host memory (the deferred schedule) is
    read in its own dtype and written back at zero by the kernel for the next cycle's adds
    ([Note: the step gives the home back at zero] in optim/kernel.py)."""
    fmt = lay.state_format
    master = 2 * lay.c if lay.single_copy else 8
    grad = 2 * lay.grad_bytes if lay.grads_tier == Tier.HOST else 4
    return master + 4 * fmt.moment_itemsize + grad + (0 if lay.single_copy else lay.c)


def cpu_adam_rate(lay: Placement, target: Target) -> tuple[float, str]:
    """(parameters per second, what bounds it) of a node's CPU Adam: its cores at the format's
    per-core rate, or its host memory bandwidth at the placement's bytes per parameter, the
    slower ("cores" or "memory bandwidth"). The analytical step and the dry run's clock
    (commands/dry_run.py ``target_setup``) both take it from here: the first H200 machine's
    16 cores would step 14.4 G params/s by the cores alone, and its CPU Adam took ~0.3 s for
    the 0.49B model where the dry run, counting cores only, gave 0.034 s."""
    by_cores = adam_params_per_core(lay.state_format) * target.cpu_cores
    by_memory = target.host_memory_GBps * 1e9 / adam_bytes_per_param(lay)
    return (by_cores, "cores") if by_cores <= by_memory else (by_memory, "memory bandwidth")


def slowest_lane(links: list[Link]) -> tuple[float, str]:
    """(seconds, name) of the busiest resource: each link is its own, except that the NVMe
    read and write links share the drives, so their seconds add ("NVMe read + write"): on the
    project machine reads and writes submitted together took longer than the two rates'
    serial sum (``infinity.train.calibrate.measure_disk``'s mixed pass; the out-of-core I/O
    replay in BENCHMARKS.md, 2.93 s against a serial 2.74 s and a parallel 1.95 s)."""
    lanes: dict[str, float] = {}
    for link in links:
        name = "NVMe read + write" if link.name in ("NVMe read", "NVMe write") else link.name
        lanes[name] = lanes.get(name, 0.0) + link.seconds
    name = max(lanes, key=lanes.get)
    return lanes[name], name


def reuse_bytes(keep_limit_bytes: int, room_bytes: int, param_bytes: int) -> int:
    """Parameter bytes (of one rank's own shards) still fetched at one turn, so not read again:
    what the device has room for beside the fetch in progress and the prefetch, within the
    keep limit (``stage3_max_reuse_distance``) and the parameters' own bytes."""
    return max(0, min(keep_limit_bytes, room_bytes, param_bytes))


def nvme_traffic(lay: Placement, grad_tier: Tier, accum: int = 1, *, grads_held: bool = False,
                 reused: int = 0) -> tuple[float, float]:
    """(read, write) bytes of one rank's swap files per optimizer step (see the module
    docstring); ``reused``: parameter bytes not read again at each of the REUSE_TURNS;
    ``grads_held``: the deferred step holds autograd's gradients until it runs (the speculative
    step on a CPU device, ``optim/gradients.py``), so none go to NVMe."""
    read = write = 0.0
    if lay.param_tier == Tier.NVME:
        pbytes = lay.c * lay.param_elems
        read += max(0.0, 2 * pbytes * accum - REUSE_TURNS * min(reused, pbytes))
        write += pbytes
    if lay.opt_tier == Tier.NVME:
        states = lay.states.optimizer
        read += states
        write += states
    if grad_tier == Tier.NVME and not lay.early_step and not grads_held:
        write += 4 * lay.grad_elems * accum
        read += 4 * lay.grad_elems * accum  # added to at each later micro-step, read at the step
    return read, write


@dataclass(frozen=True, kw_only=True)
class Link:
    """One resource a step uses, what it moves or computes, and for how long."""

    name: str
    amount: float
    """Bytes, FLOPs (GPU) or parameters (CPU Adam) per step."""
    unit: str
    """"B", "FLOP" or "param" (CPU Adam)."""
    rate: float
    """Bytes or FLOPs per second this link moves."""
    per: str
    """"GPU" or "node": whose amount it is."""
    note: str

    @property
    def seconds(self) -> float:
        return self.amount / self.rate if self.amount else 0.0


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """The links of one optimizer step and what they add up to."""

    links: tuple[Link, ...]
    bound_s: float
    """The busiest resource's seconds (``slowest_lane``): no schedule does better."""
    predicted_s: float
    """``bound_s`` x OVERLAP_FACTOR: the engine's measured overlap."""
    bottleneck: str
    tokens_per_s: float
    """Tokens trained per second, all GPUs."""
    tflops_per_gpu: float
    """Model FLOPs (6 N + 12 L h s per token, no recomputation) per second per GPU."""
    model_flops_per_step: float
    """Per GPU."""


def predict_step(memory: RankMemory, shape: ModelShape, target: Target, workload: Workload) -> StepTime:
    """The step time of ``memory``'s config (its placement and the engine's sizes) on ``target``."""
    lay, n = memory.placement, target.world_size
    stats = memory.stats
    accum = workload.gradient_accumulation_steps
    tokens = workload.tokens_per_step
    c = lay.c
    params, shard = stats.total_params, lay.param_elems          # per rank: P / N at stage 3
    opt_elems, grad_elems = lay.opt_elems, lay.grad_elems

    model_flops = tokens * flops_per_token(params, shape, workload.seq_len)
    hw_flops = tokens * flops_per_token(params, shape, workload.seq_len, memory.checkpointing)
    links = [Link(name="GPU compute", amount=hw_flops, unit="FLOP",
                  rate=target.gpu.peak_tflops * 1e12 * target.mfu, per="GPU",
                  note=f"{target.mfu:.0%} of {target.gpu.peak_tflops:g} TFLOPS"
                       + (", forward recomputed (checkpointing)" if memory.checkpointing else ""))]

    # units kept fetched at the turns: the device's room left over (GPU memory beside the
    # working set), within stage3_max_reuse_distance
    room = max(0, target.device_budget_bytes - memory.device_total)
    reused = reuse_bytes(memory.engine.max_reuse_numel * c, room, c * shard) \
        if lay.stage == 3 and lay.param_tier != Tier.DEVICE else 0
    down = up = 0.0                                               # device -> host, host -> device
    # several ranks reduce in the communication dtype and copy the shard down in it (see
    # [Note: gradients reduced on the device] in optim/device_gradients.py)
    g = DTYPE_BYTES[memory.derived.device_grad_dtype] if n > 1 else 4
    if lay.stage == 3 and lay.param_tier != Tier.DEVICE:
        up += max(0.0, 2 * c * shard * accum - REUSE_TURNS * reused)
    if lay.opt_tier != Tier.DEVICE:
        down += g * opt_elems * accum
        if lay.param_tier == Tier.DEVICE:
            up += c * (shard if lay.stage == 3 else opt_elems)
    elif not lay.early_step:                  # the engine keeps gradients in host memory: down
        down += lay.grad_bytes * grad_elems * accum   # per micro-step, up again for the
        up += lay.grad_bytes * grad_elems             # device's step
    pcie = target.gpu.pcie_GBps * 1e9 * LINK_EFFICIENCY
    links.append(Link(name="PCIe host<->GPU", amount=max(up, down), unit="B", rate=pcie, per="GPU",
                      note=f"up {up / 1e9:.1f} GB, down {down / 1e9:.1f} GB"))

    read, write = nvme_traffic(lay, memory.engine.grad_tier, accum, reused=reused)
    ranks = target.gpus_per_node
    if read or write:
        links.append(Link(name="NVMe read", amount=ranks * read, unit="B",
                          rate=max(target.nvme_read_GBps, 1e-9) * 1e9, per="node",
                          note=f"{target.nvme_drives} drive(s), {target.nvme_read_GBps:g} GB/s"))
        links.append(Link(name="NVMe write", amount=ranks * write, unit="B",
                          rate=max(target.nvme_write_GBps, 1e-9) * 1e9, per="node",
                          note=f"{target.nvme_drives} drive(s), {target.nvme_write_GBps:g} GB/s"))

    if n > 1:
        ring = (n - 1) / n                  # g: the communication dtype's bytes
        if lay.stage == 3:
            gather, scatter = 2 * c * params * ring * accum, g * params * ring * accum
        elif lay.stage >= 1:
            gather, scatter = c * params * ring, g * params * ring * accum
        else:
            gather, scatter = 0.0, 2 * g * params * ring * accum
        where = "NVLink" if target.nodes == 1 and target.gpu.nvlink_GBps else \
            "PCIe" if target.nodes == 1 else "network"
        links.append(Link(name=f"collectives ({where})", amount=gather + scatter, unit="B",
                          rate=target.collective_GBps * 1e9 * LINK_EFFICIENCY, per="GPU",
                          note=f"all-gather {gather / 1e9:.1f} GB, reduce-scatter/all-reduce "
                               f"{scatter / 1e9:.1f} GB"))

    if lay.opt_tier != Tier.DEVICE:
        node_params = ranks * opt_elems
        per_core = adam_params_per_core(lay.state_format)
        per_param = adam_bytes_per_param(lay)
        rate, limit = cpu_adam_rate(lay, target)
        fmt = "" if lay.state_format.is_default else f" ({lay.state_format.label}, {per_param:g} B)"
        links.append(Link(name="CPU Adam", amount=node_params, unit="param", rate=rate, per="node",
                          note=f"{target.cpu_cores} cores x {round(per_core / 1e9, 2):g} G/s, "
                               f"{target.host_memory_GBps:g} GB/s memory{fmt}: {limit}-bound"))

    bound, bottleneck = slowest_lane(links)
    predicted = bound * OVERLAP_FACTOR
    return StepTime(links=tuple(links), bound_s=bound, predicted_s=predicted,
                    bottleneck=bottleneck,
                    tokens_per_s=n * tokens / predicted if predicted else 0.0,
                    tflops_per_gpu=model_flops / predicted / 1e12 if predicted else 0.0,
                    model_flops_per_step=model_flops)
