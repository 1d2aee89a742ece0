"""Units whose values a training forward saved for backward without their gradient.

[Note: parameters read without a gradient]
The coordinator counts a unit's backward done when every trainable parameter of it has its
gradient (zero/coordinator.py ``_grad_ready``): it is then reduced, may be stepped in place (the
early schedule, a boundary's steps) and released (its flat buffer's storage emptied). That is
right for every backward node that saved a parameter as it is: such a node feeds the
parameter's gradient, so it has run by the time the gradient is whole. A node that saved a
*detached* view of a parameter (``x * w.detach()``, ``F.linear(x, w.detach())``, a view taken
under ``no_grad``) reads the values and adds nothing to their gradient, so autograd may run it
after the gradient is whole: it then read the stepped values (a wrong gradient) or a released
buffer (garbage, or a segmentation fault). So each training forward runs under saved-tensor
hooks that note every saved tensor without ``requires_grad`` that lies over the trainable
range of a unit's flat buffer (a frozen parameter's range is not the unit's gradients' concern:
see [Note: flat layout] in zero/unit.py); such a unit's backward is done only at the backward's
end (``UnitStatus.read_detached``), the unit held fetched until then.

Saved-tensor hooks replace autograd's own keeping of the tensor: these keep it as
zero/kept_saved.py does (detached, its in-place modification checked). With activations
offloaded the swapper's hooks are the forward's, and they call ``note`` for every tensor
(zero/activation_swap.py). A model's own saved-tensor hooks (non-reentrant activation
checkpointing) take over inside their region: a detached read there is not seen.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Protocol

import torch

from infinity.base.log import get_logger
from infinity.zero.kept_saved import KeptSaved, keep_saved, kept_value
from infinity.zero.pass_state import UnitStatus
from infinity.zero.unit import Unit

log = get_logger("zero")


class SavedTensorSwapper(Protocol):
    """The activation swapper as the forward's hooks see it (engine/activation_policy.py's
    ``AutoActivationOffload`` or zero/activation_swap.py's ``ActivationSwapper``)."""

    def swaps_this_forward(self) -> bool: ...

    def hooks(self, observe: Callable[[torch.Tensor], None] | None = None) -> ContextManager: ...


class DetachedReads:
    """Notes the units a training forward's saved tensors read without a gradient (see
    [Note: parameters read without a gradient]); ``statuses`` are the coordinator's, by unit."""

    def __init__(self, units: list[Unit], statuses: list[UnitStatus]) -> None:
        self._units = units
        self._statuses = statuses
        self._trainable: dict[int, tuple[Unit, int]] = {}   # storage -> (unit, trainable bytes)
        self._named: set[int] = set()      # units already named in the log

    def begin(self) -> None:
        """Before a training forward: the flat buffers to watch (a unit's buffer is the same
        storage fetched or released, but a load may give it a new one)."""
        self._trainable = {
            unit.flat.untyped_storage()._cdata: (unit, unit.trainable_numel
                                                 * unit.flat.element_size())
            for unit in self._units if unit.has_trainable}

    def note(self, tensor: torch.Tensor) -> None:
        """``tensor`` is being saved for backward: hold its unit to the backward's end if it
        reads a unit's trainable values without a gradient."""
        if tensor.requires_grad or tensor.layout is not torch.strided or not self._trainable:
            return
        found = self._trainable.get(tensor.untyped_storage()._cdata)
        if found is None or tensor.numel() == 0:
            return
        unit, trainable_bytes = found
        if tensor.storage_offset() * tensor.element_size() >= trainable_bytes:
            return   # starts in the frozen range (strides are never negative): not read here
        self._statuses[unit.index].read_detached = True
        if unit.index not in self._named:
            self._named.add(unit.index)
            log.info("unit %s: a tensor saved for backward reads its trainable parameters "
                     "without their gradient (a .detach()ed use): its backward is done, and "
                     "it is stepped and released, only at the backward's end", unit.name)

    def _pack(self, tensor: torch.Tensor) -> KeptSaved:
        self.note(tensor)
        return keep_saved(tensor)

    def hooks(self) -> ContextManager:
        """The forward's saved-tensor hooks when no swapper's are."""
        if not self._trainable:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, kept_value)


def saved_tensor_hooks(reads: DetachedReads,
                       swapper: SavedTensorSwapper | None) -> ContextManager:
    """The saved-tensor hooks of a training forward: the swapper's when it swaps this forward's
    activations (noting detached reads as it packs), else those of ``reads`` alone."""
    reads.begin()
    if swapper is not None and swapper.swaps_this_forward():
        return swapper.hooks(observe=reads.note)
    return reads.hooks()
