"""Matching error messages in the unit tests (imported as ``messages``: pytest puts tests/unit on
sys.path, as for ``fakes``)."""
from __future__ import annotations

import re

import pytest


def raises_naming(kind, *phrases: str, starts: bool = False, ends: bool = False):
    """pytest.raises for a message that says each of ``phrases`` in this order (what is wrong,
    the offending value, the fix), whatever the wording around them.

    ``starts=True``: the message begins with the first phrase; ``ends=True``: it ends with the
    last. Use them only where those phrases really are the message's first and last words (a
    phrase search alone still finds a message its code wrapped in other text, e.g. mutmut's
    "XX...XX" string mutants).

    Kept without ``as`` by its callers: an ExceptionInfo bound in a test's frame makes a
    reference cycle (traceback -> frame -> locals), and the aligned buffers and swap space in it
    would then be freed by the cyclic GC at some later point (a finalizer run by the GC at an
    arbitrary point has crashed a test run) instead of at the test's end."""
    if not phrases:
        raise ValueError("raises_naming needs at least one phrase")
    pattern = ".*".join(re.escape(p) for p in phrases)
    return pytest.raises(kind, match="(?s)" + ("^" if starts else "") + pattern
                         + (r"\Z" if ends else ""))
