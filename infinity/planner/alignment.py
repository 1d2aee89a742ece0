"""How elements are padded: O_DIRECT blocks on disk and in flat stores, SIMD alignment of each
parameter in a unit's flat buffer ([Note: flat layout] in zero/unit.py).

Pure arithmetic on element counts and item sizes (bytes per element), so the planner, storage
and the units compute the same numbers from one definition.
"""
from __future__ import annotations

import functools
from typing import Iterable

from infinity.base.sizes import ALIGN_BYTES

__all__ = ["ALIGN_BYTES", "PARAM_ALIGN_BYTES", "SHARD_ALIGN_NUMEL", "padded_numel", "flat_layout",
           "shard_numel", "unit_layout_bound"]

PARAM_ALIGN_BYTES = 64
"""Every parameter of a unit starts on this boundary of its flat buffer (SIMD alignment for the
Adam kernel)."""

FP32_BYTES = 4

SHARD_ALIGN_NUMEL = 2048
"""A rank's shard of a unit is a multiple of this many elements: 4 KiB of fp32 or 16-bit values,
so every shard starts on an O_DIRECT block in each state's store and in the flat buffer."""


def padded_numel(numel: int, itemsize: int) -> int:
    """``numel`` rounded up so that the byte size is a multiple of ALIGN_BYTES (O_DIRECT extents)."""
    per_block = ALIGN_BYTES // itemsize
    return -(-numel // per_block) * per_block


def flat_layout(params: Iterable[tuple[int, bool]], itemsize: int) -> tuple[list[int], int, int]:
    """[Note: flat layout] for (numel, trainable) pairs, trainable ones first: each one's offset,
    the flat buffer's numel and the trainable range's numel (both padded to 4 KiB)."""
    align = max(1, PARAM_ALIGN_BYTES // itemsize)
    offsets: list[int] = []
    offset = trainable_numel = 0
    for numel, trainable in params:
        offset = -(-offset // align) * align
        if trainable:
            trainable_numel = padded_numel(offset + numel, FP32_BYTES)
        elif offsets and offset < trainable_numel:
            offset = trainable_numel           # frozen ones start after the stepped range
        offsets.append(offset)
        offset += numel
    return offsets, max(padded_numel(offset, itemsize), trainable_numel), trainable_numel


def unit_layout_bound(params: Iterable[tuple[int, bool]], itemsize: int) -> tuple[int, int]:
    """An upper bound of a unit's flat numel and trainable numel for its (numel, trainable)
    parameters: each parameter rounded up to its alignment, so the order of param groups
    (which decides the real layout) cannot matter."""
    params = tuple(params)
    try:
        return _layout_bound(params, itemsize)     # a plan asks the same units many times
    except TypeError:                              # unhashable pairs (lists)
        return _layout_bound.__wrapped__(params, itemsize)


@functools.lru_cache(maxsize=8192)
def _layout_bound(params: tuple[tuple[int, bool], ...], itemsize: int) -> tuple[int, int]:
    align = max(1, PARAM_ALIGN_BYTES // itemsize)
    items = sorted(((-(-numel // align) * align, trainable) for numel, trainable in params),
                   key=lambda item: not item[1])
    _, numel, trainable = flat_layout(items, itemsize)
    return numel, trainable


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's shard of a unit's flat buffer of ``numel`` elements (see [Note:
    shards] in zero/shard.py): the whole buffer with one rank, else an equal 1/N of it rounded
    up to ``SHARD_ALIGN_NUMEL``, so the N shards cover ``world_size * shard`` elements, the tail
    padding."""
    if world_size < 1:
        raise ValueError(f"world size {world_size} must be at least 1")
    if world_size == 1:
        return numel
    per_rank = -(-numel // world_size)
    return -(-per_rank // SHARD_ALIGN_NUMEL) * SHARD_ALIGN_NUMEL


def first_rank_range(numel: int, trainable: int, world_size: int) -> int:
    """The trainable elements rank 0 steps of a unit (flat ``numel``, its first ``trainable``
    trainable) with its states sharded over ``world_size`` ranks: the largest range any rank
    steps of it, a figure every rank computes alike (a rank's own range is not: the last
    rank's shards are short). What sizes that must be one on every rank are sized from."""
    return min(shard_numel(numel, world_size), trainable)
