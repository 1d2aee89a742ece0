"""``infinity plan``'s target flags: the machine a plan is for, described instead of detected
(``--gpus 8 --gpu H100 --host-memory 2TiB --nvme 4x7TB``), and the workload's shape. With none of
them the plan is for this machine, as before.

    infinity plan --params 1T --gpus 8 --gpu-memory 80GiB --host-memory 2TiB --nvme 28TB
    infinity plan --hf-config config.json --gpus 16 --gpu V100-32G --host-memory 1.5TB --nvme 8x3.84TB --json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from infinity.base.sizes import parse_bytes
from infinity.planner.target import (
    CUSTOM_GPU,
    DEFAULT_CORES_PER_GPU,
    DEFAULT_HOST_MEMORY_GBPS,
    DEFAULT_HOST_MEMORY_PER_GPU_MEMORY,
    DEFAULT_NET_GBPS,
    DEFAULT_NVME_DRIVE_READ_GBPS,
    DEFAULT_NVME_DRIVE_WRITE_GBPS,
    GPU_PRESETS,
    Target,
    Workload,
)

__all__ = ["add_target_arguments", "target_from_args", "TARGET_FLAGS"]

TARGET_FLAGS = ("gpus", "gpu", "gpu_memory", "gpu_tflops", "pcie_GBps", "nvlink_GBps", "nodes",
                "host_memory", "cpu_cores", "nvme", "nvme_read_GBps", "nvme_write_GBps",
                "nvme_tune", "net_GBps", "host_memory_GBps", "mfu")
WORKLOAD_FLAGS = ("seq_len", "micro_batch", "grad_accum", "activation_checkpointing")
_DRIVES = re.compile(r"^\s*(\d+)\s*[xX]\s*(.+)$")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "target machine (any of these plans for the machine described, not this one)")
    g.add_argument("--gpus", type=int, metavar="N", help="GPUs per node (one rank each)")
    g.add_argument("--gpu", choices=sorted(GPU_PRESETS),
                   help="GPU preset: memory, peak 16-bit TFLOPS, PCIe/NVLink GB/s (each overridable)")
    g.add_argument("--gpu-memory", metavar="BYTES", help="memory per GPU, e.g. 80GiB")
    g.add_argument("--gpu-tflops", type=_positive_float, metavar="TF", help="peak dense 16-bit TFLOPS per GPU")
    g.add_argument("--pcie-GBps", type=_positive_float, metavar="GB/s", dest="pcie_GBps",
                   help="host<->GPU bandwidth per GPU, one direction")
    g.add_argument("--nvlink-GBps", type=_positive_float, metavar="GB/s", dest="nvlink_GBps",
                   help="GPU<->GPU bandwidth per GPU inside a node, one direction")
    g.add_argument("--nodes", type=int, metavar="K", help="nodes (default 1)")
    g.add_argument("--host-memory", metavar="BYTES", help="host memory per node, e.g. 2TiB")
    g.add_argument("--cpu-cores", type=int, metavar="N", help="CPU cores per node")
    g.add_argument("--nvme", metavar="SIZE", help="NVMe space per node: a total (28TB) or drives (4x7TB)")
    g.add_argument("--nvme-read-GBps", type=_positive_float, metavar="GB/s", dest="nvme_read_GBps",
                   help="NVMe read per node, all drives")
    g.add_argument("--nvme-write-GBps", type=_positive_float, metavar="GB/s", dest="nvme_write_GBps",
                   help="NVMe write per node, all drives")
    g.add_argument("--nvme-tune", metavar="RESULT_JSON",
                   help="`infinity nvme-tune --json` output: its recommended point's read and write "
                        "GB/s, per drive of --nvme NxSIZE (or for the whole volume)")
    g.add_argument("--net-GBps", type=_positive_float, metavar="GB/s", dest="net_GBps",
                   help=f"inter-node bandwidth per node (default {DEFAULT_NET_GBPS:g})")
    g.add_argument("--host-memory-GBps", type=_positive_float, metavar="GB/s", dest="host_memory_GBps",
                   help=f"host memory bandwidth per node, for the CPU Adam (default {DEFAULT_HOST_MEMORY_GBPS:g})")
    g.add_argument("--mfu", type=_positive_float, metavar="SHARE",
                   help="share of the GPU peak forward/backward reach (default 0.4)")
    w = parser.add_argument_group("workload (with target flags)")
    w.add_argument("--seq-len", type=int, metavar="N", help="tokens per sample (default 2048)")
    w.add_argument("--micro-batch", type=int, metavar="N", help="samples per GPU per micro-step (default 1)")
    w.add_argument("--grad-accum", type=int, metavar="N", help="micro-steps per optimizer step (default 1)")
    w.add_argument("--activation-checkpointing", nargs="?", const="on", choices=("auto", "on", "off"),
                   help="recompute activations in backward (bare flag: on; default auto: only "
                        "when they do not fit otherwise)")


MIN_MACHINE_BYTES = 1 << 20
"""A size of a machine's memory or disk below this is a missing unit (``--gpu-memory 80``
read as 80 bytes planned an impossible GPU and gave no useful advice)."""


def _machine_bytes(text: str, flag: str, example: str) -> int:
    """``text`` as bytes for ``flag``; refused when it is too small to be a machine's."""
    value = parse_bytes(text, flag)
    if value < MIN_MACHINE_BYTES:
        raise ValueError(f"{flag} {text}: {value:,} bytes is no machine's {flag[2:]}; give the "
                         f"unit, e.g. {flag} {example}")
    return value


def _nvme(text: str | None) -> tuple[int, int]:
    """(bytes, drives) of --nvme."""
    if text is None:
        return 0, 1
    match = _DRIVES.match(text)
    if match:
        drives = int(match.group(1))
        if drives < 1:
            raise ValueError(f"--nvme {text}: at least one drive")
        return drives * _machine_bytes(match.group(2), "--nvme", "28TB"), drives
    if text.strip() == "0":
        return 0, 1                 # no NVMe, said outright
    return _machine_bytes(text, "--nvme", "28TB"), 1


def _tuned(path: str) -> tuple[float, float, dict | None]:
    """(read, write) GB/s of an ``infinity nvme-tune --json`` result's recommended point, and
    the ``"aio"`` section it was measured with (the plan's ds_config carries it: the rates
    are those settings')."""
    try:
        data = json.loads(Path(path).read_text())
        best = data["recommendation"]
        aio = best.get("aio")
        return float(best["read_GBps"]), float(best["write_GBps"]), \
            dict(aio) if isinstance(aio, dict) else None
    except OSError as exc:
        raise ValueError(f"--nvme-tune {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--nvme-tune {path}: not an `infinity nvme-tune --json` result "
                         f"(needs recommendation.read_GBps and write_GBps; {type(exc).__name__}: "
                         f"{exc})") from None


def target_from_args(args: argparse.Namespace) -> tuple[Target, Workload] | None:
    """The target and workload the flags describe; None when no target flag is given."""
    given = [name for name in TARGET_FLAGS if getattr(args, name, None) is not None]
    workload_given = [name for name in WORKLOAD_FLAGS if getattr(args, name, None) is not None]
    if not given:
        if workload_given:
            flag = "--" + workload_given[0].replace("_", "-")
            raise ValueError(f"{flag} describes the workload of a target machine: give the target "
                             "too (--gpus with --gpu or --gpu-memory)")
        return None
    assumed: list[str] = []
    if args.gpu is None and args.gpu_memory is None:
        raise ValueError("a target machine needs its GPU: --gpu H100|H200|A100-80G|A100-40G|"
                         "V100-32G|4090, or --gpu-memory (e.g. 80GiB)")
    gpu = GPU_PRESETS[args.gpu] if args.gpu else CUSTOM_GPU
    if args.gpu is None:
        assumed.append(f"GPU compute and links of an A100 without NVLink ({gpu.peak_tflops:g} "
                       f"TFLOPS, PCIe {gpu.pcie_GBps:g} GB/s; --gpu or --gpu-tflops/--pcie-GBps)")
    changes: dict[str, object] = {}
    if args.gpu_memory is not None:
        changes["memory_bytes"] = _machine_bytes(args.gpu_memory, "--gpu-memory", "80GiB")
    for flag, field in (("gpu_tflops", "peak_tflops"), ("pcie_GBps", "pcie_GBps"),
                        ("nvlink_GBps", "nvlink_GBps")):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    if changes:
        gpu = dataclasses.replace(gpu, name=gpu.name if args.gpu else "custom", **changes)
    gpus = 1 if args.gpus is None else args.gpus
    nodes = 1 if args.nodes is None else args.nodes
    if gpus < 1 or nodes < 1:
        raise ValueError(f"--gpus {gpus} and --nodes {nodes} must be >= 1")
    if args.world_size is not None and args.world_size != gpus * nodes:
        raise ValueError(f"--world-size {args.world_size} is not --gpus x --nodes = {gpus} x "
                         f"{nodes} = {gpus * nodes}: leave --world-size out, or make them agree")
    if args.host_memory is None:
        host = DEFAULT_HOST_MEMORY_PER_GPU_MEMORY * gpus * gpu.memory_bytes
        assumed.append(f"host memory {DEFAULT_HOST_MEMORY_PER_GPU_MEMORY}x the node's GPU memory "
                       "(--host-memory)")
    else:
        host = _machine_bytes(args.host_memory, "--host-memory", "2TiB")
    cores = args.cpu_cores
    if cores is None:
        cores = DEFAULT_CORES_PER_GPU * gpus
        assumed.append(f"{DEFAULT_CORES_PER_GPU} CPU cores per GPU (--cpu-cores)")
    elif cores < 1:
        raise ValueError(f"--cpu-cores {cores} must be >= 1")
    nvme_bytes, drives = _nvme(args.nvme)
    read, write = args.nvme_read_GBps, args.nvme_write_GBps
    aio = None
    if args.nvme_tune is not None:
        tuned_read, tuned_write, aio = _tuned(args.nvme_tune)
        read = read if read is not None else tuned_read * drives
        write = write if write is not None else tuned_write * drives
    if nvme_bytes and (read is None or write is None):
        assumed.append(f"NVMe {DEFAULT_NVME_DRIVE_READ_GBPS:g} GB/s read and "
                       f"{DEFAULT_NVME_DRIVE_WRITE_GBPS:g} GB/s write per drive x {drives} "
                       "(--nvme-tune or --nvme-read-GBps/--nvme-write-GBps)")
    read = DEFAULT_NVME_DRIVE_READ_GBPS * drives if read is None else read
    write = DEFAULT_NVME_DRIVE_WRITE_GBPS * drives if write is None else write
    if nodes > 1 and args.net_GBps is None:
        assumed.append(f"network {DEFAULT_NET_GBPS:g} GB/s per node (--net-GBps)")
    if args.host_memory_GBps is None:
        assumed.append(f"host memory bandwidth {DEFAULT_HOST_MEMORY_GBPS:g} GB/s per node "
                       "(--host-memory-GBps)")
    if args.mfu is None:
        assumed.append("40% of the GPU's peak in forward/backward (--mfu)")
    target = Target(gpu=gpu, gpus_per_node=gpus, nodes=nodes, host_memory_bytes=host, aio=aio,
                    cpu_cores=cores, nvme_bytes=nvme_bytes, nvme_drives=drives,
                    nvme_read_GBps=read, nvme_write_GBps=write,
                    net_GBps=DEFAULT_NET_GBPS if args.net_GBps is None else args.net_GBps,
                    host_memory_GBps=(DEFAULT_HOST_MEMORY_GBPS if args.host_memory_GBps is None
                                      else args.host_memory_GBps),
                    mfu=0.4 if args.mfu is None else args.mfu, assumed=tuple(assumed))
    def pick(value: int | None, default: int, flag: str) -> int:
        if value is not None and value < 1:
            raise ValueError(f"--{flag} {value} must be >= 1")
        return default if value is None else value
    workload = Workload(seq_len=pick(args.seq_len, 2048, "seq-len"),
                        micro_batch=pick(args.micro_batch, 1, "micro-batch"),
                        gradient_accumulation_steps=pick(args.grad_accum, 1, "grad-accum"),
                        activation_checkpointing=args.activation_checkpointing or "auto")
    return target, workload
