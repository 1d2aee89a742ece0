"""``AioConfig``: the knobs of the async I/O engine, named as in DeepSpeed's ``"aio"`` section.

Pure (no native calls), so the config parser and the planner can build and validate one anywhere.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping, get_args

Backend = Literal["auto", "io_uring", "libaio", "threads", "mmap"]
BACKEND_CHOICES: tuple[str, ...] = get_args(Backend)

MAX_QUEUE_DEPTH = 4096
MAX_THREAD_COUNT = 64
_PIECE_UNIT = 4096


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """How the engine moves bytes; validated on construction (errors name the field)."""

    backend: Backend = "auto"
    """"auto" picks io_uring, else libaio, else threads; "mmap" is for filesystems without O_DIRECT."""
    block_size: int = 1 << 20
    """Bytes per piece: a request is cut into pieces of this size (a multiple of 4096)."""
    queue_depth: int = 32
    """Pieces in flight per lane (ring/context size); the threads backend runs this many workers per lane."""
    thread_count: int = 1
    """Lanes, each with its own kernel queue and thread (DeepSpeed: thread_count / intra_op_parallelism)."""
    single_submit: bool = False
    """Submit pieces one syscall each instead of in batches."""
    overlap_events: bool = True
    """Refill a queue slot as soon as it completes; False submits a batch and waits for all of it."""
    intra_op_parallelism: int | None = None
    """Alias of thread_count (newer DeepSpeed name); when given it sets thread_count."""

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"AioConfig.backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        for name in ("single_submit", "overlap_events"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AioConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.intra_op_parallelism is not None:
            if self.thread_count not in (1, self.intra_op_parallelism):
                raise ValueError(
                    f"AioConfig.thread_count={self.thread_count} and its alias intra_op_parallelism="
                    f"{self.intra_op_parallelism} disagree; give only one of them")
            object.__setattr__(self, "thread_count", self.intra_op_parallelism)
        _check_int("block_size", self.block_size, _PIECE_UNIT, 1 << 30)
        if self.block_size % _PIECE_UNIT:
            raise ValueError(f"AioConfig.block_size must be a multiple of {_PIECE_UNIT} bytes, got "
                             f"{self.block_size}; try {max(_PIECE_UNIT, self.block_size // _PIECE_UNIT * _PIECE_UNIT)}")
        _check_int("queue_depth", self.queue_depth, 1, MAX_QUEUE_DEPTH)
        _check_int("thread_count", self.thread_count, 1, MAX_THREAD_COUNT)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "AioConfig":
        """Build from a DeepSpeed-style ``"aio"`` dict; unknown keys are errors with a suggestion.

        Sizes may be given as strings ("1MiB"). ``use_gds`` is accepted only when false.
        """
        from infinity.base.sizes import parse_bytes

        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in section.items():
            if key == "use_gds":
                if value:
                    raise ValueError("aio.use_gds=true: GPUDirect Storage is not supported; remove it")
                continue
            if key not in known:
                near = difflib.get_close_matches(key, sorted(known | {"use_gds"}), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"unknown aio key {key!r}{hint} (known: {sorted(known)})")
            if key == "block_size" and isinstance(value, str):
                value = parse_bytes(value)
            kwargs[key] = value
        return cls(**kwargs)


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"AioConfig.{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"AioConfig.{name} must be in [{lo}, {hi}], got {value}")
