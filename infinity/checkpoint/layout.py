"""What a checkpoint holds of an engine, and in which order: shared by save and load.

Two tensor files per rank. ``rank{r}_model.safetensors``: every parameter by its name in
``named_parameters()`` (a tied parameter once, under the name of the unit that owns it; its
other names are listed as aliases in the manifest), trainable ones as their fp32 master,
frozen ones in their own dtype, then the module's persistent buffers.
``rank{r}_optim.safetensors``: ``<name>.exp_avg`` and ``<name>.exp_avg_sq`` of every trainable
parameter. In both, tensors come unit by unit in flat-layout order, which is the order the
stores are streamed in, so each file is written front to back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import Source
from infinity.zero.persistent_buffers import all_persistent_buffers
from infinity.zero.unit import ParamEntry, Unit

if TYPE_CHECKING:
    from infinity.optim.partitioned import UnitOptimState

MOMENTS = ("exp_avg", "exp_avg_sq")


def model_file(rank: int) -> str:
    return f"rank{rank}_model.safetensors"


def optim_file(rank: int) -> str:
    return f"rank{rank}_optim.safetensors"


@dataclass(eq=False)
class UnitLayout:
    """One unit's parameters and where their current values live."""

    unit: Unit
    state: "UnitOptimState | None"
    with_frozen: bool = True     # False: frozen parameters are left out (a LoRA-style save)

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

    def model_sources(self) -> list[tuple[Source, list[ParamEntry]]]:
        """Where the model file's values of this unit come from, in file order."""
        if self.master is not None:
            sources = [(self.master, self.trainable), (self.params, self.frozen)]
        else:
            sources = [(self.params, self.entries)]
        if not self.with_frozen:
            sources = [(source, [e for e in entries if e.trainable]) for source, entries in sources]
        return sources

    @property
    def saved(self) -> list[ParamEntry]:
        """The entries the model file holds."""
        return [e for _, entries in self.model_sources() for e in entries]

    def file_dtype(self, entry: ParamEntry) -> torch.dtype:
        return torch.float32 if entry.trainable and self.master is not None else self.unit.dtype


def unit_layouts(state: TrainingState, with_frozen: bool = True) -> list[UnitLayout]:
    by_unit = {s.unit.index: s for s in state.unit_states}
    return [UnitLayout(u, by_unit.get(u.index), with_frozen) for u in state.units]


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
