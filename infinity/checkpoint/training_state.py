"""What a checkpoint saves and loads of a training run: the parts, handed over by the engine.

The checkpoint package never sees the engine (DESIGN.md "Layers"): as torchtitan's
checkpoint manager takes the model, optimizer and scheduler and never the trainer, the engine
builds a ``TrainingState`` for each save or load. Tensors are streamed to and from the units'
homes through the parts it names; counters are values read when it was built. Nothing here
changes the engine: a load hands back what to restore (``load.Restore``) and the engine
applies it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Mapping, Protocol, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from infinity.comm.collectives import Collectives
    from infinity.optim.loss_scaler import LossScaler
    from infinity.optim.partitioned import UnitOptimState
    from infinity.storage.buffer_pool import BufferPool
    from infinity.storage.manager import TierManager
    from infinity.zero.unit import Unit


class RunAtRest(Protocol):
    """What a save, load or export asks of the run while it works (the engine implements it:
    engine/checkpointing.py): whether it may, that it be at rest, and units whole on every
    rank for an export of sharded parameters."""

    def check_open(self, what: str) -> None:
        """Raises when the engine cannot take ``engine.<what>()`` now (closed, a step failed,
        a load failed part-way), naming ``what``."""

    def any_pinned(self) -> bool:
        """Whether a unit is held by GatheredParameters now."""

    def flush(self) -> None:
        """Finish the last optimizer step: deferred steps run, every write in flight lands."""

    def release_units(self) -> None:
        """Release every fetched unit, so that a load writes homes nobody holds a copy of."""

    def gathered(self, unit: "Unit") -> ContextManager[None]:
        """``unit`` fetched whole on every rank for the block (all ranks enter it together):
        how an export reads parameters sharded over ranks."""


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """One training run's parts and counters, as a checkpoint needs them."""

    module: nn.Module
    """The model (its persistent buffers are saved; its parameter names are the file's)."""
    units: Sequence["Unit"]
    """Every unit, in order: their entries name the parameters and where their homes are."""
    unit_states: Sequence["UnitOptimState"]
    """The optimizer's per-unit states (fp32 master, Adam moments, step counts)."""
    param_groups: list[dict[str, Any]]
    """The optimizer's param groups themselves: settings are saved, and checked on a load."""
    lr_scheduler: Any
    """The LR scheduler (``state_dict()``, ``accepts_state``), or None."""
    loss_scaler: "LossScaler | None"
    """The fp16 loss scaler, or None."""
    global_steps: int
    """Optimizer steps taken (skipped ones included)."""
    micro_steps: int
    """Micro-steps taken (backward + step calls)."""
    skipped_steps: int
    """Steps the fp16 loss scaler skipped."""
    stage: int
    """The ZeRO stage (recorded in the manifest)."""
    compute_dtype: torch.dtype
    """The dtype forward and backward run in (recorded in the manifest)."""
    gradient_accumulation_steps: int
    """Micro-steps per optimizer step."""
    speculation_pays: bool | None
    """Whether the next step speculates ("auto"); None when the optimizer does not speculate."""
    backwards_since_step: int
    """Backwards whose gradients no step has taken yet (a checkpoint is refused then)."""
    manager: "TierManager"
    """The tier manager the chunked I/O of NVMe homes goes through."""
    lendable_pools: Sequence["BufferPool | None"]
    """Buffer pools idle while no step or fetch runs: their slots carry the chunks."""
    run: RunAtRest
    """The run itself, as a save, load or export asks of it (see ``RunAtRest``)."""
    comm: "Collectives | None" = None
    """The ranks' collectives (None: one rank): a save is written by every rank into rank 0's
    staging directory and committed by rank 0."""
    model_files: Mapping[str, str] | None = None
    """Text files that describe the model (a transformers model's ``config.json``,
    ``generation_config.json``), kept in the manifest so that an export writes them."""
    model_source: Path | None = None
    """The directory the model was loaded from (``from_pretrained``), recorded in the manifest
    so that an export copies its tokenizer files from there."""

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.rank

    @property
    def world_size(self) -> int:
        return 1 if self.comm is None else self.comm.world_size

    @property
    def compute_dtype_name(self) -> str:
        return str(self.compute_dtype).replace("torch.", "")
