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
(zero/activation_swap.py). Inside a region under hooks of its own (non-reentrant activation
checkpointing, transformers' default), or a forward the caller runs under its own hooks (left
on top), the saves are not seen: a unit used there is done only once its module's input
gradient exists too (``note_call``), which a read in that module feeds.
A reentrant checkpoint recomputes in the backward, under the backward's hooks
(``Coordinator.tracked_backward``): a backward the engine did not start (``loss.backward()``)
has none, and a detached read in such a recompute is not seen.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch

from infinity.base.log import get_logger
from infinity.zero.kept_saved import KeptSaved, keep_saved, kept_value
from infinity.zero.pass_state import UnitStatus
from infinity.zero.unit import Unit

log = get_logger("zero")


class SavedTensorSwapper(Protocol):
    """The activation swapper as the forward's hooks see it (engine/activation_policy.py's
    ``AutoActivationOffload`` or zero/activation_swap.py's ``ActivationSwapper``)."""

    @property
    def pack_hook(self) -> Callable[[torch.Tensor], Any]: ...

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
        self._engine_pack: Callable[[torch.Tensor], Any] = self._pack   # the forward's hooks'
        self.enabled = True     # infinity.detached_reads "hold"; "off": no hooks, nothing held

    def begin(self, pack: Callable[[torch.Tensor], Any] | None = None) -> None:
        """Before a training forward: the flat buffers to watch (a buffer keeps its storage
        fetched or released; looked up at each forward, one handle a unit, so that a buffer
        first shaped since, ``Unit._shape_flat``, is watched too), and the pack hook the
        forward runs under (``pack``: the swapper's; else these hooks')."""
        self._engine_pack = pack if pack is not None else self._pack
        self._trainable = {} if not self.enabled else {
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
        at = tensor.storage_offset()
        entry = next((e for e in unit.params if e.offset <= at < e.offset + e.numel), None)
        if entry is not None and not entry.param.requires_grad:
            # frozen since initialize (requires_grad_(False) mid-training): its gradient never
            # comes either, so the same hold applies, but nothing was detached
            if unit.index not in self._named:
                self._named.add(unit.index)
                log.info("unit %s: %s was frozen after initialize: the unit is finished (stepped "
                         "and released) only at the backward's end", unit.name, entry.name)
            return
        if unit.index not in self._named:
            self._named.add(unit.index)
            log.warning("unit %s: a tensor saved for backward reads its trainable parameters "
                        "without their gradient (a .detach()ed use): its backward is done, and "
                        "it is stepped and released, only at the backward's end (it stays in "
                        "device memory through the backward; .detach().clone() would not)",
                        unit.name)

    def note_call(self, ids: tuple[int, ...]) -> None:
        """A module call of the training forward uses the units ``ids``. Under saved-tensor
        hooks that are not the engine's (non-reentrant checkpointing's, on top inside their
        region) its saves never reach ``note``: a detached read there would go unseen, so its
        units are done only once the gradient w.r.t. the call's inputs exists as well (the read
        feeds it, as the nodes of one layer feed the layer's input; a unit with frozen
        parameters waits so already: [Note: release during backward] in zero/coordinator.py)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self._trainable and (top is None or top[0] != self._engine_pack):
            for uid in ids:
                self._statuses[uid].saves_unseen = True

    def _pack(self, tensor: torch.Tensor) -> KeptSaved:
        self.note(tensor)
        return keep_saved(tensor)

    def hooks(self) -> ContextManager:
        """The forward's saved-tensor hooks when no swapper's are."""
        if not self._trainable:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, kept_value)


TORCH_FUNC_UNDER_HOOKS = (
    "infinity: a torch.func transform (grad, vjp, jacrev, hessian) in the forward refuses to "
    "run under saved-tensor hooks, and the engine's training forward runs under its own: "
    "{which}. Set "
    "{keys} in the config (then a parameter the forward uses .detach()ed must be .clone()d: "
    "see infinity.detached_reads), or compute that part under torch.autograd.grad")


@contextlib.contextmanager
def _torch_func_explained(hooks: ContextManager, swapping: bool) -> Iterator[None]:
    """``hooks``, with a note on torch.func's refusal of them (a message naming no cause the
    user set) that names the settings that remove them (a note: an error raised here, in the
    pass's end hook, is dropped by torch for the forward's own)."""
    try:
        with hooks:
            yield
    except RuntimeError as exc:
        if "torch.func" not in str(exc) or "saved tensor hooks" not in str(exc):
            raise
        which = ("the activation swapper's (infinity.offload_activations), which also note the "
                 "parameters read .detach()ed" if swapping else
                 "those noting the parameters it reads .detach()ed (infinity.detached_reads)")
        keys = ('"infinity": {"detached_reads": "off", "offload_activations": "none"}'
                if swapping else '"infinity": {"detached_reads": "off"}')
        exc.add_note(TORCH_FUNC_UNDER_HOOKS.format(which=which, keys=keys))
        raise


def saved_tensor_hooks(reads: DetachedReads,
                       swapper: SavedTensorSwapper | None) -> ContextManager:
    """The saved-tensor hooks of a training forward: the swapper's when it swaps this forward's
    activations (noting detached reads as it packs), else those of ``reads`` alone."""
    if swapper is not None and swapper.swaps_this_forward():
        reads.begin(swapper.pack_hook)
        return _torch_func_explained(swapper.hooks(observe=reads.note), swapping=True)
    reads.begin()
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        # the caller's own hooks (torch's save_on_cpu, say) keep the saves: the engine's inside
        # them would take over, so none; ``note_call`` then counts every save as unseen
        return contextlib.nullcontext()
    return _torch_func_explained(reads.hooks(), swapping=False)
