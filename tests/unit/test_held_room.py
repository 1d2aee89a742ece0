"""The held-gradient room (optim/held_room.py): bytes taken wait only while a background step
may still give some back, and are given back exactly once."""
from __future__ import annotations

import threading

import pytest

from infinity.optim.held_room import HeldRoom


def _taker(room: HeldRoom, nbytes: int, running) -> tuple[threading.Thread, threading.Event, list]:
    done, waited = threading.Event(), []

    def take() -> None:
        waited.append(room.take(nbytes, running))
        done.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, done, waited


def test_bytes_that_fit_are_taken_at_once() -> None:
    room = HeldRoom(100)
    assert room.take(60, lambda: True) == 0.0
    assert room.take(40, lambda: True) == 0.0
    assert room.held == 100 and room.peak == 100


def test_bytes_that_do_not_fit_wait_for_a_running_step_to_give_room_back() -> None:
    room = HeldRoom(100)
    room.take(80, lambda: True)                  # a unit handed to its background step
    thread, done, waited = _taker(room, 50, lambda: True)
    assert not done.wait(0.3), "took 50 bytes into a 100-byte room holding 80"
    room.give(30)                                # the step freed its first parts
    assert done.wait(5.0), "still waiting after room was given back"
    thread.join(5.0)
    assert room.held == 100 and room.peak == 100 and waited[0] > 0.2


def test_nothing_waits_when_no_step_is_running() -> None:
    """A unit larger than the room, or parts kept for a tied weight's last use: no step will
    give room back, so the bytes are taken over the capacity instead of deadlocking."""
    room = HeldRoom(100)
    room.take(90, lambda: False)
    room.take(90, lambda: False)
    assert room.held == 180 and room.peak == 180


def test_a_waiter_goes_on_when_the_last_step_stops_running() -> None:
    """A step that failed gives nothing back; the waiter must not wait for it forever."""
    room = HeldRoom(100)
    room.take(100, lambda: True)
    running = threading.Event()
    running.set()
    thread, done, _ = _taker(room, 10, running.is_set)
    assert not done.wait(0.3)
    running.clear()
    assert done.wait(5.0), "the waiter did not notice that no step is running"
    thread.join(5.0)
    assert room.held == 110


def test_giving_back_more_than_is_held_is_an_error() -> None:
    room = HeldRoom(100)
    room.take(10, lambda: False)
    room.give(0)
    with pytest.raises(RuntimeError, match="given back twice"):
        room.give(11)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        HeldRoom(-1)
