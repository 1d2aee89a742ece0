"""Python state in a checkpoint's JSON manifest: the LR scheduler's ``state_dict()`` and the
caller's ``client_state``, given back as the same Python values.

Why: the manifest is JSON (no pickle: a checkpoint must not run code when read), and JSON has
no tuples, no keys but strings and no ``Counter``. Plain JSON turned them into other values
than were saved: torch's ``MultiStepLR`` keeps its milestones as ``Counter({100: 1})`` (int
keys: refused at the first save, hours into a run), ``random.getstate()`` is a tuple
(``random.setstate`` refuses the list it came back as, at resume). Here such values are tagged
objects, ``{"__infinity__": kind, "items": [...]}``, which ``decode`` turns back:

- ``"tuple"``: a tuple, its items encoded;
- ``"dict"``, ``"Counter"``, ``"OrderedDict"``: a mapping of that type as ``[key, value]``
  pairs, used where a key is not a string (an int, a float, a tuple, None, a bool), for the
  two dict subclasses whatever their keys, and for a dict with a key ``"__infinity__"`` itself.

A dict with string keys is a JSON object as before, so manifests written before this module
read the same. Other dict subclasses (``defaultdict``, whose factory JSON cannot hold) come
back as plain dicts and namedtuples as plain tuples, with a warning at the save (DeepSpeed
pickles client_state, so both are habits; refused, a first save hours into a run failed);
values JSON cannot hold (sets, tensors, objects) are refused by name before anything is
written."""
from __future__ import annotations

import json
from collections import Counter, OrderedDict
from typing import Any

from infinity.base.log import get_logger

__all__ = ["decode", "encode", "through_json"]

log = get_logger("checkpoint")

TAG = "__infinity__"
_MAPPINGS: dict[type, str] = {dict: "dict", Counter: "Counter", OrderedDict: "OrderedDict"}
_BUILD = {"dict": dict, "Counter": Counter, "OrderedDict": OrderedDict}
_KEYS = (str, int, float, bool, type(None), tuple)


def encode(value: Any, what: str) -> Any:
    """``value`` as the manifest holds it (a JSON value), or a TypeError naming ``what`` and
    the part of it JSON cannot hold; ``decode(encode(v))`` equals ``v`` with its types."""
    return through_json(_encode(value, what, what), f"{what} must hold numbers, strings, "
                        "booleans, None, lists, tuples and dicts (Counter, OrderedDict)")


def through_json(value: Any, must: str) -> Any:
    """``value`` written as JSON and read back (what a manifest gives), or a TypeError saying
    ``must`` (what the value must hold) and what JSON refused."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{must} to go in a checkpoint manifest: {exc}. Convert tensors with "
                        ".tolist() or .item()") from None


def decode(value: Any) -> Any:
    """The Python value ``encode`` was given (a manifest written before tags: as it reads)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in value.items()}
    items = value.get("items")
    if kind == "tuple" and isinstance(items, list):
        return tuple(decode(v) for v in items)
    if kind in _BUILD and isinstance(items, list) and \
            all(isinstance(p, list) and len(p) == 2 for p in items):
        return _BUILD[kind]({_hashable(decode(k)): decode(v) for k, v in items})
    raise ValueError(f"a manifest value tagged {TAG!r} = {kind!r} is not one this engine "
                     f"wrote: {str(value)[:200]} (the manifest was edited or damaged)")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):          # a tuple key read back through an untagged path
        return tuple(_hashable(k) for k in key)
    return key


_warned: set[tuple[str, str]] = set()


def _plain(what: str, where: str, value: Any, kind: str) -> None:
    """Said once per kind of value: it comes back as a plain ``kind`` (a defaultdict without
    its factory, a namedtuple without its names; pickled by DeepSpeed, which kept them)."""
    key = (what, type(value).__name__)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s: %s is a %s, which a checkpoint gives back as a plain %s (the manifest "
                    "is JSON, no pickle): rebuild it after load_checkpoint", what, where,
                    type(value).__name__, kind)


def _encode(value: Any, what: str, where: str, depth: int = 0) -> Any:
    if depth > 100:
        return value          # json.dumps reports a circular or too deep value itself
    if isinstance(value, tuple) and type(value) is tuple:
        return {TAG: "tuple", "items": [_encode(v, what, f"{where}[{i}]", depth + 1)
                                        for i, v in enumerate(value)]}
    if isinstance(value, tuple):          # a namedtuple: its items, as a tuple
        _plain(what, where, value, "tuple")
        return _encode(tuple(value), what, where, depth)
    if isinstance(value, list):
        return [_encode(v, what, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        kind = _MAPPINGS.get(type(value))
        if kind is None:                  # a defaultdict, ...: its items, as a dict
            _plain(what, where, value, "dict")
            kind = "dict"
        for key in value:
            if not isinstance(key, _KEYS):
                raise TypeError(f"{what}: {where} has a key {key!r} of type "
                                f"{type(key).__name__}: a checkpoint manifest holds keys that "
                                "are strings, numbers, booleans, None or tuples of them")
        if kind == "dict" and all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: _encode(v, what, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
        return {TAG: kind, "items": [[_encode(k, what, where, depth + 1),
                                      _encode(v, what, f"{where}[{k!r}]", depth + 1)]
                                     for k, v in value.items()]}
    return value
