"""The storage format of a unit's optimizer states: Adam's moments in fp32, bf16 or blockwise
int8, and the master in fp32 or as the bf16 parameter itself (issue 38).

Why here, in the planner: the format decides bytes on every tier (host stores, NVMe extents,
checkpoint files) and so the plan; the optimizer (optim/) reads the same object to choose its
stores and kernel. One definition of the bytes, below both.

[Note: a unit's state format]
Formats are chosen per param group (the ``"infinity"`` section's ``optimizer_moments`` and
``optimizer_master`` are every group's defaults, a group may set its own), but a unit's states
are flat stores over all its trainable parameters, so one format serves the unit. A unit whose
parameters' groups ask for different formats takes the most precise one asked (fp32 > bf16 >
int8 for the moments, fp32 > bf16 for the master): a group never gets fewer bits than it asked
for, and the engine logs which units were kept more precise. A unit whose state range has fewer
than ``MIN_INT8_NUMEL`` elements keeps fp32 moments when int8 is asked (bitsandbytes keeps
tensors under its ``min_8bit_size`` of 4096 in 32 bits: their scales would be most of their
bytes, and they are the norms and biases whose few values matter most). A unit with fp32
moments keeps an fp32 master: the stochastically rounded bf16 master is written by the fused
bf16 / int8 moments kernels only (so ``optimizer_master`` "bf16" needs ``optimizer_moments``
"bf16" or "int8").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

from infinity.planner.alignment import SHARD_ALIGN_NUMEL

__all__ = ["MOMENTS_FORMATS", "MASTER_FORMATS", "QBLOCK", "INT8_CHUNK", "MIN_INT8_NUMEL",
           "StateFormat",
           "int8_sub_group_refusal", "Int8SubGroupError",
           "FP32_STATES", "unit_format", "int8_blocks", "StateStore", "keeps_fp32_master",
           "unit_stores", "COMPARED_FORMATS"]

MOMENTS_FORMATS = ("fp32", "bf16", "int8")
"""Formats of m and v, most precise first."""
MASTER_FORMATS = ("fp32", "bf16")
"""Formats of the master, most precise first."""
QBLOCK = 2048
"""Elements per int8 block (one fp32 scale per block per moment; INF_ADAM_QBLOCK)."""
INT8_CHUNK = 2 * QBLOCK
"""The fewest elements int8 moments are stepped in: two blocks (4 KiB of codes); an int8
state's sub-groups are multiples of it (``optim.records.sub_groups``)."""
MIN_INT8_NUMEL = 4096
"""A unit state smaller than this keeps fp32 moments when int8 is asked (see the note)."""

if SHARD_ALIGN_NUMEL % QBLOCK:
    # a rank's range starts at a shard edge, and its int8 blocks from there: with shard edges off
    # the block grid, ranks would cut blocks differently and checkpoints could not copy blocks
    raise RuntimeError(f"SHARD_ALIGN_NUMEL {SHARD_ALIGN_NUMEL} is not a multiple of the int8 "
                       f"block {QBLOCK}")

_MOMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def int8_blocks(numel: int) -> int:
    """Blocks (scales per moment) of an int8 state of ``numel`` elements."""
    return (int(numel) + QBLOCK - 1) // QBLOCK


@dataclass(frozen=True)
class StateFormat:
    """How one unit's optimizer states are stored (see [Note: a unit's state format])."""

    moments: str = "fp32"
    master: str = "fp32"

    def __post_init__(self) -> None:
        if self.moments not in MOMENTS_FORMATS:
            raise ValueError(f"optimizer_moments must be one of {MOMENTS_FORMATS}, got "
                             f"{self.moments!r}")
        if self.master not in MASTER_FORMATS:
            raise ValueError(f"optimizer_master must be one of {MASTER_FORMATS}, got "
                             f"{self.master!r}")

    @property
    def is_default(self) -> bool:
        """fp32 moments and an fp32 master: today's bytes and kernel, bit for bit."""
        return self.moments == "fp32" and self.master == "fp32"

    @property
    def moment_itemsize(self) -> int:
        """Bytes of one stored moment element (int8: the code; its scales come on top)."""
        return _MOMENT_BYTES[self.moments]

    def moment_bytes(self, numel: int) -> int:
        """Bytes of m and v together for a state of ``numel`` elements, scales included."""
        scales = 2 * 4 * int8_blocks(numel) if self.moments == "int8" else 0
        return 2 * self.moment_itemsize * int(numel) + scales

    def moment_bytes_per_param(self) -> float:
        """m + v (+ int8 scales) per element, for plans by counts."""
        scales = 2 * 4 / QBLOCK if self.moments == "int8" else 0.0
        return 2 * self.moment_itemsize + scales

    def describe(self) -> str:
        master = "fp32 master" if self.master == "fp32" else "bf16 master (stochastic rounding)"
        return f"{self.moments} moments, {master}"

    @property
    def label(self) -> str:
        """A short name: "fp32", "bf16 moments", "int8 moments", "int8 + bf16 master"."""
        if self.is_default:
            return "fp32"
        if self.master == "bf16":
            return f"{self.moments} + bf16 master"
        return f"{self.moments} moments"

    @property
    def moments_note(self) -> str:
        """How m and v are stored, for a plan's line ("int8, blockwise")."""
        return "int8, blockwise" if self.moments == "int8" else self.moments


FP32_STATES = StateFormat()


def unit_format(asked: Iterable[StateFormat], state_numel: int) -> StateFormat:
    """The format of a unit whose trainable parameters' groups ask for ``asked`` (see [Note: a
    unit's state format]); fp32 when nothing is asked."""
    asked = list(asked) or [FP32_STATES]
    moments = min((f.moments for f in asked), key=MOMENTS_FORMATS.index)
    master = min((f.master for f in asked), key=MASTER_FORMATS.index)
    if moments == "int8" and state_numel < MIN_INT8_NUMEL:
        moments = "fp32"
    if moments == "fp32":
        master = "fp32"     # the fp32 kernel keeps an fp32 master (see the note)
    return StateFormat(moments, master)


class Int8SubGroupError(ValueError):
    """A sub-group too small for int8 moments (``int8_sub_group_refusal``): raised by the run
    plan, so that a table comparing formats shows that format refused instead of failing."""

    short = "the sub-group is under one int8 chunk (4096 elements)"


def int8_sub_group_refusal(sub_group_numel: int, largest_range: int | None = None) -> str | None:
    """Why int8 moments cannot be stepped in sub-groups of ``sub_group_numel`` elements, or
    None where they can: the kernel steps them in chunks of two blocks, so a sub-group must
    hold one, except where the largest range a rank steps (``largest_range``, the same on every
    rank) is smaller: that range is one sub-group whatever its size. One message for the
    engine's check of each unit and the run plan's of the config (they disagreed: the plan said
    "fits" for a sub_group_size the engine refused)."""
    chunk = INT8_CHUNK
    least = chunk if largest_range is None else min(chunk, largest_range)
    if sub_group_numel >= least:
        return None
    return (f"int8 moments are stepped in chunks of at least {chunk} elements (two "
            f"{QBLOCK}-element blocks, 4 KiB of codes), but the run plan sized the sub-group at "
            f"{sub_group_numel} (zero_optimization.sub_group_size rounded up to a multiple of "
            f"2048, or what the host budget leaves the optimizer's slots): set sub_group_size to "
            f"at least {chunk} and give the host budget room (where only a param group asks "
            "for int8, asking for it in infinity.optimizer_moments too makes the plan size the "
            "sub-group for it)")


COMPARED_FORMATS = (FP32_STATES, StateFormat("bf16"), StateFormat("int8"),
                    StateFormat("int8", "bf16"))
"""The formats ``infinity plan`` compares beside its recommendation."""


class StateStore(NamedTuple):
    """One store of a unit's optimizer state (``optim.state_formats.build_state`` makes it)."""

    name: str
    """"exp_avg", "exp_avg_sq", "master", "exp_avg.scales" or "exp_avg_sq.scales"."""
    numel: int
    itemsize: int
    in_host: bool
    """The int8 scales stay in host memory; the rest live in the optimizer's tier."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def keeps_fp32_master(fmt: StateFormat, *, master_separate: bool, compute_itemsize: int) -> bool:
    """Whether a unit in ``fmt`` (its own, after ``unit_format``) keeps a separate fp32 master:
    an fp32 master where the compute copy is not the fp32 parameter itself on a CPU device
    (``master_separate``: the run plan's, not single copy) or not fp32 (a bf16-master run's
    unit that kept fp32 moments keeps an fp32 master too)."""
    return fmt.master == "fp32" and (master_separate or compute_itemsize != 4)


def unit_stores(fmt: StateFormat, numel: int, *, fp32_master: bool) -> list[StateStore]:
    """The optimizer's stores of a unit in ``fmt`` (its own) over a range of ``numel``
    elements, as the optimizer makes them (unpadded: the tier manager pads each to 4 KiB)."""
    n = max(int(numel), 1)      # a shard past the trainable part steps nothing
    stores = [StateStore("exp_avg", n, fmt.moment_itemsize, False),
              StateStore("exp_avg_sq", n, fmt.moment_itemsize, False)]
    if fp32_master:
        stores.append(StateStore("master", n, 4, False))
    if fmt.moments == "int8":
        stores += [StateStore("exp_avg.scales", int8_blocks(n), 4, True),
                   StateStore("exp_avg_sq.scales", int8_blocks(n), 4, True)]
    return stores
