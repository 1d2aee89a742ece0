"""storage/tiers.py's checked residency transitions at unit level: every
legal move, every illegal one refused with the unit's name, and how a state compares."""
from __future__ import annotations

import itertools

import pytest

from infinity.storage.tiers import Residency, ResidencyError, ResidencyState

LEGAL = {(Residency.RELEASED, Residency.FETCHING), (Residency.RELEASED, Residency.FETCHED),
         (Residency.FETCHING, Residency.FETCHED), (Residency.FETCHING, Residency.RELEASED),
         (Residency.FETCHED, Residency.RELEASED)}


def _state_at(value: Residency) -> ResidencyState:
    state = ResidencyState("unit 3 (layers.2)")
    if value is not Residency.RELEASED:
        state.to(value)
    return state


def test_a_new_state_is_released_and_named() -> None:
    state = ResidencyState("unit 0")
    assert state.value is Residency.RELEASED and state.owner == "unit 0"


@pytest.mark.parametrize("old,new", list(itertools.product(Residency, Residency)))
def test_every_transition_is_checked(old, new) -> None:
    state = _state_at(old)
    if (old, new) in LEGAL:
        state.to(new)
        assert state.value is new
    else:
        with pytest.raises(ResidencyError) as info:
            state.to(new)
        assert str(info.value) == (f"unit 3 (layers.2): illegal residency transition "
                                   f"{old.name} -> {new.name}")
        assert state.value is old


def test_a_state_compares_with_a_residency_and_hashes_like_it() -> None:
    state = _state_at(Residency.FETCHED)
    assert state == Residency.FETCHED and state != Residency.RELEASED
    assert hash(state) == hash(Residency.FETCHED)
    assert state.__eq__("fetched") is NotImplemented
    assert (state == "fetched") is False
    assert isinstance(ResidencyError("x"), RuntimeError)
