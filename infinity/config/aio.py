"""The ``"aio"`` section: the native async I/O engine's knobs (DeepSpeed's keys)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from infinity.config.values import (
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_size,
    set_field,
)


@dataclass(frozen=True, kw_only=True)
class AioSection:
    """``"aio"``: the native async I/O engine that moves swap-file extents (DeepSpeed's keys)."""

    block_size: int = 1 << 20
    """Bytes per I/O request (a multiple of 4096 for O_DIRECT)."""
    queue_depth: int = 32
    """Requests in flight per thread (DeepSpeed's default is 8; 32 reads faster here, peers/RESULTS.md)."""
    thread_count: int = 1
    """I/O threads per request (DeepSpeed's intra_op_parallelism)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Submit new requests while completions are reaped."""
    use_gds: bool = False
    """GPUDirect Storage; not supported (must be false)."""
    backend: Literal["auto", "io_uring", "libaio", "threads", "mmap"] = "auto"
    """I/O backend; "auto" tries io_uring, then libaio, then threads."""

    def __post_init__(self) -> None:
        set_field(self, "block_size", check_size("aio.block_size", self.block_size, lo=4096))
        if self.block_size is None or self.block_size % 4096:
            raise ConfigError(f"aio.block_size = {self.block_size!r}: expected a multiple of 4096 "
                              "bytes (O_DIRECT alignment), e.g. 1MiB")
        set_field(self, "queue_depth", check_int("aio.queue_depth", self.queue_depth, 1, 4096))
        set_field(self, "thread_count", check_int("aio.thread_count", self.thread_count, 1, 256))
        check_bool("aio.single_submit", self.single_submit)
        check_bool("aio.overlap_events", self.overlap_events)
        check_bool("aio.use_gds", self.use_gds)
        if self.use_gds:
            raise ConfigError("aio.use_gds = true: GPUDirect Storage is not supported by infinity; "
                              "set it to false (swap-ins go through pinned host buffers)")
        check_choice("aio.backend", self.backend, ("auto", "io_uring", "libaio", "threads", "mmap"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


