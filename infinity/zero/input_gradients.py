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
Each tensor argument of a unit's call that requires a gradient is handed to the module as an
identity view made for this call alone (``x.view_as(x)``), and the hook is on the view. Its
backward node was made before any of the call's own, so autograd runs it after them (a node
made later runs first among those ready), and its gradient is this call's contribution alone:
the mark comes once the call's backward is over, the same point on every rank. A hook on the
argument itself fired too early or too late: a leaf's gradient (``inputs_embeds`` that requires
grad, ``enable_input_require_grads``) is accumulated ahead of every other node, before a
parameter-only op of the call (a weight-norm parametrization) gave its gradient; a tensor many
calls read (``encoder_hidden_states``, T5's position bias) has its gradient only after the last
of them. The view's hook runs before its producer's pre-backward hook (the gather of the unit
before), as that one waits for the view's backward node. A sparse or nested argument (no
``view_as``) gets an identity autograd Function's output instead: a node of its own all the
same (hooked on itself, a sparse leaf's mark came ahead of the call's gradients). Arguments
inside containers keep a hook on the tensor itself (no view can be handed in their place).
With several ranks, a view the call's output does not depend on (an argument the data let the
module skip on this rank) is dropped after the call, found by walking the call's own nodes
from its output: its gradient never comes, and waiting for it finished the unit at the
backward's end on this rank and at the mark on a rank that read it. A call left with no view
(it read none of its inputs under grad on this rank, and some other rank may have) counts as
one without a mark: that case still parts the ranks, as a unit whose backward runs on some
ranks only does.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from infinity.zero.module_calls import tensors_in

LATE_AFTER_INPUTS = (
    "{param} of unit {unit} got its gradient after its call's inputs had theirs, when its "
    "backward had been reduced over the ranks without it (its gradient came by a path that "
    "bypasses the call: a value computed from it outside the module, or kept from another "
    "pass). Compute with the parameter inside the module that owns it, or make the module that "
    "does a unit of its own (infinity.unit_modules)")
"""A parameter's gradient after its unit was finished at the inputs' mark with several ranks
([Note: a call's inputs mark its backward]): refused, never added to a reduced buffer."""


class _Alias(torch.autograd.Function):
    """An identity with a node of its own, for a tensor without ``view_as`` (sparse, nested):
    the same mark a view gives a dense one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CallInputs:
    """One module call's inputs under grad: ``on_done(self)`` once each has its gradient. Held
    by the hooks on them alone (the unit's status holds it weakly): a forward whose graph is
    dropped (an evaluation that forgot ``no_grad``) takes its calls along, and no backward
    waits for their marks. ``views``: each view's autograd node's sequence number and its
    index, ints only (a node held here would hold its hook, which holds this: a cycle through
    C++ no collector sees)."""

    __slots__ = ("pending", "on_done", "views", "__weakref__")

    def __init__(self, count: int, on_done: Callable[["CallInputs"], None]) -> None:
        self.pending = set(range(count))
        self.on_done = on_done
        self.views: list[tuple[int, int]] = []

    def hook(self, index: int) -> Callable[[torch.Tensor], None]:
        return lambda grad: self.reached(index)

    def reached(self, index: int) -> None:
        if index in self.pending:
            self.pending.discard(index)
            if not self.pending:
                self.on_done(self)

    def drop_unused(self, output: Any) -> bool:
        """Forget the views the call's output does not depend on (an argument the data let
        the module skip: ``h + aux`` on some batches): their gradient never comes, and with
        several ranks one rank waited for it to the backward's end while another, which used
        it, finished the unit at the mark -- the ranks' collectives parted. Returns whether no
        input is left to mark the call (its backward then ends at the backward's end)."""
        if not self.views:
            return False
        targets = dict(self.views)
        floor = min(targets)
        found: set[int] = set()
        stack = [t.grad_fn for t in tensors_in(output, objects=True) if t.grad_fn is not None]
        if not stack:               # no output found to read it from: nothing is dropped
            return False
        seen: dict[int, Any] = {}          # the nodes visited, kept alive while their ids count
        while stack and len(found) < len(targets):
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            seq = node._sequence_nr()
            if seq in targets:
                found.add(targets[seq])
            elif seq > floor:             # made during the call: go on; before it: stop
                stack.extend(fn for fn, _ in node.next_functions)
        for seq, index in self.views:
            if index not in found:
                self.pending.discard(index)
        return not self.pending


def marked_inputs(args: tuple, kwargs: dict, nested: list[torch.Tensor],
                  on_done: Callable[[CallInputs], None] | None
                  ) -> tuple[tuple, dict, CallInputs | None]:
    """The call's arguments with each tensor that requires a gradient replaced by an identity
    view, and ``on_done`` called once every such argument's view (and each tensor of
    ``nested``, inside containers, that requires one) has its gradient; returns the new
    arguments and the call watched (None: no input carries a gradient). ``on_done`` None (a
    recomputation): the views alone, the same graph as the first forward, no mark."""
    # a tensor argument gets a node of its own (a view; an alias for a sparse or nested one,
    # which have no view_as); one inside a container is hooked itself
    top = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    inner = [t for t in nested if t.requires_grad and not any(t is a for a in top)]
    wanting = sum(1 for a in top if a.requires_grad) + len(inner)
    if not wanting:
        return args, kwargs, None
    call = CallInputs(wanting, on_done) if on_done is not None else None
    count = iter(range(wanting))

    def marked(value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.requires_grad and
                any(value is a for a in top)):
            return value
        dense = value.layout == torch.strided and not value.is_nested
        view = value.view_as(value) if dense else _Alias.apply(value)
        if call is not None:
            index = next(count)
            view.register_hook(call.hook(index))
            call.views.append((view.grad_fn._sequence_nr(), index))
        return view

    new_args = tuple(marked(a) for a in args)
    new_kwargs = {k: marked(v) for k, v in kwargs.items()}
    for t in inner if call is not None else ():
        t.register_hook(call.hook(next(count)))
    return new_args, new_kwargs, call

