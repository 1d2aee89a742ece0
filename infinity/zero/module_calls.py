"""What the coordinator's hooks read from a module call: the tensors its inputs and outputs hold,
a unit's parameter versions (an in-place change through a parameter), and the order of a
module's hooks (the coordinator's pre-hook must run after hooks that change the inputs, its
post-hook last)."""
from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

from infinity.zero.unit import Unit


def tensors_in(value: Any, depth: int = 0, objects: bool = False,
               seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """The tensors in a module's inputs or output: torch's pytree (tuples, lists, dicts,
    namedtuples, transformers' ModelOutput), and inside dataclasses, which pytree does not
    open: a unit's output tensors found nowhere get no pre-backward hook, so the unit would not
    be fetched for its backward. ``objects`` (an output): the attributes of a plain object
    too (a library's own output class: its tensors were missed, and the backward failed on a
    released unit); never a module's, whose parameters are not outputs. Each object once
    (``seen``: objects that refer to each other were walked once per path)."""
    seen = set() if seen is None else seen
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif depth >= 8 or isinstance(leaf, (type, torch.nn.Module)):
            continue
        elif id(leaf) in seen:
            continue
        elif dataclasses.is_dataclass(leaf):
            seen.add(id(leaf))
            yield from tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)],
                                  depth + 1, objects, seen)
        elif objects and isinstance(getattr(leaf, "__dict__", None), dict):
            seen.add(id(leaf))
            yield from (t for t in tensors_in(list(vars(leaf).values()), depth + 1, objects,
                                              seen)
                        if not isinstance(t, torch.nn.Parameter))   # a weight it refers to


def unaliased(output: Any, units: list[Unit]) -> Any:
    """``output`` with each tensor that is a view of a unit's flat buffer cloned (None where
    none is). A module that returns its own parameter or a view of it (transformers'
    ``PerceiverEmbeddings``: ``self.latents.expand(...)``) handed on memory the unit's release
    then took: the next op read a storage of 0 bytes (a segmentation fault, or a size
    mismatch). The clone keeps the autograd path to the parameter."""
    storages = {_storage_of(u.flat) for u in units
                if not u.persistent and u.flat.untyped_storage().nbytes()} - {None}
    if not storages or not any(_storage_of(t) in storages
                               for t in tensors_in(output, objects=True)):
        return None
    replaced = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and
                        _storage_of(t) in storages else t, output)
    if any(_storage_of(t) in storages for t in tensors_in(replaced, objects=True)):
        raise RuntimeError(
            f"a module of unit {units[0].name} returned a view of its own parameter inside "
            f"an object ({type(output).__name__}) the engine cannot rebuild, and the unit's "
            "memory is released after the call: return a copy (`.clone()`)")
    return replaced


def hook_for_backward(output: Any, passed_through: frozenset[int],
                      hook: Callable[[torch.Tensor], None]) -> None:
    """[Note: a view's hook and in-place ops]
    A unit's pre-backward hook goes on each tensor of its output that needs a gradient and is
    not an input handed back (``passed_through``: [Note: outputs passed through] in
    zero/coordinator.py). Where such a tensor is a view (``nn.Linear`` on 3-D input returns
    one of its 2-D result; a block ending in ``.view``, ``.transpose``), an in-place op on it
    before the backward (``logits[..., 0] = -1e4``, ``h.mul_(0.9)``) replaces the view's
    autograd node: autograd runs CopySlices on its base instead, and the hook on the view
    never fires. The unit was then not fetched for its backward, which failed on released
    (empty) parameters, blamed on an external parameter. So the base gets the hook too
    (its node stays where CopySlices hands the gradient on); without an in-place op both fire,
    and the second finds the unit already fetched."""
    hooked: set[int] = set()
    for t in tensors_in(output, objects=True):
        # a leaf (another module's parameter handed out) has no node of this call behind it,
        # and a hook on it would stay there, one more each forward
        if not t.requires_grad or t.grad_fn is None or id(t) in passed_through:
            continue
        t.register_hook(hook)
        base = t._base
        if base is not None and base.grad_fn is not None and id(base) not in passed_through \
                and id(base) not in hooked:
            hooked.add(id(base))
            base.register_hook(hook)


def _storage_of(t: torch.Tensor) -> int | None:
    """A dense tensor's storage address; None for one that has none to view a flat buffer
    (sparse, nested, a wrapper subclass: asking raised; meta: every one is 0)."""
    if t.layout is not torch.strided or t.is_nested or t.is_meta:   # (the dry run's: no bytes)
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def in_graph_task() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward called now is
    a recompute (reentrant activation checkpointing), not the user's."""
    return torch._C._current_graph_task_id() != -1


def param_versions(unit: Unit) -> int:
    """The sum of the unit's parameters' version counters: an in-place change through a
    parameter raises it; the engine's own writes into the flat buffer do not."""
    return sum(entry.param._version for entry in unit.params)


def keep_at(hooks: OrderedDict[int, Any], hook_id: int, last: bool) -> None:
    """Move hook ``hook_id`` to the end (``last``) or the front of a module's hook dict; torch
    copies the dict's items before it calls them, so this is safe from inside a hook."""
    if hook_id in hooks and next(reversed(hooks) if last else iter(hooks)) != hook_id:
        hooks.move_to_end(hook_id, last=last)



def weak_grad_hook(ready: Callable[[Any, Any], None], unit_index: int,
                   entry_index: int) -> Callable[[Any], None]:
    """A post-accumulate-grad hook calling ``ready(unit, entry)`` (a coordinator's bound
    method, held weakly) of its ``units[unit_index].params[entry_index]``, holding no unit. Torch
    keeps such hooks in C++, where the garbage collector never looks: a hook holding the
    coordinator (or a unit, whose module's hooks lead to the engine) kept every engine dropped
    without close() alive until exit, with its swap directory, buffers and thread."""
    weak = weakref.WeakMethod(ready)

    def hook(_param: Any) -> None:
        method = weak()
        if method is not None:
            unit = method.__self__.units[unit_index]
            method(unit, unit.params[entry_index])
    return hook


def only_for(module: Any, hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run for ``module`` alone, held weakly: ``copy.deepcopy(model)`` copies each
    module's hook dicts, and a copy's calls (an EMA or a teacher copied under
    GatheredParameters) fetched and released the engine's units, reading the swap twice, and
    failed once the engine closed ("the swap space was closed with the engine")."""
    owner = weakref.ref(module)

    def guarded(m: Any, *args: Any) -> Any:
        return hook(m, *args) if m is owner() else None
    return guarded
