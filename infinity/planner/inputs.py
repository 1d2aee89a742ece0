"""What the planner plans for: the model (counts of elements per unit, Llama presets) and the
machine (cores, host memory, GPU memory, free disk at the swap path). Pure and importable from
anywhere; ``infinity.planner.plan`` uses them.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from infinity.base.cpu_bf16 import detect_cpu_bf16
from infinity.base.machine import machine_id
from infinity.planner.shape import ModelShape

# Llama-style presets as transformers LlamaConfig kwargs (untied embeddings, vocab 32000).
# 125M and 1B are the sizes of shared/peers/DS_E2E.md (134.1M and 940.6M parameters).
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "85M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=12,
                num_attention_heads=9, num_key_value_heads=9, vocab_size=32000),
    "125M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12, vocab_size=32000),
    "0.5B": dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=20,
                 num_attention_heads=20, num_key_value_heads=20, vocab_size=32000),
    "1B": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=16, vocab_size=32000),
    "7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "13B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, vocab_size=32000),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
}
for _preset in LLAMA_PRESETS.values():
    _preset.update(tie_word_embeddings=False, max_position_embeddings=4096)


# ----------------------------------------------------------------------------------------------
# Inputs: the model and the machine.

@dataclass(frozen=True, kw_only=True)
class ModelStats:
    """What the planner needs to know about a model: counts of elements, not the tensors."""

    total_params: int
    """Parameter elements (a shared parameter counted once)."""
    trainable_params: int
    """Elements of parameters that require grad."""
    largest_unit_params: int
    """Elements of the largest unit (a transformer block, the embeddings, the head)."""
    n_units: int
    """Number of units."""
    largest_param: int
    """Elements of the largest single parameter."""
    param_numels: tuple[int, ...] | None = None
    """Every parameter's element count (the units' padded layouts); None = unknown."""
    unit_numels: tuple[int, ...] | None = None
    """Every unit's element count, in order; None = unknown (``units()`` assumes equal units)."""

    def __post_init__(self) -> None:
        for name in ("total_params", "trainable_params", "largest_unit_params", "n_units",
                     "largest_param"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelStats.{name} = {value!r}: expected an integer >= 0")
        if self.trainable_params > self.total_params or self.largest_unit_params > self.total_params:
            raise ValueError(f"ModelStats: trainable_params ({self.trainable_params}) and "
                             f"largest_unit_params ({self.largest_unit_params}) must not exceed "
                             f"total_params ({self.total_params})")

    def units(self) -> list[int]:
        """Each unit's element count: as counted, else ``n_units`` units of the largest size
        whose sum is the total (one smaller unit taking the remainder)."""
        if self.unit_numels is not None:
            return list(self.unit_numels)
        unit, left, out = max(1, self.largest_unit_params), self.total_params, []
        for _ in range(self.n_units):
            out.append(min(unit, left))
            left -= out[-1]
        return [u for u in out if u] or [0]

    def split_into_parameters(self) -> "ModelStats":
        """The same model with every parameter its own unit (``infinity.unit_modules`` naming
        the linear layers' class), or ``self`` when the sizes are unknown."""
        if self.param_numels is None:
            return self
        return dataclasses.replace(self, largest_unit_params=self.largest_param,
                                   n_units=len(self.param_numels), unit_numels=self.param_numels)

    @classmethod
    def from_counts(cls, total_params: int, largest_unit_params: int, n_units: int,
                    trainable_params: int | None = None, *,
                    largest_param: int | None = None) -> "ModelStats":
        """Stats from counts alone (unit sizes unknown: ``units`` makes them the largest)."""
        return cls(total_params=int(total_params),
                   trainable_params=int(total_params if trainable_params is None else trainable_params),
                   largest_unit_params=int(largest_unit_params), n_units=int(n_units),
                   largest_param=int(largest_unit_params if largest_param is None else largest_param))

    @classmethod
    def from_module(cls, model: Any, unit_modules: Iterable[str] | None = None) -> "ModelStats":
        """Count a ``torch.nn.Module`` (works on the meta device, so 70B costs no memory).

        Units follow DESIGN.md: one per repeated block (modules whose class is in
        ``unit_modules``, else the most repeated class inside a ModuleList); every other module
        that owns parameters directly is its own unit; a shared parameter belongs to the first
        unit that holds it.
        """
        import torch

        names = set(unit_modules) if unit_modules else _repeated_block_class(model, torch.nn)
        seen: set[int] = set()  # local dedupe of shared (tied) parameters; ids live only here
        units: list[int] = []
        numels: list[int] = []
        trainable = 0

        def claim(params: Iterable[Any]) -> int:
            nonlocal trainable
            total = 0
            for p in params:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                numels.append(p.numel())
                total += p.numel()
                trainable += p.numel() if p.requires_grad else 0
            return total

        blocks = [m for m in _outermost(model, names)] if names else []
        for block in blocks:
            units.append(claim(block.parameters()))
        in_block = {id(m) for b in blocks for m in b.modules()}
        for module in model.modules():
            if id(module) not in in_block:
                size = claim(module.parameters(recurse=False))
                if size:
                    units.append(size)
        units = [u for u in units if u]
        return cls(total_params=sum(numels), trainable_params=trainable,
                   largest_unit_params=max(units, default=0), n_units=len(units),
                   largest_param=max(numels, default=0), param_numels=tuple(numels),
                   unit_numels=tuple(units))


def _repeated_block_class(model: Any, nn: Any) -> set[str]:
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                if any(True for _ in child.parameters()):
                    counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    if not counts or max(counts.values()) < 2:
        return set()
    return {max(counts, key=counts.get)}


def _outermost(model: Any, class_names: set[str]) -> list[Any]:
    found: list[Any] = []

    def walk(module: Any) -> None:
        for child in module.children():
            if type(child).__name__ in class_names:
                found.append(child)
            else:
                walk(child)
    walk(model)
    return found


def llama_stats(kwargs: dict[str, Any]) -> ModelStats:
    """Exact stats of a LlamaForCausalLM with these LlamaConfig kwargs, without building it.

    Per block: q, o (h*h), k, v (h * kv_heads * head_dim), gate, up, down (h*i), two RMSNorms (h);
    plus embeddings (V*h), a final norm (h) and, untied, the head (V*h). No biases.
    """
    h, i = kwargs["hidden_size"], kwargs["intermediate_size"]
    layers, vocab = kwargs["num_hidden_layers"], kwargs["vocab_size"]
    heads = kwargs["num_attention_heads"]
    head_dim = kwargs.get("head_dim") or h // heads
    kv = kwargs.get("num_key_value_heads") or heads
    block = [heads * head_dim * h, kv * head_dim * h, kv * head_dim * h, h * heads * head_dim,
             h * i, h * i, i * h, h, h]
    numels = [vocab * h] + block * layers + [h]
    units = [vocab * h] + [sum(block)] * layers + [h]
    if not kwargs.get("tie_word_embeddings", False):
        numels.append(vocab * h)
        units.append(vocab * h)
    return ModelStats(total_params=sum(numels), trainable_params=sum(numels),
                      largest_unit_params=max(units), n_units=len(units),
                      largest_param=max(numels), param_numels=tuple(numels),
                      unit_numels=tuple(units))


def shape_stats(shape: ModelShape) -> ModelStats:
    """Exact stats of the Llama of ``shape`` (full multi-head attention; the number of heads
    does not change a count), parameter by parameter. An estimated shape (``--params``) is
    planned through it, so a block too large to fetch is split one unit per parameter
    (``split_into_parameters`` needs every parameter's size) as it is for a config."""
    return llama_stats(dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                            num_hidden_layers=shape.layers, num_attention_heads=1,
                            num_key_value_heads=1, vocab_size=shape.vocab,
                            tie_word_embeddings=shape.tied))


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The machine as the planner sees it (``detect_hardware``, or written by hand in tests)."""

    cpu_cores: int
    """Cores this process may run on."""
    host_total_bytes: int
    """MemTotal."""
    host_available_bytes: int
    """MemAvailable now."""
    gpu_name: str | None = None
    """CUDA device name; None on CPU-only machines."""
    gpu_total_bytes: int | None = None
    """Device memory of the current GPU."""
    gpu_free_bytes: int | None = None
    """Free device memory now."""
    nvme_path: str | None = None
    """Where swap files would go."""
    disk_free_bytes: int | None = None
    """Free bytes on the filesystem of nvme_path."""
    ranks_per_node: int = 1
    """Ranks sharing this machine's memory (the launcher's LOCAL_WORLD_SIZE; with several
    ranks, at least those that found the same ``machine``: see ``agreed_hardware``)."""
    machine: str = ""
    """The machine this was detected on (``base.machine.machine_id``); "" for a described one."""
    cpu_bf16: bool = False
    """The CPU multiplies bf16 natively (flags and a timed probe: ``infinity.base.cpu_bf16``);
    decides what compute_dtype "auto" means where there is no GPU."""
    cpu_bf16_reason: str = ""
    """Why cpu_bf16 is what it is (for the log and ``infinity plan``); empty when not asked."""

    @property
    def has_gpu(self) -> bool:
        """True when a CUDA device computes; else the device is an emulated pool in host RAM."""
        return self.gpu_total_bytes is not None


def ranks_counted_per_machine(everyone: Sequence[Hardware]) -> list[Hardware]:
    """Each rank's detection with its ranks per node at least the ranks that detected the same
    machine: a launcher that does not set LOCAL_WORLD_SIZE (DeepSpeed's sets LOCAL_SIZE; srun,
    mpirun, variables set by hand) left each rank of a node 80% of its memory, the node
    overcommitted as many times as it has ranks."""
    counts = collections.Counter(hw.machine for hw in everyone if hw.machine)
    return [dataclasses.replace(hw, ranks_per_node=max(hw.ranks_per_node, counts[hw.machine]))
            if hw.machine else hw for hw in everyone]


def agreed_hardware(everyone: Sequence[Hardware], rank: int) -> Hardware:
    """[Note: one machine for every rank's plan]
    Each rank detects its own machine, and the plan's decisions follow it: without a host
    budget the device pool, the persistence threshold (which units are gathered ahead, so the
    order of collectives), the gradient home and the step schedule come from MemAvailable or
    the GPU's free memory. Ranks on machines with different free memory (another job on one
    node) would plan different runs and wait on each other's collectives, so every rank plans
    for the most constrained machine: the host memory of the rank with the least of it per
    rank of its node (its MemAvailable and its ranks per node, a pair: the planner divides the
    one by the other), the least of each other size over ranks, bf16 "auto" only where every
    rank's CPU has it. ``everyone``: each rank's own detection, by rank; the result keeps this
    rank's GPU name and swap path."""
    everyone = ranks_counted_per_machine(everyone)
    own = everyone[rank]
    tightest = min(everyone, key=lambda hw: hw.host_available_bytes / max(1, hw.ranks_per_node))

    def least(values: list[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    without = [r for r, hw in enumerate(everyone) if not hw.cpu_bf16]
    reason = own.cpu_bf16_reason
    if own.cpu_bf16 and without:
        reason = f"rank(s) {', '.join(map(str, without))} have no native bf16"
    return dataclasses.replace(
        own, cpu_cores=min(hw.cpu_cores for hw in everyone),
        host_total_bytes=tightest.host_total_bytes,
        host_available_bytes=tightest.host_available_bytes,
        ranks_per_node=tightest.ranks_per_node,
        gpu_total_bytes=least([hw.gpu_total_bytes for hw in everyone])
        if own.has_gpu else None,
        gpu_free_bytes=least([hw.gpu_free_bytes for hw in everyone]) if own.has_gpu else None,
        disk_free_bytes=least([hw.disk_free_bytes for hw in everyone]),
        cpu_bf16=not without, cpu_bf16_reason=reason)


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """``path`` (absolute), or its nearest ancestor that exists: where a path not made yet will
    be (its free space, whether it can be written)."""
    nearest = Path(path).absolute()
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    return nearest


def detect_hardware(nvme_path: str | os.PathLike[str] | None = None) -> Hardware:
    """Cores, host memory (/proc/meminfo), the GPU's memory (torch.cuda), free disk at nvme_path,
    and on CPU-only machines whether the CPU multiplies bf16 natively (probed once a process)."""
    meminfo: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                meminfo[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = meminfo.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = meminfo.get("MemAvailable", total)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpu_name = gpu_total = gpu_free = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu_free, gpu_total = torch.cuda.mem_get_info()
            gpu_name = torch.cuda.get_device_name()
    except ImportError:
        pass
    cpu_bf16, cpu_bf16_reason = False, ""
    if gpu_total is None:    # a GPU computes otherwise: its CPU's bf16 does not matter
        answer = detect_cpu_bf16()
        cpu_bf16, cpu_bf16_reason = answer.native, answer.reason
    disk_free = None
    if nvme_path is not None:
        # the swap dir may not exist yet: ask its filesystem
        st = os.statvfs(nearest_existing(nvme_path))
        disk_free = st.f_bavail * st.f_frsize
    return Hardware(cpu_cores=cores, host_total_bytes=total, host_available_bytes=available,
                    gpu_name=gpu_name, gpu_total_bytes=gpu_total, gpu_free_bytes=gpu_free,
                    nvme_path=None if nvme_path is None else str(nvme_path),
                    disk_free_bytes=disk_free, ranks_per_node=local_world_size(),
                    machine=machine_id(),
                    cpu_bf16=cpu_bf16, cpu_bf16_reason=cpu_bf16_reason)


def local_world_size() -> int:
    """Ranks on this machine as the launcher says (torchrun's ``LOCAL_WORLD_SIZE``, else the
    deepspeed launcher's ``LOCAL_SIZE``), never more than ``WORLD_SIZE``; 1 when none is set.
    Not Slurm's or MPI's task counts, which a single process inside an allocation inherits;
    with several ranks ``ranks_counted_per_machine`` counts those on one machine anyway."""
    def number(name: str) -> int:
        raw = os.environ.get(name, "").strip()
        return int(raw) if raw.isdigit() and int(raw) > 0 else 0
    world = number("WORLD_SIZE") or 1
    return min(world, number("LOCAL_WORLD_SIZE") or number("LOCAL_SIZE") or 1)
