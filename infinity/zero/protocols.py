"""What the coordinator calls up to, as Protocols the layers above implement (DESIGN.md
"Layers": zero never imports optim or engine).

- ``UnitStepper``: the optimizer as the coordinator sees it. It takes each unit's gradients,
  steps the unit (in the background, on its device copy), and says when a step holds the unit
  fetched and when it lets it go (see [Note: the life of a step job] in optim/records.py).
- ``PassOwner``: whoever runs the passes (the engine). It is told before the model is read,
  when a forward changed parameters in place, and around a backward it did not start.
- ``UnitValues``: where the first values of parameters come from when not from the model's
  init (a pretrained checkpoint, checkpoint/pretrained.py): read straight into each unit's
  flat buffer as the unit is adopted, so that homes are written once.
- ``SteppedUnit``: a unit as the optimizer sees it (its flat layout, its shard, its parameter
  home, fetch and release for the master's first values): the narrow view optim is written
  against instead of ``zero.unit.Unit`` (tests/unit/test_pass_state.py checks Unit has it).

``NO_STEPPER`` and ``NO_PASS_OWNER`` do nothing (a coordinator without an optimizer: tests,
tools).
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from infinity.zero.unit import ParamEntry, Unit


class SteppedUnit(Protocol):
    """A unit as the optimizer steps it (see the module docstring); ``zero.unit.Unit`` is one.
    Ranges are in the unit's flat coordinates ([Note: flat layout] in zero/unit.py)."""

    index: int
    name: str
    dtype: torch.dtype
    flat: torch.Tensor
    """The device buffer (all shards)."""
    flat_numel: int
    trainable_numel: int
    """The trainable range's elements [0, trainable_numel), padded to 4 KiB."""
    shard_start: int
    shard_numel: int
    params: list[ParamEntry]
    param_store: Any
    """The parameters' home store (None: the unit lives on the device for good)."""
    residency: Any
    fill_event: Any
    """The copy that filled the device buffer at its fetch (a ``CopyEvent``; None: none), for a
    step's write into it to follow (it may still be in flight while a step started ahead runs)."""

    @property
    def has_trainable(self) -> bool: ...
    @property
    def home_start(self) -> int: ...
    @property
    def flat_on_aligned_host(self) -> bool: ...
    def trainable_entries(self) -> list[ParamEntry]: ...
    def fill_range(self, values: UnitValues, lo: int, hi: int, out: torch.Tensor) -> None: ...
    def finish_fetch(self, manager: Any, pool: Any, gather: bool = True) -> None: ...
    def wait_fetched(self) -> None: ...
    def release(self, manager: Any) -> None: ...


class Wait(enum.Enum):
    """How long ``UnitStepper.reap`` waits for background steps to land."""

    NONE = "none"    # only the steps already over
    ONE = "one"      # until at least one unit comes back (backpressure on the device budget)
    ALL = "all"      # until every step has landed


class UnitStepper(Protocol):
    """The optimizer, for the coordinator's hooks."""

    def on_grad(self, unit: Unit, entry: ParamEntry, grad: torch.Tensor) -> None:
        """A parameter's gradient of this backward (autograd's tensor, the parameter's
        ``.grad`` already cleared)."""

    def on_unit_backward_done(self, unit: Unit) -> bool:
        """Every gradient of ``unit`` in this backward has arrived. True: the unit may be
        released; False: a background step holds it until ``reap`` returns it."""

    def expect_backward(self, unit: Unit) -> None:
        """``unit``'s gradients are coming soon: its optimizer states may be read ahead."""

    def step_fetched(self, unit: Unit) -> bool:
        """``unit`` was just fetched: run a step that waited for it on the device copy. True
        when one ran: the unit is held until ``reap`` returns it."""

    def step_ahead(self, unit: Unit) -> bool:
        """``unit``'s device copy is fetched or its copy to the device is issued, on copies that
        overlap compute: start a step that waits for it now, without waiting for its kernels
        (see [Note: the deferred step runs ahead of the forward] in zero/steps_ahead.py). True
        when one started: the unit is held until ``reap`` returns it, and its use waits
        (``wait_stepped``)."""

    def waiting_units(self) -> list[Unit]:
        """Units whose deferred step waits for them to be fetched, in the order queued."""

    def wait_stepped(self, unit: Unit | None = None) -> None:
        """Wait until the kernels of ``unit``'s steps in flight (None: every unit's) have run:
        its device copy is current. Re-raises a step's failure."""

    def reap(self, wait: Wait = Wait.NONE) -> list[Unit]:
        """The units whose background steps are all over (their writes landed): the caller
        releases them. Re-raises a step's failure."""

    def drain(self) -> list[Unit]:
        """The run ends: steps that never started are cancelled, the rest are waited out (their
        failures logged, not raised); every unit a step held comes back."""


class PassOwner(Protocol):
    """The engine, for the coordinator's hooks."""

    def before_read(self) -> None:
        """A forward is about to read the units (also one the engine did not start: a plain
        model call, ``model.generate()``): a speculated step must be dropped first (see [Note:
        speculative step] in optim/speculation.py)."""

    def modified_in_forward(self, unit: Unit) -> None:
        """A module changed ``unit``'s parameters in place in its forward
        (``nn.Embedding(max_norm=...)``): the device copy must go home before its release."""

    def begin_untracked_backward(self) -> None:
        """The first gradient of a backward the engine did not start (``loss.backward()``
        called directly; ``autograd.grad()``, which accumulates none, is not one). May raise:
        the pass is then abandoned."""

    def end_untracked_backward(self) -> None:
        """That backward is over."""


class UnitValues(Protocol):
    """The first values of some parameters, by their ``state_dict`` name (any of a tied
    parameter's names)."""

    def provides(self, name: str) -> bool:
        """Whether parameter ``name`` takes its values from here (else from the model's init)."""

    def fill(self, pieces: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """For each (name, start, out): fill ``out`` (contiguous, 1-D, of any floating dtype,
        on any device) with elements [start, start + out.numel()) of parameter ``name``
        flattened, cast to ``out``'s dtype. All the pieces of a unit come in one call, so that
        reads may run ahead of conversions."""


class _NoStepper:
    def on_grad(self, unit, entry, grad) -> None:
        pass

    def on_unit_backward_done(self, unit) -> bool:
        return True

    def expect_backward(self, unit) -> None:
        pass

    def step_fetched(self, unit) -> bool:
        return False

    def step_ahead(self, unit) -> bool:
        return False

    def waiting_units(self) -> list:
        return []

    def wait_stepped(self, unit=None) -> None:
        pass

    def reap(self, wait: Wait = Wait.NONE) -> list:
        return []

    def drain(self) -> list:
        return []


class _NoPassOwner:
    def before_read(self) -> None:
        pass

    def modified_in_forward(self, unit) -> None:
        pass

    def begin_untracked_backward(self) -> None:
        pass

    def end_untracked_backward(self) -> None:
        pass


NO_STEPPER: UnitStepper = _NoStepper()
NO_PASS_OWNER: PassOwner = _NoPassOwner()
