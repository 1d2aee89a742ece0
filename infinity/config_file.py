"""Reading a ds_config file's text as DeepSpeed reads it.

Why: DeepSpeed reads config files with hjson, so the ds_config.json files people bring often
carry comments and trailing commas, which plain ``json.loads`` refuses; and it refuses a key given
twice, which plain ``json.loads`` takes silently (the last one wins: a second
``zero_optimization`` section would quietly replace the first). This module accepts the first
(comments ``//``, ``#`` and ``/* */`` outside strings, a comma before ``}`` or ``]``) and refuses
the second, naming the key and where it is. Other hjson forms (unquoted strings, multi-line
strings) are not accepted: the error says where the text stops being JSON.
"""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from infinity.config_sections import ConfigError


def parse_config_text(text: str, where: str) -> dict[str, Any]:
    """The JSON object in ``text`` (comments and trailing commas allowed, duplicate keys
    refused); ``where`` names the source in errors."""
    try:
        data = json.loads(_strip_comments_and_trailing_commas(text),
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


def _strip_comments_and_trailing_commas(text: str) -> str:
    """``text`` with comments blanked (newlines kept, so error positions still match) and each
    comma that only precedes a closing bracket removed; strings are left as they are."""
    out: list[str] = []
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
