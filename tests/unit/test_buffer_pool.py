"""storage/buffer_pool.py's slots and pool at unit level: what a slot
view gives, how many slots a pool allocates and from where, handing out and taking back,
waiting for a slot, and the error when none comes."""
from __future__ import annotations

import threading

import pytest
import torch
from fakes import RecordingManager

from infinity.storage.buffer_pool import BufferPool, Slot, SlotExhaustedError

_Manager = RecordingManager


def test_a_slot_view_is_its_first_bytes_as_the_dtype() -> None:
    slot = Slot(3, torch.zeros(64, dtype=torch.uint8))
    view = slot.view(torch.float32, 16)              # exactly the slot
    assert view.dtype == torch.float32 and view.numel() == 16
    view.fill_(1.0)
    assert slot.buffer.view(torch.float32).eq(1.0).all()   # the slot's own memory
    half = slot.view(torch.bfloat16, 5)
    assert half.numel() == 5 and half.data_ptr() == slot.buffer.data_ptr()
    assert slot.view(torch.float64, 0).numel() == 0
    with pytest.raises(ValueError) as info:
        slot.view(torch.float32, 17)
    assert str(info.value) == ("slot 3 holds 64 bytes, asked for 17 x torch.float32 = 68 bytes")


def test_a_pool_allocates_its_slots_from_the_manager_once() -> None:
    manager = _Manager()
    pool = BufferPool(manager, slot_bytes=4096, count=3, name="fetch")
    assert manager.calls == [(4096, torch.uint8, f"fetch slot {i}") for i in range(3)]
    assert (pool.name, pool.slot_bytes, pool.count, pool.available) == ("fetch", 4096, 3, 3)
    slots = [pool.acquire() for _ in range(3)]
    assert sorted(s.index for s in slots) == [0, 1, 2]
    assert len({s.buffer.data_ptr() for s in slots}) == 3
    assert all(s.buffer.numel() == 4096 and s.buffer.dtype == torch.uint8 for s in slots)
    assert pool.available == 0 and pool.try_acquire() is None
    pool.release(slots[1])
    assert pool.available == 1 and pool.try_acquire() is slots[1]
    assert len(manager.calls) == 3


@pytest.mark.parametrize("count,slot_bytes", [(0, 4096), (2, 0), (-1, 1), (1, -5)])
def test_a_pool_needs_a_slot_of_a_byte(count, slot_bytes) -> None:
    with pytest.raises(ValueError) as info:
        BufferPool(_Manager(), slot_bytes=slot_bytes, count=count, name="opt")
    assert str(info.value) == (f"opt: a buffer pool needs >= 1 slot of >= 1 byte, got "
                               f"{count} x {slot_bytes}")


def test_the_smallest_pool_is_allowed() -> None:
    pool = BufferPool(_Manager(), slot_bytes=1, count=1, name="tiny")
    assert pool.acquire().buffer.numel() == 1


def test_acquire_without_a_free_slot_raises_after_its_timeout() -> None:
    pool = BufferPool(_Manager(), slot_bytes=1 << 20, count=2, name="grad")
    pool.acquire()
    pool.acquire(timeout=0)
    with pytest.raises(SlotExhaustedError) as info:
        pool.acquire(timeout=0)
    assert str(info.value) == ("grad: all 2 slots of 1.00 MiB are in use; raise the host budget "
                               "or lower the prefetch depth")
    assert isinstance(info.value, RuntimeError)


def test_acquire_waits_for_a_slot_given_back() -> None:
    pool = BufferPool(_Manager(), slot_bytes=8, count=1, name="p")
    slot = pool.acquire()
    got: list[Slot] = []
    waiting = threading.Event()

    def taker() -> None:
        waiting.set()
        got.append(pool.acquire())        # no timeout: waits for the release
    thread = threading.Thread(target=taker)
    thread.start()
    waiting.wait()
    pool.release(slot)
    thread.join(timeout=60)
    assert not thread.is_alive() and got == [slot] and pool.available == 0


def test_each_release_wakes_a_waiter() -> None:
    pool = BufferPool(_Manager(), slot_bytes=8, count=2, name="p")
    a, b = pool.acquire(), pool.acquire()
    got: list[Slot] = []
    lock = threading.Lock()
    started = threading.Barrier(3)

    def taker() -> None:
        started.wait()
        slot = pool.acquire()
        with lock:
            got.append(slot)
    threads = [threading.Thread(target=taker) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    pool.release(a)
    pool.release(b)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(s.index for s in got) == sorted([a.index, b.index])


def test_slots_compare_by_identity() -> None:
    buf = torch.zeros(4, dtype=torch.uint8)
    assert Slot(0, buf) != Slot(0, buf)
    s = Slot(0, buf)
    assert s == s and len({s, Slot(0, buf)}) == 2


def test_wait_and_release_without_an_error_returns_after_releasing_all() -> None:
    from collections import deque

    from infinity.storage.buffer_pool import wait_and_release
    for container in (list, deque):
        waited, released = [], []
        in_flight = container([(["r1", "r2"], "s1"), ([], "s2")])
        assert wait_and_release(in_flight, waited.append, released.append) is None
        assert waited == ["r1", "r2"] and released == ["s1", "s2"] and not in_flight
