"""Byte sizes as users write them ("3GiB", "512MB", 1e9) and as we print them."""
from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

ALIGN_BYTES = 4096
"""O_DIRECT alignment: every swap-file extent, swap slot, flat store and I/O piece is a multiple
of it (defined once here, the lowest layer, for config checks, the planner and storage alike)."""


def parse_bytes(value: int | float | str, what: str = "size") -> int:
    """Parse ``value`` into a non-negative byte count; ``what`` names it in errors."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a byte count such as 3GiB or 1e9, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if not match:
            raise ValueError(f"{what}: cannot read {value!r} as a size; write e.g. 3GiB, 512MB or 1e9")
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"{what}: unknown unit {match.group(2)!r} in {value!r}; use one of "
                             "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    else:
        raise ValueError(f"{what}: expected a byte count such as 3GiB or 1e9, got {value!r}")
    if number < 0:
        raise ValueError(f"{what}: must not be negative, got {value!r}")
    total = number * _UNITS[unit]
    if not math.isfinite(total):
        # JSON's Infinity/NaN (Python's json accepts them), "1e400" or "1e300TiB": int() would
        # raise an OverflowError that names no key
        raise ValueError(f"{what}: must be a finite number, got {value!r}")
    if not unit and total != int(total):
        # a count without a unit (sub_group_size 1.5): cutting it to 1 would be a silent change
        raise ValueError(f"{what}: {value!r} is not a whole number")
    return int(total)


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
