"""Byte budgets per tier: holding more than the budget raises, it is not only reported.

Pure and importable from any layer (the I/O allocator counts its buffers here, the tier manager
and the planner size things from it).
"""
from __future__ import annotations

import threading

from infinity.base.sizes import format_bytes


class BudgetExceededError(MemoryError):
    """A reservation would take a tier past its budget."""


_HINTS = {
    "host": "raise infinity.host_memory_budget (`infinity plan` names the least this model and "
            "config need), or offload deeper where a state is not on NVMe yet "
            "(offload_optimizer / offload_param device \"nvme\")",
    "device": "raise infinity.device_memory_budget, or hold fewer units at once (a smaller "
              "stage3_prefetch_bucket_size / stage3_max_live_parameters; one backward per "
              "forward: two forwards summed into one backward hold both graphs' units; "
              "activation checkpointing a block at a time: a torch.utils.checkpoint span over "
              "several units holds all of them while its backward recomputes it)",
}


class MemoryBudget:
    """Counts bytes reserved against a limit (``None`` = unlimited, counted only)."""

    def __init__(self, name: str, limit: int | None, note: str = "") -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"{name} budget must be >= 0 bytes, got {limit}")
        self.name = name
        self.limit = limit
        self.note = note   # how the limit came about, told when it is exceeded
        self._held = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes reserved now."""
        return self._held

    @property
    def peak(self) -> int:
        """Most bytes ever reserved at once."""
        return self._peak

    @property
    def available(self) -> int | None:
        """Bytes that can still be reserved (``None`` when unlimited)."""
        return None if self.limit is None else self.limit - self._held

    def reserve(self, nbytes: int, what: str) -> None:
        """Reserve ``nbytes`` for ``what``; raises BudgetExceededError naming both sizes."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size ({nbytes}) for {what}")
        with self._lock:
            if self.limit is not None and self._held + nbytes > self.limit:
                raise BudgetExceededError(
                    f"{what} needs {format_bytes(nbytes)} of {self.name} memory but only "
                    f"{format_bytes(self.limit - self._held)} of the {format_bytes(self.limit)} "
                    f"{self.name} budget is free (short by "
                    f"{format_bytes(self._held + nbytes - self.limit)} here; pools are sized "
                    "from the budget, so the least that works is not this plus the budget); "
                    + _HINTS.get(self.name, _HINTS["host"])
                    + (f" ({self.note})" if self.note else ""))
            self._held += nbytes
            self._peak = max(self._peak, self._held)

    def release(self, nbytes: int) -> None:
        """Return ``nbytes`` reserved earlier."""
        with self._lock:
            if nbytes > self._held:
                raise RuntimeError(f"{self.name} budget: releasing {nbytes} bytes but only "
                                   f"{self._held} are held (double release?)")
            self._held -= nbytes

    def __repr__(self) -> str:
        limit = "unlimited" if self.limit is None else format_bytes(self.limit)
        return f"MemoryBudget({self.name}: {format_bytes(self._held)} held of {limit})"
