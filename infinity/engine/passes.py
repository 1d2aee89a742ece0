"""A forward pass begins and ends at the model's own call, whoever makes it.

Why: a torch-style loop calls the model itself (``loss = model(x)``; ``generate()`` calls it once
a token), not ``engine(x)``. What the engine does around a forward (drop a pending speculation,
start the mode's trace pass that prefetch follows, swap saved activations, check a training
forward's traced working set before its backward, forget a pass that raised) therefore hangs on
the root module's hooks, so both kinds of call get it. Before, a direct call never started a
pass: its fetches were appended to one ever-growing trace (no prefetch, memory growing by the
units of every call) and its activations were not swapped.

The begin hook must run before the coordinator's fetch hook of a root that owns parameters
itself (a speculation is voided before anything is fetched): ``Coordinator.keep_outermost``
keeps it first. The end runs from an ``always_call`` hook, which torch also calls when the
forward raised (then the pass is abandoned); a normal hook after the others marks the calls that
returned.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class _Call:
    began: bool             # this call started a pass (not a nested or recomputed call)
    state: Any = None       # what ``begin`` returned, handed to ``end``
    returned: bool = False  # the forward and the hooks before ours returned


class PassHooks:
    """Calls ``begin()`` before each outermost call of ``root`` and ``end(state, error)`` after
    it (``error``: the exception the forward raised, else None)."""

    def __init__(self, root: nn.Module, begin: Callable[[], Any],
                 end: Callable[[Any, BaseException | None], None],
                 keep_outermost: Callable[[nn.Module, int], None]) -> None:
        self._begin, self._end = begin, end
        self._calls: list[_Call] = []
        self._root = weakref.ref(root)
        # closures, not bound methods: copy.deepcopy(model) copies the hook dicts, and a bound
        # method would drag this object (and the engine behind it) into the copy; the copy's
        # calls (an EMA or teacher copy) are not this engine's passes
        def ours(m: nn.Module) -> bool:
            return m is self._root()

        self._handles = [
            root.register_forward_pre_hook(lambda m, args: self._before() if ours(m) else None,
                                           prepend=True),
            root.register_forward_hook(lambda m, args, out: self._returned() if ours(m) else None),
            root.register_forward_hook(lambda m, args, out: self._after() if ours(m) else None,
                                       always_call=True),
        ]
        keep_outermost(root, self._handles[0].id)

    @property
    def in_pass(self) -> bool:
        return any(call.began for call in self._calls)

    def _before(self) -> None:
        if self._calls and _calls_of(self._root()) == 1:
            # no outer call of the root is running: the recorded ones were cut short by a
            # KeyboardInterrupt (torch runs always_call hooks for an Exception only)
            self.abandon_open(KeyboardInterrupt())
        # a call inside a pass (a model calling itself) or a recompute in backward (activation
        # checkpointing around the whole model) is part of the pass already running
        nested = self.in_pass or torch._C._current_graph_task_id() != -1
        call = _Call(began=not nested)
        self._calls.append(call)
        if call.began:
            try:
                call.state = self._begin()
            except BaseException:
                call.began = False   # nothing to end; ``_after`` drops the record
                raise
        return None

    def _returned(self) -> None:
        call = self._calls[-1]
        call.returned = True
        if call.began:
            call.began = False          # ended here: ``_after`` has nothing left to do
            self._end(call.state, None)
        return None

    def _after(self) -> None:
        call = self._calls.pop()
        if call.began and not call.returned:
            error = sys.exc_info()[1]    # torch calls this hook inside its except block
            self._end(call.state, error if error is not None else RuntimeError("forward failed"))
        return None

    def abandon_open(self, error: BaseException) -> None:
        """End every pass still recorded as running with ``error`` (a forward cut short by a
        KeyboardInterrupt, which skips the ``always_call`` hook; ``engine.forward`` and
        ``close()`` call this, and so does the next call of the root)."""
        calls, self._calls = self._calls, []
        for call in reversed(calls):
            if call.began:
                call.began = False
                self._end(call.state, error)

    def abandon_cut_short(self, error: BaseException) -> None:
        """After a call of the root raised: when no call of it is running any more, end what a
        KeyboardInterrupt left recorded (see ``abandon_open``)."""
        if self._calls and _calls_of(self._root()) == 0:
            self.abandon_open(error)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _calls_of(root: nn.Module | None) -> int:
    """How many calls of ``root`` are running in this thread (``Module._call_impl`` frames with
    ``self`` the root); read only when a call record is left over, so its cost is rare."""
    count, frame = 0, sys._getframe(1)
    code = nn.Module._call_impl.__code__
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is root:
            count += 1
        frame = frame.f_back
    return count


def cast_inputs(root: nn.Module, dtype: torch.dtype) -> Any:
    """A forward pre-hook on ``root`` casting the floating-point tensors of each call's arguments
    to ``dtype`` (``cast_floating``), for ``engine(x)`` and ``model(x)`` alike; its handle. Used
    where "auto" chose bf16 for the CPU: the user asked for no 16-bit dtype and feeds fp32."""
    ref = weakref.ref(root)    # a closure, not a bound method: see PassHooks

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        return cast_floating((args, kwargs), dtype) if module is ref() else None
    return root.register_forward_pre_hook(hook, with_kwargs=True)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """fp16.auto_cast: floating-point tensors anywhere in the forward's arguments (lists, tuples,
    dicts) in the compute dtype; integer tensors (token ids, masks) and everything else as given."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        items = [cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value
