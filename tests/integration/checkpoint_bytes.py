"""A checkpoint tensor file's bytes as two saves of the same state share them: every byte but
the save's random id, which is blanked (see [Note: which save a file belongs to] in
infinity/checkpoint/directory.py). What bit-exact comparisons of two saves (a resumed run
against an uninterrupted one, a crashed run's commits against the reference's) compare."""
from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

_SAVE_ID = re.compile(rb'"save_id":"[0-9a-f]{32}"')
_BLANK = b'"save_id":"' + b"0" * 32 + b'"'


def content_bytes(path: Path) -> bytes:
    """The file's bytes with the save id in its header blanked (the same length)."""
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header, found = _SAVE_ID.subn(_BLANK, data[8:8 + length])
    if found != 1:
        raise ValueError(f"{path}: {found} save ids in its header, expected 1")
    return data[:8] + header + data[8 + length:]


def content_sha256(path: Path) -> str:
    """The sha256 of ``content_bytes(path)``."""
    return hashlib.sha256(content_bytes(path)).hexdigest()
