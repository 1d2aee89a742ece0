"""One rank-aware logger for the whole package.

``INFINITY_LOG_LEVEL`` (like DeepSpeed's ``DS_LOG_LEVEL``) sets the level; by default only rank 0
logs at INFO, other ranks log warnings and errors. Messages carry the rank when the world is
larger than one.
"""
from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = "infinity"


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                pass
    return 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return True


def get_logger(name: str | None = None) -> logging.Logger:
    """The package logger (or a child of it, ``infinity.<name>``)."""
    root = logging.getLogger(_LOGGER_NAME)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[infinity r%(rank)s] %(levelname)s %(message)s"))
        root.addHandler(handler)
        default = "INFO" if _rank() == 0 else "WARNING"
        level = os.environ.get("INFINITY_LOG_LEVEL", default).upper()
        root.setLevel(level if level in logging._nameToLevel else default)
        root.propagate = False
    return root if name is None else root.getChild(name)
