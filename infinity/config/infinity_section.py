"""The ``"infinity"`` section: our own keys (memory budgets, schedules, compute choices)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from infinity.config.values import ConfigError, check_choice, check_size, set_field
from infinity.base.malloc_tuning import GLIBC_MAX_THRESHOLD


@dataclass(frozen=True, kw_only=True)
class InfinitySection:
    """``"infinity"``: our own keys: memory budgets and compute choices."""

    host_memory_budget: int | None = None
    """Bytes of host memory for the HOST tier and buffers; None = 80% of MemAvailable at start."""
    device_memory_budget: int | None = None
    """Bytes for the DEVICE tier; None = the GPU's free memory (CPU-only: the planner's choice)."""
    early_step: Literal["auto", "on", "off"] = "auto"
    """Step a unit's offloaded optimizer as soon as its gradient arrives; "auto" = when correctness allows."""
    speculative_step: Literal["auto", "on", "off"] = "auto"
    """Where the early step is not exact (clipping, fp16 loss scaling, accumulation), step each
    unit during backward anyway into second copies of its NVMe states, and keep them when the
    step needs no clipping and no skip (else redo the step from the first copies). Doubles the
    NVMe space of parameters and Adam states; "auto" = on at stage 3 with both on NVMe when the
    disk has room, and for a step only while the last step kept its speculation."""
    unit_modules: tuple[str, ...] | None = None
    """Class names of modules that form units; None = detect the repeated blocks."""
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Forward/backward dtype; "auto" = on CPU-only machines bf16 where the CPU multiplies bf16
    natively (flags + a timed probe; not with fp16.enabled), else fp32; on GPUs from bf16/fp16.enabled."""
    malloc_mmap_threshold: int | None = 4 * 1024 * 1024
    """glibc: host allocations of at least this size are mapped and unmapped on their own (and
    the heap is trimmed after each step), so freed gradients and activations go back to the
    system instead of fragmenting the heap (peak RSS); None = leave malloc alone."""
    offload_activations: Literal["auto", "none", "nvme"] = "auto"
    """"nvme": tensors the training forward saves for backward go to the swap space and are read
    back (ahead) in backward, so memory stops growing with depth; "none" keeps them in memory;
    "auto": "nvme" for a batch whose saved bytes (predicted by the planner from the model's and
    the batch's shapes) exceed what the host budget leaves beside the engine's pools, else
    "none" (without a swap directory: "none", with a warning naming the overshoot)."""
    detached_reads: Literal["hold", "off"] = "hold"
    """"hold": a unit whose parameter a training forward saved for backward without its gradient
    (``x * w.detach()``) is stepped and released only at the backward's end, after that read
    (see [Note: parameters read without a gradient] in zero/detached_reads.py); "off": no such
    watch, and no saved-tensor hooks of the engine's but the activation swapper's when it
    offloads (torch.func.grad/vjp inside a forward refuse to run under any): a ``.detach()``ed
    read of a parameter must then be ``.clone()``d."""
    activation_reserve: int | None = None
    """Bytes of the host budget kept for what a training step holds in memory beside the
    engine's pools: the saved activations kept there, autograd's gradient of a unit, the
    logits. The optimizer's slots are sized from what the budget leaves after it. None:
    nothing kept, the slots take it all and activations kept in memory go over the
    budget ("auto" offload sends them to the swap space where its staging fits);
    ``infinity train`` then sets it from its model and batch (see [Note: keeping activations
    within the host budget] in planner/activations.py)."""
    activation_min_bytes: int = 256 * 1024
    """Saved tensors smaller than this stay in memory (when activations are offloaded)."""
    swap_check: Literal["sampled", "full", "off"] = "sampled"
    """What a swap-in checks of the pages it reads against fingerprints taken when they were
    written: "sampled" (the first and last 8 bytes of each 4 KiB page: a whole file or any range
    reaching a page edge overwritten from outside), "full" (a CRC-32C of every page), or "off"
    (see [Note: swap-space integrity check] in storage/integrity.py)."""
    activation_window: int = 64 * 1024 * 1024
    """Bytes of swapped activations in memory at a time (when offloaded): the newest
    ones are held at the end of the forward, then reads run this far ahead of backward."""
    optimizer_moments: Literal["fp32", "bf16", "int8"] = "fp32"
    """Storage format of Adam's m and v on every tier and in checkpoints: "fp32" (4 + 4 bytes a
    parameter), "bf16" (2 + 2, rounded stochastically), or "int8" (1 + 1 and one fp32 scale per
    2048-element block, bitsandbytes' blockwise dynamic maps). The step runs in fp32 either way.
    A param group may set its own (e.g. "fp32" for embeddings); see docs/optimizer-formats.md."""
    optimizer_master: Literal["fp32", "bf16"] = "fp32"
    """The master weights: "fp32" (a separate fp32 copy beside 16-bit compute), or "bf16": the
    bf16 parameter is its own master, updated with stochastic rounding (seeded, reproducible),
    so no fp32 copy is stored at all. Needs bf16 compute."""
    collective_timeout: float = 1800.0
    """Seconds a collective waits for the other ranks before the run stops with an error naming
    the rank that is missing (a rank that raised or was killed); applies to the process group
    the engine creates, and, when the config sets it, to one made before (by
    ``infinity.init_distributed`` or torch). A rank that exited is named at once."""

    @property
    def mmap_threshold_in_use(self) -> int | None:
        """The malloc threshold the engine sets: with activations offloaded, at most
        ``activation_min_bytes``, so the memory of tensors that leave for NVMe goes back to
        the system instead of staying in the heap (peak RSS grew ~11 MB a layer without).
        "auto" uses ``offloaded_mmap_threshold``'s value for the forwards it offloads, this one
        for those it keeps in memory."""
        if self.offload_activations == "nvme":
            return self.offloaded_mmap_threshold
        return self.malloc_mmap_threshold

    @property
    def offloaded_mmap_threshold(self) -> int | None:
        """The malloc threshold while activations are offloaded (see ``mmap_threshold_in_use``)."""
        threshold = self.malloc_mmap_threshold
        return None if threshold is None else min(threshold, self.activation_min_bytes)

    def __post_init__(self) -> None:
        p = "infinity"
        set_field(self, "host_memory_budget", check_size(f"{p}.host_memory_budget", self.host_memory_budget))
        set_field(self, "malloc_mmap_threshold",
             check_size(f"{p}.malloc_mmap_threshold", self.malloc_mmap_threshold, lo=1))
        if self.malloc_mmap_threshold is not None and \
                self.malloc_mmap_threshold > GLIBC_MAX_THRESHOLD:
            raise ConfigError(f"{p}.malloc_mmap_threshold = {self.malloc_mmap_threshold}: glibc "
                              f"accepts at most 32 MiB ({GLIBC_MAX_THRESHOLD}); use null to leave "
                              "malloc alone")
        set_field(self, "device_memory_budget", check_size(f"{p}.device_memory_budget", self.device_memory_budget))
        check_choice(f"{p}.early_step", self.early_step, ("auto", "on", "off"))
        check_choice(f"{p}.speculative_step", self.speculative_step, ("auto", "on", "off"))
        if self.unit_modules is not None:
            names = self.unit_modules
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names or \
                    not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"{p}.unit_modules = {names!r}: expected a non-empty list of "
                                  "module class names, e.g. [\"LlamaDecoderLayer\"]")
            set_field(self, "unit_modules", tuple(names))
        check_choice(f"{p}.compute_dtype", self.compute_dtype, ("auto", "fp32", "bf16", "fp16"))
        check_choice(f"{p}.offload_activations", self.offload_activations,
                     ("auto", "none", "nvme"))
        check_choice(f"{p}.detached_reads", self.detached_reads, ("hold", "off"))
        check_choice(f"{p}.optimizer_moments", self.optimizer_moments, ("fp32", "bf16", "int8"))
        check_choice(f"{p}.optimizer_master", self.optimizer_master, ("fp32", "bf16"))
        check_choice(f"{p}.swap_check", self.swap_check, ("sampled", "full", "off"))
        timeout = self.collective_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 < timeout < 1e7:
            raise ConfigError(f"{p}.collective_timeout = {timeout!r}: expected seconds, a number "
                              "above 0 (e.g. 600)")
        set_field(self, "collective_timeout", float(timeout))
        set_field(self, "activation_reserve",
                  check_size(f"{p}.activation_reserve", self.activation_reserve))
        for name, lo in (("activation_min_bytes", 1), ("activation_window", 0)):
            value = check_size(f"{p}.{name}", getattr(self, name), lo=lo)
            if value is None:
                raise ConfigError(f"{p}.{name} needs a size (e.g. \"1MiB\"), got "
                                  f"{getattr(self, name)!r}")
            set_field(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.unit_modules is not None:
            out["unit_modules"] = list(self.unit_modules)
        return out

