"""The held-gradient room (optim/held_room.py): bytes taken wait only while a background step
may still give some back, and are given back exactly once; at its edges, a room of 0 bytes, giving
back exactly what is held or a single byte, the seconds a take reports, and the stuck-stream error."""
from __future__ import annotations

import threading
import time

import pytest

from infinity.optim import held_room
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


# -- edges: an empty room, exact and single-byte give-backs, the seconds waited, a stuck stream ---

def test_a_room_of_zero_bytes_is_allowed_and_starts_empty() -> None:
    """A model whose units hold no trainable parameter gets a room of 0 bytes
    (``held_room_bytes(0)``): it must be made, not refused as a negative room."""
    room = HeldRoom(0)
    assert (room.capacity, room.held, room.peak) == (0, 0, 0)
    assert room.take(5, lambda: False) == 0.0    # no step runs: taken over the capacity
    assert (room.held, room.peak) == (5, 5)


def test_giving_back_everything_held_or_one_byte_is_not_an_error() -> None:
    """``give`` of exactly the bytes held empties the room; one byte is a real give-back,
    not ignored like 0."""
    room = HeldRoom(100)
    room.take(10, lambda: False)
    room.give(1)
    assert room.held == 9
    room.give(9)
    assert room.held == 0 and room.peak == 10
    with pytest.raises(RuntimeError) as info:
        room.give(1)
    assert str(info.value) == ("giving back 1 held-gradient bytes, only 0 are held: a gradient "
                               "was given back twice")


def test_take_reports_the_seconds_it_waited() -> None:
    """The wait a take returns is the time it spent (timers add it to grad_wait_s): between 0
    and the wall time around the call, whatever the machine's load."""
    room = HeldRoom(10)
    room.take(10, lambda: True)
    running = threading.Event()
    running.set()
    got: list[float] = []
    outer: list[float] = []

    def take() -> None:
        t0 = time.perf_counter()
        got.append(room.take(5, running.is_set))
        outer.append(time.perf_counter() - t0)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    while not room._changed._waiters:     # the taker is waiting in the room's condition
        time.sleep(0.001)
    running.clear()
    thread.join(30.0)
    assert not thread.is_alive()
    assert 0.0 < got[0] <= outer[0]
    assert room.held == 15


def test_a_stuck_step_stream_is_an_error_naming_the_room(monkeypatch) -> None:
    """A step that runs forever and frees nothing: the take gives up with an error that says
    how much is held of which room and that the stream is stuck (the limit made negative here,
    so the first check trips whatever the clock reads)."""
    monkeypatch.setattr(held_room, "WAIT_LIMIT_S", -1.0)
    room = HeldRoom(100)
    room.take(100, lambda: True)
    with pytest.raises(RuntimeError) as info:
        room.take(1, lambda: True)
    assert str(info.value) == (
        "held gradients took 100 bytes of a 100-byte room and no background step gave any "
        "back for -1 s: the step stream is stuck (see the log for its error)")
    assert room.held == 100
