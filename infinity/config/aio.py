"""``AioConfig``: the ``"aio"`` section, the native async I/O engine's knobs (DeepSpeed's keys).

One definition with one set of limits, used by the config parser (``InfinityConfig.aio``) and by
the I/O engine itself (``infinity.io.AioEngine``), so a value the config accepts is one the engine
accepts. The limits are the native engine's (native/src/aio_core.c: ``AIO_MAX_THREADS``,
``AIO_MAX_QUEUE_DEPTH``; pieces a multiple of 4096 bytes). Pure: no native calls.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, get_args

from infinity.base.sizes import ALIGN_BYTES
from infinity.config.values import (
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_size,
    set_field,
)

__all__ = ["AioConfig", "Backend", "BACKEND_CHOICES", "MAX_THREAD_COUNT", "MAX_QUEUE_DEPTH",
           "MAX_BLOCK_SIZE"]

Backend = Literal["auto", "io_uring", "libaio", "threads", "mmap"]
BACKEND_CHOICES: tuple[str, ...] = get_args(Backend)

MAX_THREAD_COUNT = 64
"""Most lanes the native engine runs (AIO_MAX_THREADS in native/src/aio_core.c)."""
MAX_QUEUE_DEPTH = 4096
"""Most pieces in flight per lane (AIO_MAX_QUEUE_DEPTH in native/src/aio_core.c)."""
MAX_BLOCK_SIZE = 1 << 30
"""Largest piece (1 GiB)."""


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """``"aio"``: how the native async I/O engine moves swap-file extents (DeepSpeed's keys);
    validated on construction, each error naming its key ("aio.thread_count")."""

    block_size: int = 1 << 20
    """Bytes per piece: a request is cut into pieces of this size (a multiple of 4096 for O_DIRECT)."""
    queue_depth: int = 32
    """Pieces in flight per lane (DeepSpeed's default is 8; 32 reads faster here, peers/RESULTS.md)."""
    thread_count: int = 1
    """Lanes, each with its own kernel queue and thread (DeepSpeed's intra_op_parallelism)."""
    single_submit: bool = False
    """Submit pieces one syscall each instead of in batches."""
    overlap_events: bool = True
    """Refill a queue slot as soon as it completes; False submits a batch and waits for all of it."""
    use_gds: bool = False
    """GPUDirect Storage; not supported (must be false)."""
    backend: Backend = "auto"
    """I/O backend; "auto" tries io_uring, then libaio, then threads; "mmap" is for filesystems
    without O_DIRECT."""

    def __post_init__(self) -> None:
        set_field(self, "block_size", check_size("aio.block_size", self.block_size, lo=ALIGN_BYTES))
        if self.block_size is None or self.block_size % ALIGN_BYTES:
            raise ConfigError(f"aio.block_size = {self.block_size!r}: expected a multiple of "
                              f"{ALIGN_BYTES} bytes (O_DIRECT alignment), e.g. 1MiB")
        if self.block_size > MAX_BLOCK_SIZE:
            raise ConfigError(f"aio.block_size = {self.block_size!r} is out of range: expected at "
                              f"most {MAX_BLOCK_SIZE} (1GiB)")
        set_field(self, "queue_depth", check_int("aio.queue_depth", self.queue_depth, 1,
                                                 MAX_QUEUE_DEPTH))
        set_field(self, "thread_count", check_int("aio.thread_count", self.thread_count, 1,
                                                  MAX_THREAD_COUNT))
        check_bool("aio.single_submit", self.single_submit)
        check_bool("aio.overlap_events", self.overlap_events)
        check_bool("aio.use_gds", self.use_gds)
        if self.use_gds:
            raise ConfigError("aio.use_gds = true: GPUDirect Storage is not supported by infinity; "
                              "set it to false (swap-ins go through pinned host buffers)")
        check_choice("aio.backend", self.backend, BACKEND_CHOICES)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "AioConfig":
        """Build from a DeepSpeed-style ``"aio"`` dict, read as the config reader reads that
        section: aliases (``intra_op_parallelism``), sizes as strings ("1MiB"), unknown keys
        refused with a suggestion."""
        from infinity.config.infinity_config import InfinityConfig

        return InfinityConfig.from_dict({"aio": dict(section)}).aio
