"""The dry run's host <-> device copies (simulate/copies.py) keep [Note: copy events] on
the simulated clock: a copy takes the link's time on its direction's lane, compute that reads
it starts at its end (the wait shows on the "compute waits" row), its source slot goes back at
its end and not before, and on a CPU device (rate 0) copies are free and immediate, as the
engine's ``ImmediateCopies``."""
from __future__ import annotations

import pytest
import torch

from infinity.simulate.clock import WAIT, SimClock
from infinity.simulate.storage import SimManager, SimPool
from infinity.simulate.copies import D2H, H2D, SimCopies

META = torch.device("meta")
MiB = 2**20


def _copies(rate: float = 1e9) -> tuple[SimClock, SimCopies]:
    clock = SimClock(spans=[])
    return clock, SimCopies(clock, rate)


def test_a_copy_takes_the_links_time_and_compute_waits_for_its_end() -> None:
    clock, copies = _copies(1e9)
    src = torch.empty(250_000, dtype=torch.float32, device=META)      # 1e6 bytes: 1 ms
    with copies.for_unit("model.layers.3"):
        first = copies.to_device(src, src)
        second = copies.to_device(src, src)      # the lane serves one copy at a time
    assert (first.end, second.end) == pytest.approx((1e-3, 2e-3))
    assert not first.done()
    clock.compute(0.5e-3, "forward model.layers.2")     # the copy overlaps this compute
    copies.compute_waits(first)
    assert clock.now == pytest.approx(1e-3) and first.done() and not second.done()
    assert clock.io_wait_s == pytest.approx(0.5e-3)
    rows = {(row, what) for row, *_, what in clock.spans}
    assert (H2D, "copy model.layers.3 1.0 MiB") in rows
    assert (WAIT, "waits for the copy of model.layers.3") in rows


def test_a_slot_goes_back_at_its_copys_end_and_an_acquire_waits_for_it() -> None:
    clock = SimClock(spans=[])
    copies = SimCopies(clock, 1e9)
    manager = SimManager(None, None, clock=clock, read_Bps=1e9, write_Bps=1e9,
                         device_is_cpu=False, copies=copies)
    pool = SimPool(manager, MiB, 1, "fetch")
    slot = pool.acquire()
    event = copies.to_device(slot.buffer, slot.buffer)              # 1 MiB at 1 GB/s
    copies.release_after(event, lambda: pool.release(slot))
    assert pool.available == 0 and pool.try_acquire() is None    # the copy still reads it
    again = pool.acquire()                                        # waits for the copy's end
    assert again is slot and clock.now == pytest.approx(MiB / 1e9)
    assert clock.spans[-1][0] == WAIT and clock.spans[-1][3] == "waits for a fetch slot"


def test_a_gradient_leaves_on_its_own_lane() -> None:
    clock, copies = _copies(2e9)
    grad = torch.empty(MiB // 4, dtype=torch.float32, device=META)
    up = copies.to_device(grad, grad)
    with copies.for_unit("lm_head"):
        down = copies.to_host(grad, grad)
    assert up.end == pytest.approx(down.end)      # the two directions overlap
    copies.host_waits([down])
    assert clock.now == pytest.approx(MiB / 2e9)
    assert (D2H, "gradient lm_head 1.0 MiB") in {(row, what) for row, *_, what in clock.spans}


def test_on_a_cpu_device_copies_are_free_and_immediate() -> None:
    clock, copies = _copies(0.0)
    released = []
    src = torch.empty(1 << 20, device=META)
    event = copies.to_device(src, src)
    copies.release_after(event, lambda: released.append(1))
    copies.compute_waits(event)
    copies.host_waits([copies.to_host(src, src, add=True)])
    assert event.done() and released == [1]
    assert clock.now == 0.0 and clock.io_wait_s == 0.0 and clock.spans == []


def test_a_negative_link_rate_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match="-1.0 B/s"):
        SimCopies(SimClock(), -1.0)


def test_a_copy_another_thread_issues_later_does_not_delay_the_ones_issued_before_it() -> None:
    """A stepped unit's device copy is written by the step stream once its kernels have run
    (``Lane.reserve`` at that future time): a copy the training thread issues before then
    runs first where it fits before it, else after it; later copies keep their order."""
    from infinity.simulate.clock import Lane

    clock = SimClock(spans=[])
    lane = Lane(clock, 1.0, H2D)               # amounts in seconds
    assert lane.reserve(2.0, at=5.0) == 7.0      # issued at 5 s, by the step stream
    assert lane.schedule(3.0) == 3.0             # issued now: fits before it
    assert lane.schedule(3.0) == 10.0            # 3 s from 3 s would overlap [5, 7]: after
    assert lane.schedule(1.0) == 11.0            # in order behind the one before
    assert lane.reserve(1.0, at=0.0) == 12.0     # never ahead of what was issued before it
    assert lane.busy_s == pytest.approx(10.0)
    busy = sorted((lo, hi) for row, lo, hi, _ in clock.spans if row == H2D)
    assert all(a_hi <= b_lo for (_, a_hi), (b_lo, _) in zip(busy, busy[1:]))   # one at a time


def test_two_shared_lanes_take_turns_and_keep_their_own_busy_time() -> None:
    """The CPU Adam and the gradient adds are one resource shown as two rows (``Lane.share``):
    work on either starts after what was scheduled on both; each row keeps its own busy
    seconds. Unshared lanes run side by side."""
    from infinity.simulate.clock import Lane
    clock = SimClock(spans=[])
    adam, adds = Lane(clock, 1.0, "CPU Adam"), Lane(clock, 2.0, "host adds")
    adds.share(adam)
    assert adam.schedule(1.0) == 1.0                    # 0 -> 1 s
    assert adds.schedule(2.0) == 2.0                    # after the Adam: 1 -> 2 s
    assert adam.schedule(1.0, not_before=0.5) == 3.0    # after the add: 2 -> 3 s
    assert (adam.busy_s, adds.busy_s) == (2.0, 1.0)
    alone_a, alone_b = Lane(clock, 1.0, "a"), Lane(clock, 1.0, "b")
    assert alone_a.schedule(1.0) == alone_b.schedule(1.0) == 1.0
