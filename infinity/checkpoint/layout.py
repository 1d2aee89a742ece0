"""What a checkpoint holds of an engine, and in which order: shared by save and load.

Two tensor files per rank. ``rank{r}_model.safetensors``: every parameter by its name in
``named_parameters()`` (a tied parameter once, under the name of the unit that owns it; its
other names are listed as aliases in the manifest), trainable ones as their fp32 master,
frozen ones in their own dtype, then the module's persistent buffers.
``rank{r}_optim.safetensors``: ``<name>.exp_avg`` and ``<name>.exp_avg_sq`` of every trainable
parameter, in the unit's state format (a bf16 master is the BF16 parameter of the model file:
see [Note: moments in their format in a checkpoint] in checkpoint/moment_files.py). In both, tensors come unit by unit in flat-layout order, which is the order the
stores are streamed in, so each file is written front to back.

[Note: checkpoints by parameter and slice]
With N ranks, rank r writes the slice of each parameter that lies in its range of each unit
(``owned``: the r-th of N equal shards of the flat buffer, see [Note: shards] in
zero/unit.py), as a 1-D tensor named ``<name>#<first element>`` (checkpoint/sliced.py); the
buffers go in rank 0's file only. Because every tensor is named by parameter and element range,
not by rank or unit layout, a checkpoint saved at N ranks loads at M: each loading rank reads
the slices that cover its own range from whichever files hold them (DeepSpeed needs a separate
"universal checkpoint" conversion for this). One rank writes whole tensors, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import Part, Source, parts_of
from infinity.planner.alignment import shard_numel
from infinity.zero.persistent_buffers import all_persistent_buffers
from infinity.zero.unit import ParamEntry, Unit

if TYPE_CHECKING:
    from infinity.optim.partitioned import UnitOptimState

MOMENTS = ("exp_avg", "exp_avg_sq")


def model_file(rank: int) -> str:
    return f"rank{rank}_model.safetensors"


def optim_file(rank: int) -> str:
    return f"rank{rank}_optim.safetensors"


@dataclass(frozen=True)
class Placed:
    """A flat state in its home: element 0 is the unit's element ``origin``, and it holds the
    unit's elements [``covers[0]``, ``covers[1]``) (the own shard, or all of them)."""

    source: Source
    origin: int
    covers: tuple[int, int]


@dataclass(eq=False)
class UnitLayout:
    """One unit's parameters and where their current values live."""

    unit: Unit
    state: "UnitOptimState | None"
    with_frozen: bool = True     # False: frozen parameters are left out (a LoRA-style save)
    rank: int = 0
    world_size: int = 1

    @property
    def owned(self) -> tuple[int, int]:
        """The unit elements this rank saves (see [Note: checkpoints by parameter and slice])."""
        size = shard_numel(self.unit.numel, self.world_size)
        return self.rank * size, min((self.rank + 1) * size, self.unit.numel)

    @property
    def placed_params(self) -> Placed:
        unit = self.unit
        if unit.param_store is None:          # a persistent unit: its device copy, all of it
            return Placed(unit.flat, 0, (0, unit.numel))
        start = unit.home_start
        return Placed(unit.param_store, start, (start, min(start + unit.home_numel, unit.numel)))

    def placed_state(self, store: Source) -> Placed:
        """A store of the optimizer state (master or a moment): its range of the unit."""
        return Placed(store, self.state.lo, (self.state.lo, self.state.hi))

    def saved_parts(self, placed: Placed, entries: list[ParamEntry]) -> list[Part]:
        """The parts of ``entries`` this rank saves from ``placed``."""
        a, b = placed.covers
        lo, hi = self.owned
        return parts_of(entries, (max(a, lo), min(b, hi)))

    def tensor_name(self, part: Part, suffix: str = "") -> tuple[str, tuple[int, ...]]:
        """The file tensor of a part, and its shape: whole parameters with one rank, else a
        slice (see [Note: checkpoints by parameter and slice])."""
        entry, x, y = part
        if self.world_size == 1:
            return entry.name + suffix, tuple(entry.shape)
        return slice_name(entry.name + suffix, x - entry.offset), (y - x,)

    @property
    def entries(self) -> list[ParamEntry]:
        return sorted(self.unit.params, key=lambda e: e.offset)

    @property
    def trainable(self) -> list[ParamEntry]:
        return [e for e in self.entries if e.trainable]

    @property
    def frozen(self) -> list[ParamEntry]:
        return [e for e in self.entries if not e.trainable]

    @property
    def params(self) -> Source:
        """The unit's parameters in their home (a persistent unit's device copy is its home)."""
        unit = self.unit
        return unit.param_store if unit.param_store is not None else unit.flat

    @property
    def master(self) -> Source | None:
        """The separate fp32 master, or None when the parameters are their own master."""
        return None if self.state is None else self.state.master

    def model_sources(self) -> list[tuple[Placed, list[Part]]]:
        """Where the model file's values of this unit come from, and the parts this rank
        saves of each, in file order."""
        if self.master is not None:
            sources = [(self.placed_state(self.master), self.trainable),
                       (self.placed_params, self.frozen)]
        else:
            sources = [(self.placed_params, self.entries)]
        if not self.with_frozen:
            sources = [(placed, [e for e in entries if e.trainable]) for placed, entries in sources]
        return [(placed, self.saved_parts(placed, entries)) for placed, entries in sources]

    @property
    def saved(self) -> list[ParamEntry]:
        """The entries the model files hold (all ranks' together)."""
        return [e for e in self.entries if self.with_frozen or e.trainable]

    def file_dtype(self, entry: ParamEntry) -> torch.dtype:
        return torch.float32 if entry.trainable and self.master is not None else self.unit.dtype


def unit_layouts(state: TrainingState, with_frozen: bool = True) -> list[UnitLayout]:
    by_unit = {s.unit.index: s for s in state.unit_states}
    return [UnitLayout(u, by_unit.get(u.index), with_frozen, state.rank, state.world_size)
            for u in state.units]


SLICE_MARK = "#"


def slice_name(name: str, first: int) -> str:
    """The file tensor holding elements [first, ...) of the flattened tensor ``name`` (a
    parameter's name never holds '#': names are Python identifiers joined by dots)."""
    return f"{name}{SLICE_MARK}{first}"


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers ``state_dict()`` saves, each once (under its first name)."""
    found, seen = [], set()
    for name, buf in all_persistent_buffers(model):
        if buf not in seen:
            seen.add(buf)
            found.append((name, buf))
    return found


def aliases(model: nn.Module, units: Sequence[Unit]) -> dict[str, str]:
    """Other names of tied parameters and shared buffers -> the name they are saved under."""
    canonical = {e.param: e.name for unit in units for e in unit.params}
    canonical.update({buf: name for name, buf in reversed(persistent_buffers(model))})
    named = list(model.named_parameters(remove_duplicate=False)) + all_persistent_buffers(model)
    return {name: canonical[t] for name, t in named if t in canonical and canonical[t] != name}
