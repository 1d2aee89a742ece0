"""The ``"zero_optimization"`` section and its ``offload_param`` / ``offload_optimizer`` parts."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from infinity.config.values import (
    AUTO,
    ConfigError,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_size,
    log,
    set_field,
)

OffloadDevice = Literal["none", "cpu", "nvme"]
OFFLOAD_KEYS = {
    "optimizer": ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size",
                  "pipeline_read", "pipeline_write", "fast_init", "ratio"),
    "param": ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"),
}


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``: the home tier of optimizer states or parameters."""

    kind: Literal["optimizer", "param"] = "optimizer"
    """Which section this is (offload_optimizer or offload_param); decides the keys it takes."""
    device: OffloadDevice = "none"
    """Home tier: "none" (device), "cpu" (pinned host) or "nvme" (swap files at nvme_path)."""
    nvme_path: str | None = None
    """Directory for swap files; required when device is "nvme"."""
    pin_memory: bool = True
    """Page-lock the host buffers (faster device copies, counts as locked memory)."""
    buffer_count: int | None = None
    """Swap buffers in flight; None = derived by the planner (4 for the optimizer)."""
    buffer_size: int | None = None
    """Elements per swap buffer; None = derived (one sub-group / one unit's shard)."""
    max_in_cpu: int | None = None
    """offload_param only: parameter elements cached in host memory when device is "nvme"."""
    pipeline_read: bool = False
    """offload_optimizer only: overlap the swap-in of sub-group i+1 with the step of i."""
    pipeline_write: bool = False
    """offload_optimizer only: overlap the swap-out of sub-group i-1 with the step of i."""
    fast_init: bool = False
    """offload_optimizer only: skip writing initial optimizer states to NVMe one by one."""
    ratio: float = 1.0
    """offload_optimizer only: fraction of the states offloaded; only 1.0 is supported."""

    def __post_init__(self) -> None:
        check_choice("offload kind", self.kind, ("optimizer", "param"))
        p = self.path
        check_choice(f"{p}.device", self.device, ("none", "cpu", "nvme"))
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, Path)) or not str(self.nvme_path):
                raise ConfigError(f"{p}.nvme_path = {self.nvme_path!r}: expected a directory path")
            # "~/nvme" is the user's home (it was taken as a directory named "~", and the error
            # suggested `mkdir -p` of that literal path)
            set_field(self, "nvme_path", os.path.expanduser(str(self.nvme_path)))
        if self.device == "nvme" and self.nvme_path is None:
            raise ConfigError(f"{p}.device is \"nvme\" but {p}.nvme_path is not set: set it to a "
                              "directory on a fast local disk (swap files are created there)")
        check_bool(f"{p}.pin_memory", self.pin_memory)
        set_field(self, "buffer_count", check_size(f"{p}.buffer_count", self.buffer_count, lo=1))
        set_field(self, "buffer_size", check_size(f"{p}.buffer_size", self.buffer_size, lo=1))
        set_field(self, "max_in_cpu", check_size(f"{p}.max_in_cpu", self.max_in_cpu))
        for name in ("pipeline_read", "pipeline_write", "fast_init"):
            check_bool(f"{p}.{name}", getattr(self, name))
        set_field(self, "ratio", check_float(f"{p}.ratio", self.ratio, 0.0, 1.0))
        if self.ratio != 1.0:
            raise ConfigError(f"{p}.ratio = {self.ratio}: partial offload is not supported; "
                              "use 1.0 (offload all optimizer states) or device \"none\"")
        if self.kind == "param":
            for name, default in (("pipeline_read", False), ("pipeline_write", False),
                                  ("fast_init", False)):
                if getattr(self, name) != default:
                    raise ConfigError(f"{p}.{name} applies only to offload_optimizer")
        elif self.max_in_cpu is not None:
            raise ConfigError(f"{p}.max_in_cpu applies only to offload_param")

    @property
    def path(self) -> str:
        """The key path of this section, for messages."""
        return f"zero_optimization.offload_{self.kind}"

    def to_dict(self) -> dict[str, Any]:
        return {k: _auto_if_none(k, getattr(self, k)) for k in OFFLOAD_KEYS[self.kind]}


SIZE_KEYS = frozenset({"buffer_count", "buffer_size", "max_in_cpu", "sub_group_size",
                        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                        "stage3_max_live_parameters", "stage3_max_reuse_distance",
                        "reduce_bucket_size", "allgather_bucket_size"})


def _auto_if_none(key: str, value: Any) -> Any:
    return AUTO if value is None and key in SIZE_KEYS else value


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """``"zero_optimization"``: ZeRO stage, home tiers, and the sizes of sub-groups and buckets.

    Sizes count elements; ``None`` (written ``"auto"``) means derived from the memory budgets
    by ``infinity.planner.sizes.derive_sizes``.
    """

    stage: int = 0
    """0: replicate all; 1: shard optimizer states; 2: also gradients; 3: also parameters."""
    offload_optimizer: OffloadConfig = field(default_factory=lambda: OffloadConfig(kind="optimizer"))
    """Home tier of fp32 master weights and Adam moments."""
    offload_param: OffloadConfig = field(default_factory=lambda: OffloadConfig(kind="param"))
    """Home tier of parameter shards (stage 3 only)."""
    sub_group_size: int | None = None
    """Elements of optimizer state stepped (and swapped) at once."""
    stage3_prefetch_bucket_size: int | None = None
    """Parameter elements fetched ahead of use."""
    stage3_param_persistence_threshold: int | None = None
    """Parameters with fewer elements stay on the device (never released)."""
    stage3_max_live_parameters: int | None = None
    """Most parameter elements fetched on the device at once."""
    stage3_max_reuse_distance: int | None = None
    """A released parameter reused within this many elements is kept instead."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Gather full weights into one state dict when saving."""
    overlap_comm: bool | None = None
    """Overlap collectives with compute; None = on for stage 3 (DeepSpeed's rule)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_bucket_size: int | None = None
    """Gradient elements reduced at once."""
    allgather_bucket_size: int | None = None
    """Parameter elements all-gathered at once (stages 1-2)."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter instead of all-reduce."""
    round_robin_gradients: bool = False
    """Stage 1-2 with offload: spread gradient copies over ranks round-robin."""

    def __post_init__(self) -> None:
        p = "zero_optimization"
        set_field(self, "stage", check_int(f"{p}.stage", self.stage, 0, 3))
        for name, kind in (("offload_optimizer", "optimizer"), ("offload_param", "param")):
            section = getattr(self, name)
            if not isinstance(section, OffloadConfig) or section.kind != kind:
                raise ConfigError(f"{p}.{name}: expected OffloadConfig(kind={kind!r}), got {section!r}")
        if self.sub_group_size == 0 and not isinstance(self.sub_group_size, bool):
            # DeepSpeed reads 0 as a sub-group per parameter; here sub-groups follow the units
            log.info("%s.sub_group_size = 0 (DeepSpeed: a sub-group per parameter) is taken as "
                      "\"auto\" (sub-groups follow the units)", p)
            set_field(self, "sub_group_size", None)
        for name in ("sub_group_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                     "stage3_max_reuse_distance", "reduce_bucket_size", "allgather_bucket_size"):
            lo = 1 if name in ("sub_group_size", "reduce_bucket_size") else 0
            set_field(self, name, check_size(f"{p}.{name}", getattr(self, name), lo=lo))
        for name in ("stage3_gather_16bit_weights_on_model_save", "contiguous_gradients",
                     "reduce_scatter", "round_robin_gradients"):
            check_bool(f"{p}.{name}", getattr(self, name))
        if self.overlap_comm is None:
            set_field(self, "overlap_comm", self.stage == 3)
        check_bool(f"{p}.overlap_comm", self.overlap_comm)
        if self.offload_param.device != "none" and self.stage < 3:
            raise ConfigError(f"{p}.offload_param.device = {self.offload_param.device!r} needs "
                              f"ZeRO stage 3 but {p}.stage = {self.stage}: set \"stage\": 3")
        if self.offload_optimizer.device != "none" and self.stage < 1:
            raise ConfigError(f"{p}.offload_optimizer.device = {self.offload_optimizer.device!r} "
                              f"needs ZeRO stage 1, 2 or 3 but {p}.stage = 0: set \"stage\" (3 for "
                              "the most memory savings)")

    @property
    def swap_path(self) -> str | None:
        """The directory the swap space goes under: the ``nvme_path`` of a section offloaded to
        "nvme" (the parameters', then the optimizer's), else either's (activations offloaded to
        NVMe with both sections on the CPU). A path left on a "cpu" section is not used while
        the other section offloads to "nvme" (DeepSpeed ignores it there; it took the swap
        space away from the NVMe the user chose, or failed on a path that does not exist)."""
        for section in (self.offload_param, self.offload_optimizer):
            if section.device == "nvme" and section.nvme_path:
                return section.nvme_path
        return self.offload_param.nvme_path or self.offload_optimizer.nvme_path

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, OffloadConfig) else _auto_if_none(f.name, value)
        return out


