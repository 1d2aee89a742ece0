"""The value checks every config section shares, and ``ConfigError``.

Each check takes the key path and the value and raises ``ConfigError`` naming both, so a bad
value in any section reads the same way ("zero_optimization.stage = 5 is out of range: ...").
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from infinity.base.log import get_logger
from infinity.base.sizes import parse_bytes

AUTO = "auto"
log = get_logger("config")


class ConfigError(ValueError):
    """A key or value of the configuration that infinity cannot use; the message names its path."""


class AutoValueMissing(ConfigError):
    """``"auto"`` values with nothing to replace them: every such key path at once (``keys``),
    so a Hugging Face config is mended in one round, not one round per key."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = list(keys)
        shown = ", ".join(f"{k!r}: ..." for k in self.keys)
        super().__init__(
            f"{', '.join(self.keys)} {'is' if len(self.keys) == 1 else 'are'} \"auto\" but no "
            f"value was given for {'it' if len(self.keys) == 1 else 'them'}: pass "
            f"auto_values={{{shown}}} (as the Hugging Face integration does) or write the "
            "values in the config")


# ----------------------------------------------------------------------------------------------
# Value checks shared by every section. Each raises ConfigError naming the key path and value.

def is_whole(value: Any) -> bool:
    """An integer of any integral type, never a bool (``true == 1`` in Python)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path} = {value!r}: expected true or false")
    return value


INT64_MAX = 2**63 - 1
"""The largest integer a config value may be unless its key says otherwise: values go to C and
torch as int64."""
_EXACT_FLOAT_INT = 2**53
"""Floats up to this are exact integers; a larger one (1e30) names no particular integer."""


def check_int(path: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int, or a ConfigError naming ``path``.

    Any integral type is taken (a numpy or torch integer from a config built in Python: they
    are ``numbers.Integral``), and a float that is a whole number up to 2**53 (JSON's ``4.0``,
    ``1e3``); never a bool (``true`` is not a count, though Python calls it 1), a fraction, or a
    float too large to name one integer. Without ``hi`` the range ends at INT64_MAX.
    """
    limit = INT64_MAX if hi is None else hi
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):    # numpy's too
        raise ConfigError(f"{path} = {value!r}: expected an integer{describe_range(lo, hi)}, not true or "
                          "false")
    if isinstance(value, numbers.Integral):
        value = operator.index(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and \
            float(value).is_integer():
        if abs(value) > _EXACT_FLOAT_INT:
            raise ConfigError(f"{path} = {value!r} is out of range: expected an integer"
                              f"{describe_range(lo, limit)} (a float this large is no exact integer)")
        value = int(value)
    else:
        raise ConfigError(f"{path} = {value!r}: expected an integer{describe_range(lo, hi)}")
    if (lo is not None and value < lo) or value > limit:
        raise ConfigError(f"{path} = {value!r} is out of range: expected an integer"
                          f"{describe_range(lo, limit)}")
    return value


def check_float(path: str, value: Any, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path} = {value!r}: expected a finite number{describe_range(lo, hi, lo_open, hi_open)}")
    value = float(value)
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        raise ConfigError(f"{path} = {value!r} is out of range: expected a number"
                          f"{describe_range(lo, hi, lo_open, hi_open)}")
    return value


def check_float_per_group(path: str, value: Any, lo: float) -> float | tuple[float, ...]:
    """A number, or (as DeepSpeed's schedules take) a list of one number per param group."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{path} = []: expected a number, or one number per param group")
        return tuple(check_float(f"{path}[{i}]", v, lo) for i, v in enumerate(value))
    return check_float(path, value, lo)


def check_choice(path: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{path} = {value!r}: expected one of {', '.join(map(repr, choices))}")
    return value


def check_size(path: str, value: Any, lo: int = 0) -> int | None:
    """A size in elements or bytes; ``None`` or ``"auto"`` mean "derive from the budgets"."""
    if value is None or value == AUTO:
        return None
    try:
        parsed = parse_bytes(value, what=path)
    except ValueError as exc:
        detail = str(exc).removeprefix(f"{path}: ")
        raise ConfigError(f"{path} = {value!r}: {detail} (expected a count or size >= {lo}, "
                          "e.g. 5e8, \"100M\" or \"3GiB\")") from None
    if parsed < lo:
        raise ConfigError(f"{path} = {value!r} is out of range: expected at least {lo}")
    return parsed


def describe_range(lo: Any, hi: Any, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" {'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f" {'<' if hi_open else '<='} {hi}"
    return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def set_field(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalizing a frozen dataclass in __post_init__

