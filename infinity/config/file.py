"""Reading a ds_config file's text as DeepSpeed reads it.

Why: DeepSpeed reads config files with hjson, so the ds_config.json files people bring often
carry comments and trailing commas, which plain ``json.loads`` refuses; and it refuses a key given
twice, which plain ``json.loads`` takes silently (the last one wins: a second
``zero_optimization`` section would quietly replace the first). This module accepts the first
(comments ``//``, ``#`` and ``/* */`` outside strings, a comma before ``}`` or ``]``) and refuses
the second, naming the key and where it is. Other hjson forms (unquoted strings, multi-line
strings) are not accepted: the error says where the text stops being JSON.

``read_config_file`` is the one reader of a config path, for the API (``infinity.initialize(
config=path)``, ``InfinityConfig.load``) and the CLI (``infinity train/plan --config``) alike: it
refuses what is not a regular UTF-8 text file (a FIFO would block, a device never end) and
nesting deeper than ``MAX_CONFIG_DEPTH`` (json would end in a RecursionError), naming the path.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infinity.config.values import ConfigError

MAX_CONFIG_DEPTH = 100
"""Objects and lists nested deeper than this are refused: a ds_config is a handful of levels
deep, and json (and repr, deepcopy) would end in a RecursionError a few hundred levels on."""

_FILE_KINDS = ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISSOCK, "socket"),
               (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def read_config_file(path: str | os.PathLike[str], label: str = "config") -> dict[str, Any]:
    """The JSON object in the ds_config file ``path``, read the same way for the API and the CLI.

    ``label`` starts every message (``"--config"`` for the CLI). A missing path or a directory is
    FileNotFoundError; anything else that is not a regular file (a FIFO, whose open would wait
    for a writer; a device; a socket) is refused before it is opened; text that is not UTF-8,
    nesting deeper than MAX_CONFIG_DEPTH and invalid JSON are ConfigError naming the path.
    """
    source = Path(path)
    where = f"{label} {source}"
    try:
        mode = os.stat(source).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{where} does not exist; pass a DeepSpeed-format "
                                "ds_config.json") from None
    except OSError as exc:      # a permission on a parent, a name too long, a link loop
        raise ConfigError(f"{where} cannot be read: {exc.strerror} (errno {exc.errno})") from None
    if stat.S_ISDIR(mode):
        raise FileNotFoundError(f"{where} is a directory; pass the DeepSpeed-format "
                                "ds_config.json file itself")
    _refuse_special(where, mode)
    try:
        # O_NONBLOCK: a FIFO put in its place since the stat must not block the open either
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror} (errno {exc.errno})") from None
    with open(fd, "rb") as f:
        _refuse_special(where, os.fstat(fd).st_mode)
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not a text file (not UTF-8: {exc.reason} at byte "
                          f"{exc.start}); pass a DeepSpeed-format ds_config.json") from None
    return parse_config_text(text, where)


def _refuse_special(where: str, mode: int) -> None:
    for test, kind in _FILE_KINDS:
        if test(mode):
            raise ConfigError(f"{where} is a {kind}, not a regular file; it is not read (it "
                              "could block or never end): pass a DeepSpeed-format "
                              "ds_config.json file")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{where} is not a regular file (mode {mode:o}); pass a "
                          "DeepSpeed-format ds_config.json file")


def check_nesting(data: Any, where: str) -> None:
    """Refuse objects and lists nested deeper than MAX_CONFIG_DEPTH in a config given as a
    dict (walked without recursion, so a deep or self-referencing one is an error, not a
    RecursionError in a later repr or deepcopy)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            children = list(value.values())
        elif isinstance(value, (list, tuple)):
            children = list(value)
        else:
            continue
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(_too_deep(where))
        stack.extend((child, depth + 1) for child in children)


def _too_deep(where: str, position: str = "") -> str:
    return (f"{where}: objects and lists are nested more than {MAX_CONFIG_DEPTH} levels "
            f"deep{position}; a ds_config is a few levels deep: this is not one")


def parse_config_text(text: str, where: str) -> dict[str, Any]:
    """The JSON object in ``text`` (comments and trailing commas allowed, duplicate keys
    refused, nesting deeper than MAX_CONFIG_DEPTH refused); ``where`` names the source."""
    try:
        data = json.loads(_strip_comments_and_trailing_commas(text, where),
                          object_pairs_hook=lambda pairs: _refuse_duplicates(pairs, where))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON at line {exc.lineno} column {exc.colno}: "
                          f"{exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top, got {type(data).__name__}")
    return data


def decode_base64_config(source: str) -> dict[str, Any] | None:
    """DeepSpeed also takes the config as a base64-encoded JSON string: its object, or None when
    ``source`` is not one (then it is a path)."""
    compact = source.strip()
    if not compact or compact.startswith(("{", "/", ".", "~")) or len(compact) % 4:
        return None
    try:
        text = base64.b64decode(compact, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    if not text.lstrip().startswith("{"):
        return None
    return parse_config_text(text, "the base64 config string")


def _refuse_duplicates(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{where}: key {key!r} is given twice in one object (the second "
                              f"would silently replace the first; DeepSpeed refuses this too): "
                              "keep one")
        out[key] = value
    return out


def _strip_comments_and_trailing_commas(text: str, where: str) -> str:
    """``text`` with comments blanked (newlines kept, so error positions still match) and each
    comma that only precedes a closing bracket removed; strings are left as they are. Nesting
    deeper than MAX_CONFIG_DEPTH is a ConfigError here, before json.loads recurses into it."""
    out: list[str] = []
    depth = 0
    i, n = 0, len(text)
    pending_comma: int | None = None     # index in ``out`` of a comma not yet followed by a value
    previous = ""                        # the last character of JSON (not space, not comment)
    while i < n:
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            out.append(text[i:end])
            pending_comma = None
            previous = '"'
            i = end
            continue
        if c == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:end]))
            i = end
            continue
        if c in "}]" and pending_comma is not None:
            out[pending_comma] = " "
        if c == ",":
            # trailing only after a value: "{,}" or "[1,,]" stay invalid JSON
            pending_comma = len(out) if previous not in "{[," else None
        elif not c.isspace():
            pending_comma = None
        if not c.isspace():
            previous = c
        if c in "{[":
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                line = text.count("\n", 0, i) + 1
                column = i - (text.rfind("\n", 0, i) + 1) + 1
                raise ConfigError(_too_deep(where, f" (line {line} column {column})"))
        elif c in "}]":
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """The index after the string literal that opens at ``start`` (or the end of the text)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return len(text)
