"""The machine a plan is for, described by hand (``infinity plan --gpus 8 --gpu H100 ...``), not
detected: GPU presets with public figures, nodes, host memory, cores, NVMe and network, and the
workload's shape (sequence length, micro-batch, activation checkpointing).

Pure and importable from anywhere. A ``Target`` turns into the ``Hardware`` one rank of it sees
(``Target.hardware``), so the sizing rules of ``infinity.planner.sizes`` and ``engine_sizes``
apply to it unchanged. Every value the user did not give is an assumption, named in
``Target.assumed`` so the plan can say which of its numbers rest on a guess.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from infinity.planner.inputs import Hardware

__all__ = ["GpuSpec", "GPU_PRESETS", "Target", "Workload", "DEVICE_RESERVE_BYTES",
           "DEFAULT_NVME_DRIVE_READ_GBPS", "DEFAULT_NVME_DRIVE_WRITE_GBPS", "DEFAULT_NET_GBPS",
           "DEFAULT_HOST_MEMORY_PER_GPU_MEMORY", "DEFAULT_CORES_PER_GPU",
           "DEFAULT_HOST_MEMORY_GBPS"]

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One GPU model: what the plan needs of it (bandwidths in GB/s = 1e9 B/s, per direction)."""

    name: str
    """Preset name, or "custom"."""
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi's total)."""
    peak_tflops: float
    """Dense 16-bit tensor-core peak (bf16 where it has bf16, else fp16), FP32 accumulate."""
    dtype: Literal["bf16", "fp16"]
    """The 16-bit compute type it trains in: fp16 (with loss scaling) where it has no bf16."""
    pcie_GBps: float
    """Host <-> device, one direction, theoretical (x16 link)."""
    nvlink_GBps: float | None
    """GPU <-> GPU inside a node, one direction per GPU; None: peers talk over PCIe."""


# Public figures. Memory: the total nvidia-smi reports for the card (81559 MiB for an H100 SXM
# 80GB, 143771 MiB for an H200 SXM 141GB, 81920 / 40960 MiB for A100 SXM4 80GB / 40GB, 32768 MiB
# for a V100 SXM2 32GB, 24564 MiB for an RTX 4090). Peak 16-bit dense tensor TFLOPS and link
# bandwidths from NVIDIA's datasheets: H100 SXM5 and H200 SXM datasheets (BF16 1,979 TFLOPS
# "with sparsity" = 989 dense; NVLink 900 GB/s total = 450 per direction; PCIe Gen5 128 GB/s
# both ways = 64 per direction); A100 datasheet (BF16 312 TFLOPS dense; NVLink 600 GB/s = 300
# per direction; PCIe Gen4 64 GB/s both ways = 32); V100 datasheet (SXM2: 125 TFLOPS fp16
# tensor, no bf16; NVLink 300 GB/s = 150 per direction; PCIe Gen3 32 GB/s both ways = 16);
# RTX 4090: NVIDIA Ada Lovelace architecture whitepaper, appendix table (FP16/BF16 tensor with
# FP32 accumulate 165.2 TFLOPS dense; PCIe Gen4 x16; no NVLink).
GPU_PRESETS: dict[str, GpuSpec] = {
    "H100": GpuSpec(name="H100", memory_bytes=81559 * MiB, peak_tflops=989.0, dtype="bf16",
                    pcie_GBps=64.0, nvlink_GBps=450.0),
    "H200": GpuSpec(name="H200", memory_bytes=143771 * MiB, peak_tflops=989.0, dtype="bf16",
                    pcie_GBps=64.0, nvlink_GBps=450.0),
    "A100-80G": GpuSpec(name="A100-80G", memory_bytes=81920 * MiB, peak_tflops=312.0,
                        dtype="bf16", pcie_GBps=32.0, nvlink_GBps=300.0),
    "A100-40G": GpuSpec(name="A100-40G", memory_bytes=40960 * MiB, peak_tflops=312.0,
                        dtype="bf16", pcie_GBps=32.0, nvlink_GBps=300.0),
    "V100-32G": GpuSpec(name="V100-32G", memory_bytes=32768 * MiB, peak_tflops=125.0,
                        dtype="fp16", pcie_GBps=16.0, nvlink_GBps=150.0),
    "4090": GpuSpec(name="4090", memory_bytes=24564 * MiB, peak_tflops=165.2, dtype="bf16",
                    pcie_GBps=32.0, nvlink_GBps=None),
}

# ---- assumptions for what the user did not give (each is named in Target.assumed) ------------
DEVICE_RESERVE_BYTES = 2 * GiB
"""Device memory the plan keeps out of its budget: the CUDA context, NCCL's and cuBLAS's
buffers, the caching allocator's fragmentation."""
CUSTOM_GPU = GpuSpec(name="custom", memory_bytes=80 * GiB, peak_tflops=312.0, dtype="bf16",
                     pcie_GBps=32.0, nvlink_GBps=None)
"""--gpu-memory without --gpu: an A100's compute and PCIe Gen4, no NVLink."""
DEFAULT_HOST_MEMORY_PER_GPU_MEMORY = 2
"""Host memory per node when not given: this many times the node's GPU memory (DGX H100 has
2 TiB for 8 x 80 GB, 3.2x; DGX-2 1.5 TB for 16 x 32 GB, 2.9x; a conservative 2x)."""
DEFAULT_CORES_PER_GPU = 8
"""CPU cores per GPU when not given (DGX H100: 112 for 8 GPUs; DGX-2: 48 for 16)."""
DEFAULT_NVME_DRIVE_READ_GBPS = 3.0
DEFAULT_NVME_DRIVE_WRITE_GBPS = 2.0
"""Per drive, with O_DIRECT and the reads and writes of a step overlapping: a conservative
figure for a PCIe Gen4 data-centre drive (rated 6-7 GB/s read, 3-5 write). Measure yours with
``infinity nvme-tune --json`` and pass it as ``--nvme-tune``."""
DEFAULT_NET_GBPS = 50.0
"""Inter-node bandwidth per node, one direction (4 x 100 Gb/s): only used with --nodes > 1."""
DEFAULT_HOST_MEMORY_GBPS = 200.0
"""Host memory bandwidth per node that the CPU Adam can use (STREAM-like, both sockets); the
Adam step moves 30 B per parameter (BENCHMARKS.md, CPU Adam: ``ours_bf16copy``)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one rank computes per micro-step."""

    seq_len: int = 2048
    """Tokens per sample."""
    micro_batch: int = 1
    """Samples per micro-step per rank."""
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Recompute each block's activations in backward; "auto": only when they do not fit
    otherwise."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} = {value!r}: expected an integer >= 1")
        if self.activation_checkpointing not in ("auto", "on", "off"):
            raise ValueError(f"Workload.activation_checkpointing = {self.activation_checkpointing!r}:"
                             " expected auto, on or off")

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank trains on per optimizer step."""
        return self.seq_len * self.micro_batch * self.gradient_accumulation_steps


@dataclass(frozen=True, kw_only=True)
class Target:
    """A cluster of ``nodes`` identical nodes of ``gpus_per_node`` GPUs (one rank per GPU).

    Host memory, cores, NVMe and network are per node; bandwidths in GB/s (1e9 B/s)."""

    gpu: GpuSpec
    gpus_per_node: int = 1
    nodes: int = 1
    host_memory_bytes: int
    """Host memory of one node."""
    cpu_cores: int
    """Cores of one node (the CPU Adam runs on them)."""
    nvme_bytes: int = 0
    """NVMe space of one node for swap files (0: none)."""
    nvme_drives: int = 1
    """Drives the swap files are striped over (or one RAID-0 volume of them)."""
    nvme_read_GBps: float = 0.0
    """Sequential read of one node's NVMe, all drives together."""
    nvme_write_GBps: float = 0.0
    """Sequential write of one node's NVMe, all drives together."""
    net_GBps: float = DEFAULT_NET_GBPS
    """Inter-node bandwidth per node, one direction."""
    host_memory_GBps: float = DEFAULT_HOST_MEMORY_GBPS
    """Host memory bandwidth of one node."""
    mfu: float = 0.4
    """Share of the GPU's peak the forward and backward reach (the paper's 512-GPU run: 40%)."""
    aio: dict | None = None
    """The ``"aio"`` section ``infinity nvme-tune`` measured its NVMe rates with, for the plan's
    ds_config (None: not tuned)."""
    assumed: tuple[str, ...] = field(default=())
    """Names of the fields the user did not give (assumptions, shown in the plan)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes", "cpu_cores", "nvme_drives"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Target.{name} = {value!r}: expected an integer >= 1")
        for name in ("host_memory_bytes", "nvme_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Target.{name} = {getattr(self, name)!r}: must not be negative")
        for name in ("nvme_read_GBps", "nvme_write_GBps", "net_GBps", "host_memory_GBps"):
            if getattr(self, name) < 0:
                raise ValueError(f"Target.{name} = {getattr(self, name)!r}: must not be negative")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Target.mfu = {self.mfu!r}: expected a share of the peak in (0, 1]")

    @property
    def world_size(self) -> int:
        """Ranks: one per GPU."""
        return self.gpus_per_node * self.nodes

    @property
    def device_budget_bytes(self) -> int:
        """What one GPU offers the plan: its memory less DEVICE_RESERVE_BYTES."""
        return max(0, self.gpu.memory_bytes - DEVICE_RESERVE_BYTES)

    @property
    def collective_GBps(self) -> float:
        """Per-GPU bandwidth of a ring all-gather / reduce-scatter, one direction: NVLink (or
        PCIe) inside a node; across nodes the slower of that and the node's network share."""
        inside = self.gpu.nvlink_GBps or self.gpu.pcie_GBps
        if self.nodes == 1:
            return inside
        return min(inside, self.net_GBps / self.gpus_per_node)

    def hardware(self, nvme_path: str | None = None) -> Hardware:
        """The machine as one rank on a node sees it: the node's memory shared by its ranks
        (``ranks_per_node``), one GPU, the node's NVMe space."""
        return Hardware(cpu_cores=self.cpu_cores, host_total_bytes=self.host_memory_bytes,
                        host_available_bytes=self.host_memory_bytes,
                        gpu_name=self.gpu.name, gpu_total_bytes=self.gpu.memory_bytes,
                        gpu_free_bytes=self.device_budget_bytes, nvme_path=nvme_path,
                        disk_free_bytes=self.nvme_bytes, ranks_per_node=self.gpus_per_node)

    def with_(self, **changes: object) -> "Target":
        """A copy with ``changes`` (the plan's "what if": more nodes, more memory)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
