"""Which units the late step moves (see [Note: late step] in optim/late_step.py)."""
from __future__ import annotations

from infinity.optim.late_step import choose_late_units


def test_the_last_units_of_the_forward_while_they_fit_the_room() -> None:
    numel = {0: 100, 1: 50, 2: 50, 3: 50, 4: 10, 5: 100}.__getitem__
    # forward: embedding 0, layers 1-3, norm 4, head 5
    assert choose_late_units([0, 1, 2, 3, 4, 5], numel, 100) == {5}
    assert choose_late_units([0, 1, 2, 3, 4, 5], numel, 160) == {5, 4, 3}
    # the first unit that does not fit ends the set (a smaller one before it is needed earlier)
    assert choose_late_units([0, 1, 2, 3, 4, 5], numel, 159) == {5, 4}
    assert choose_late_units([0, 1, 2, 3, 4, 5], numel, 0) == frozenset()


def test_a_unit_counts_at_its_first_use_and_frozen_units_are_skipped() -> None:
    # a tied embedding (0) used again as the head is the forward's first unit: never late
    numel = {0: 100, 1: 50, 2: 0, 3: 10}.__getitem__
    assert choose_late_units([0, 1, 3, 2, 0], numel, 100) == {3, 1}
    assert choose_late_units([0, 1, 3, 2, 0], numel, 10) == {3}
