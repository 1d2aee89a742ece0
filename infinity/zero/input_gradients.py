"""When a unit's module call has the gradient of its inputs: the backward point every rank
reaches alike.

Why: with several ranks, a unit's gradients are reduced over them when its backward is done,
and every rank must issue its collectives in one order ([Note: collective order]). "Done" read
from the parameters' gradients alone differs between ranks wherever the data decides which
parameters get one: a mixture-of-experts layer routes one rank's tokens to an expert and the
other's not, so the expert's gradient comes on one rank only. That rank finished the unit (its
reduce-scatter) before the next unit's backward gather; the other waited for the gradient until
the backward's end -- the ranks paired an all-gather with a reduce-scatter and hung until the
collective timeout. The gradient w.r.t. a call's inputs exists at the same point on every rank
that ran the call, whatever its experts did (see [Note: a call's inputs mark its backward]).

[Note: a call's inputs mark its backward]
Autograd runs a unit's own backward nodes before the node that produced its inputs (they are
ready first and were created later, so they are first in its queue), so once each input of a
call has its gradient, every parameter gradient that call will produce has come. The hook on an
input that is another unit's output is the same tensor's hook as that unit's pre-backward (its
gather); the consumer's mark must run first, or a rank finishing the consumer there would issue
its reduce-scatter after the gather that a rank which finished it earlier issued after. So an
output has the list of the calls it feeds, run by its one hook ahead of
the producer's pre-backward, and only inputs nobody produced get a hook of their own
(``InputMarks``).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

LATE_AFTER_INPUTS = (
    "{param} of unit {unit} got its gradient after the gradient of the unit's inputs, when its "
    "backward had been reduced over the ranks without it (its gradient's path bypasses the "
    "module's inputs: a value computed from it in an earlier module, or kept from another "
    "pass). Make the module that computes with it a unit of its own (infinity.unit_modules), "
    "or compute with it inside the module that owns it")
"""A parameter's gradient after its unit was finished at the inputs' mark with several ranks
([Note: a call's inputs mark its backward]): refused, never added to a reduced buffer."""

class _CallInputs:
    """One module call's inputs under grad: ``on_done`` once each has its gradient."""

    __slots__ = ("remaining", "on_done")

    def __init__(self, count: int, on_done: Callable[[], None]) -> None:
        self.remaining = count
        self.on_done = on_done

    def reached(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.on_done()


class InputMarks:
    """Which unit calls each hooked unit's output is an input of (``watch_inputs``), so that the
    output's one hook marks them ahead of its producer's pre-backward. Kept here by the tensor's
    id beside a weak reference (a tensor's own attributes would be pickled with it: a
    ``torch.save`` of a model's output failed on the hook's closure), dropped with the tensor."""

    def __init__(self) -> None:
        self._consumers: dict[int, tuple[weakref.ref, list[_CallInputs]]] = {}

    def _of(self, t: torch.Tensor) -> list[_CallInputs] | None:
        entry = self._consumers.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _forget(self, key: int, ref: weakref.ref) -> None:
        entry = self._consumers.get(key)
        if entry is not None and entry[0] is ref:
            del self._consumers[key]

    def watch_inputs(self, inputs: list[torch.Tensor], on_done: Callable[[], None]) -> bool:
        """Call ``on_done`` when every input of this call that requires a gradient has it
        (once, at the last); returns whether any does (a call without one has no such point)."""
        wanting = [t for t in inputs if t.requires_grad]
        if not wanting:
            return False
        call = _CallInputs(len(wanting), on_done)
        for t in wanting:
            consumers = self._of(t)
            if consumers is not None:
                consumers.append(call)      # run by the producer's hook, ahead of its pre-backward
            else:
                t.register_hook(lambda grad, call=call: call.reached())
        return True

    def on_output_gradient(self, t: torch.Tensor, pre_backward: Callable[[], None]) -> None:
        """Hook a unit's output ``t``: when its gradient exists, first mark the calls it is an
        input of (``watch_inputs``), then run ``pre_backward`` (the producer's gather)."""
        consumers: list[_CallInputs] | None = None
        if self._of(t) is None:     # the first hook on it runs first: it marks them
            consumers = []
            key = id(t)
            self._consumers[key] = (weakref.ref(t, lambda ref: self._forget(key, ref)), consumers)

        def hook(grad: torch.Tensor) -> None:
            for call in consumers or ():
                call.reached()
            pre_backward()

        t.register_hook(hook)
