"""``infinity.offload_activations`` "auto": saved activations go to the swap space only for a
batch whose saved bytes do not fit in what the host budget leaves.

Why here: the decision needs the batch's shape, which only the training forward has, and the
engine's sizes; the sizes themselves (the prediction, the room, the choice) are the planner's
(``infinity.planner.activations``). This module reads the batch from the forward's arguments
before any of the model runs and turns the swapper's hooks on or off for that forward.

[Note: the host budget and activations]
The engine's homes and pools (and on a CPU-only machine the emulated device pool) are sized
within ``infinity.host_memory_budget`` by the planner; what they leave is ``activation_room``
(``EngineSizes``). Before each training forward the saved bytes of that batch are predicted
from the model's config and the batch's (size, length); when they exceed the room and a swap
directory exists, the forward's saved tensors are swapped as with "nvme" (only ``window`` bytes
of them in memory at a time), else they stay in memory. Without a swap directory an overshoot is
a warning naming its size, never an error. The interpreter, torch's own allocations (the
post-import RSS, ~0.2 GiB here) and autograd's temporaries are outside the budget. A batch of
another shape is decided again (a cheap count); graphs already saved keep their handles, so a
change between forwards is safe. On a GPU the activations live in device memory, which the host
budget does not hold: "auto" keeps them there.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.base.malloc_tuning import set_mmap_threshold
from infinity.base.native_info import record_in_use
from infinity.planner.activations import (
    ActivationShape,
    OffloadChoice,
    activation_shape_from_hf_config,
    choose_activation_offload,
    forced_offload,
    saved_activation_bytes,
    step_working_bytes,
)
from infinity.zero.activation_swap import ActivationStats, ActivationSwapper

__all__ = ["AutoActivationOffload", "batch_of"]

log = get_logger("engine")


def batch_of(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(sequences, tokens per sequence) of a forward's inputs: ``input_ids`` or
    ``inputs_embeds``, as keywords or in a dict batch passed whole (``model(batch)``, a
    tokenizer's ``BatchEncoding``), else the first tensor argument; None when there is none."""
    tensor = _ids_of(kwargs)
    if tensor is None:
        tensor = next((t for t in map(_ids_of, args) if t is not None), None)
    if tensor is None:
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        return None
    if tensor.dim() == 1:
        return 1, int(tensor.shape[0])
    return int(tensor.shape[0]), int(tensor.shape[1])


def blocks_checkpointed(model: nn.Module) -> bool:
    """Whether transformers' PreTrainedModel runs its blocks under activation checkpointing:
    ``is_activation_checkpointing``, or on transformers before 5 ``is_gradient_checkpointing``
    (since 5 a deprecated alias that warns at every read; gone in 6)."""
    value = getattr(model, "is_activation_checkpointing", None)
    if value is None:
        value = getattr(model, "is_gradient_checkpointing", False)
    return bool(value)


def _ids_of(inputs: Any) -> Any:
    """``input_ids`` or else ``inputs_embeds`` of a mapping (None for anything else)."""
    if not isinstance(inputs, Mapping):
        return None
    tensor = inputs.get("input_ids")
    return inputs.get("inputs_embeds") if tensor is None else tensor


class AutoActivationOffload:
    """The "auto" policy around an activation swapper (None: no swap directory): the engine
    calls it as it calls an ``ActivationSwapper`` (``hooks``, ``release_forgotten``,
    ``close``, ``describe``, ``stats``); see [Note: the host budget and activations]."""

    def __init__(self, model: nn.Module, swapper: ActivationSwapper | None, room: int,
                 itemsize: int, *, largest_unit_numel: int = 0, on_device: bool = False,
                 offloaded_mmap_threshold: int | None = None,
                 kept_mmap_threshold: int | None = None,
                 no_swap: str = "no nvme_path is set",
                 keep_outermost: Callable[[nn.Module, int], None] | None = None,
                 always: bool = False) -> None:
        self.no_swap = no_swap
        self.always = always
        """``offload_activations: "nvme"``: every training forward offloads (``swapper`` must
        be given); the decision per batch shape only names what stays in memory beside."""
        if always and swapper is None:
            raise ValueError("offload_activations \"nvme\" needs an activation swapper")
        self.mode = "nvme" if always else "auto"
        self.swapper = swapper
        self.largest_unit_numel = largest_unit_numel
        self.room = room
        self.itemsize = itemsize
        self.on_device = on_device
        self.shape: ActivationShape | None = activation_shape_from_hf_config(
            getattr(model, "config", None))
        self.choice: OffloadChoice | None = None
        """The choice for the last training forward (None before the first)."""
        self.active = always
        self._threshold = offloaded_mmap_threshold
        self._kept_threshold = kept_mmap_threshold
        self._decided: dict[tuple[int, int, bool], OffloadChoice] = {}
        self._warned_overshoot = 0
        # a function, not the bound method: copy.deepcopy(model) copies a bound method's object
        # (this policy, its swapper's locks: "cannot pickle '_thread.lock'"), a function it
        # shares; the copy's calls (an EMA or reference copy) are no pass of this engine
        root = weakref.ref(model)
        self._handle = model.register_forward_pre_hook(
            lambda module, args, kwargs: self._before_forward(module, args, kwargs)
            if module is root() else None, with_kwargs=True, prepend=True)
        if keep_outermost is not None:
            # ahead of the engine's pass hook, whose ``hooks()`` reads this forward's choice:
            # the coordinator moves the pass hook back to the front after each call of a root
            # that owns parameters, and the choice then lagged one forward behind its batch
            keep_outermost(model, self._handle.id)

    @property
    def stats(self) -> ActivationStats:
        return self.swapper.stats if self.swapper is not None else ActivationStats()

    def predict(self, batch: int, seq: int, checkpointed: bool = False) -> int | None:
        """Saved bytes of a training forward of ``batch`` x ``seq`` tokens (the loss counted: it
        saves the logits' log-softmax inside the forward or after it; ``checkpointed``: the
        model's blocks run under activation checkpointing)."""
        if self.shape is None:
            return None
        return saved_activation_bytes(self.shape, batch, seq, self.itemsize, with_loss=True,
                                      checkpointed=checkpointed)

    def decide(self, batch: int, seq: int, checkpointed: bool = False) -> OffloadChoice:
        """The choice for a batch of this shape (made once per shape and checkpointing, logged:
        transformers' ``gradient_checkpointing_enable()`` after initialize is seen at the next
        forward)."""
        key = (batch, seq, checkpointed)
        choice = self._decided.get(key)
        if choice is None:
            if batch == 0 or seq == 0:        # torch's own error follows, if any
                choice = OffloadChoice(decision="nvme" if self.always else "none",
                                       predicted_bytes=0, room_bytes=self.room,
                                       reason=f"an empty batch ({batch} x {seq}): nothing saved")
            elif self.on_device and self.always:
                choice = forced_offload(None, self.room, 0)
            elif self.on_device:
                choice = OffloadChoice(decision="none",
                                       predicted_bytes=self.predict(batch, seq, checkpointed),
                                       room_bytes=self.room, reason=(
                                           "activations live in device memory, which the host "
                                           "budget does not hold: kept there"))
            else:
                working = step_working_bytes(self.shape, batch, seq, self.itemsize,
                                             self.largest_unit_numel, checkpointed)
                choice = forced_offload(self.predict(batch, seq, checkpointed), self.room,
                                        working) if self.always else choose_activation_offload(self.predict(batch, seq, checkpointed),
                                                   self.room,
                                                   self.swapper is not None, working,
                                                   self.no_swap)
            self._decided[key] = choice
            text = f"offload_activations {self.mode}, batch {batch} x {seq}" \
                f"{' (blocks checkpointed)' if checkpointed else ''}: {choice.reason}"
            # dynamic padding gives every batch a new length: a warning only for an overshoot
            # larger than any warned before (by a quarter), the rest at info
            if choice.overshoot_bytes > 1.25 * self._warned_overshoot:
                self._warned_overshoot = choice.overshoot_bytes
                log.warning(text)
            else:
                log.info(text)
        if choice is not self.choice:      # what this forward does, decided now or before
            record_in_use("offload_activations", f"{choice.decision} ({choice.reason})")
        # see InfinitySection.mmap_threshold_in_use: the offloaded threshold only while
        # offloading (every allocation above it mapped and faulted in afresh is slower)
        threshold = self._threshold if choice.decision == "nvme" else self._kept_threshold
        if threshold is not None:
            set_mmap_threshold(threshold)
        return choice

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():     # [Note: a forward under grad trains]
            return
        shape = batch_of(args, kwargs)
        if shape is None and self.always:
            self.choice = forced_offload(None, self.room, 0)
            self.active = True
            return
        if shape is None:
            self.choice = choose_activation_offload(
                None, self.room, self.swapper is not None,
                unknown="the forward's arguments name no input_ids, inputs_embeds or tensor to "
                        "read the batch's size and length from" if self.shape is not None
                        else None)
            self.active = False
            return
        checkpointed = blocks_checkpointed(module)
        self.choice = self.decide(*shape, checkpointed)
        self.active = self.choice.decision == "nvme"

    # -- what the engine calls on a swapper ------------------------------------------------
    @property
    def pack_hook(self) -> Callable[[torch.Tensor], Any] | None:
        return self.swapper.pack_hook if self.swapper is not None else None

    def swaps_this_forward(self) -> bool:
        """This forward offloads (``decide`` chose "nvme" before it began)."""
        return self.active and self.swapper is not None

    def hooks(self, observe: Callable[[torch.Tensor], None] | None = None
              ) -> contextlib.AbstractContextManager:
        """The swapper's hooks when this forward offloads, else nothing."""
        if self.swaps_this_forward():
            return self.swapper.hooks(observe)
        return contextlib.nullcontext()

    def release_forgotten(self) -> None:
        if self.swapper is not None:
            self.swapper.release_forgotten()

    def close(self) -> None:
        self._handle.remove()
        if self.swapper is not None:
            self.swapper.close()

    def describe(self) -> str:
        what = self.choice.reason if self.choice is not None else "no training forward yet"
        swapped = f"; {self.swapper.describe()}" if self.swapper is not None else ""
        return f"{self.mode}: {what}{swapped}"

    def as_dict(self) -> dict[str, Any]:
        return {} if self.choice is None else self.choice.as_dict()
