"""The optimizer's records (optim/records.py) at unit level, on real Units, HeldRooms and
BufferPools: the timers' reset, sub-groups, gradient pieces
(flat, and held parts with a parameter that got none), a complete gradient's slices and what
it gives back, and every phase change of a step job, allowed and refused."""
from __future__ import annotations

from collections import deque

import pytest
import torch
from torch import nn

from infinity.optim.held_room import HeldRoom
from infinity.optim.records import (
    CompleteGradient, JobPhase, OptimTimers, StepJob, SubGroup, UnitOptimState, gather_gradient,
    grad_pieces, sub_groups)
from infinity.storage.buffer_pool import BufferPool
from infinity.zero.unit import Unit


def _unit() -> Unit:
    """a (group 0) at [0, 10), b at [16, 22), c (group 1) at [32, 37), frozen d at [1024, ..)."""
    named = [("a", nn.Parameter(torch.zeros(10)), 0), ("b", nn.Parameter(torch.zeros(6)), 0),
             ("c", nn.Parameter(torch.zeros(5)), 1), ("d", nn.Parameter(torch.zeros(4)), -1)]
    return Unit(0, "u0", nn.Module(), named, torch.float32, torch.device("cpu"))


def _state(shard=None) -> UnitOptimState:
    return UnitOptimState(_unit(), None, None, None, None, shard=shard)


def test_timers_reset_zeroes_every_timer() -> None:
    timers = OptimTimers(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    timers.reset()
    assert (timers.optimizer_s, timers.grad_s, timers.grad_wait_s, timers.background_s,
            timers.kernel_s, timers.device_write_wait_s) == (0.0,) * 6


def test_sub_groups_cut_the_states_range_in_chunks() -> None:
    state = _state()                                     # [0, 1024)
    assert [(g.start, g.end) for g in sub_groups(state, 400)] == [(0, 400), (400, 800),
                                                                   (800, 1024)]
    assert sub_groups(state, 1024) == [SubGroup(state, 0, 1024)]
    shard = _state(shard=(100, 350))
    assert [(g.start, g.end) for g in sub_groups(shard, 100)] == [(100, 200), (200, 300),
                                                                   (300, 350)]
    assert all(g.state is shard for g in sub_groups(shard, 100))
    assert sub_groups(_state(shard=(5, 5)), 10) == []


def test_grad_pieces_of_a_flat_gradient_are_one_slice_from_its_origin() -> None:
    grad = torch.arange(50.0)
    [(x, y, g)] = grad_pieces(_unit(), grad, 10, 12, 30)
    assert (x, y) == (12, 30) and torch.equal(g, grad[2:20])


def test_grad_pieces_of_held_parts_are_each_parameters_piece() -> None:
    """Each trainable parameter's piece of [a, b) from its part (cut from the parameter's
    start), zeros for a parameter without a part, nothing for the gaps and the frozen one."""
    parts = {0: torch.arange(10.0), 32: torch.arange(5.0) + 100}
    pieces = list(grad_pieces(_unit(), parts, 0, 4, 34))
    assert [(x, y) for x, y, _ in pieces] == [(4, 10), (16, 22), (32, 34)]
    assert torch.equal(pieces[0][2], torch.arange(4.0, 10.0))
    assert torch.equal(pieces[1][2], torch.zeros(6)) and pieces[1][2].dtype == torch.float32
    assert torch.equal(pieces[2][2], torch.tensor([100.0, 101.0]))
    assert list(grad_pieces(_unit(), parts, 0, 10, 16)) == []      # only a gap
    [(x, y, g)] = grad_pieces(_unit(), parts, 0, 9, 10)             # one element of a
    assert (x, y) == (9, 10) and torch.equal(g, torch.tensor([9.0]))


@pytest.mark.parametrize("a, b", [(0, 37), (4, 34), (3, 10), (10, 16), (16, 22), (0, 1100)])
def test_gathered_gradient_is_every_piece_and_zeros_between_whatever_the_buffer_held(
        a: int, b: int) -> None:
    """gather_gradient writes [a, b) whole: each held part's piece (a 16-bit part widened),
    zeros for the parameter without a part, the gaps between parameters and past the last
    trainable one, into a buffer full of NaN (a stale chunk); nothing past b - a touched."""
    parts = {0: torch.arange(10.0).bfloat16(), 32: torch.arange(5.0) + 100}
    out = torch.full((b - a + 3,), float("nan"))
    flat = gather_gradient(_unit(), parts, 0, a, b, out)
    want = torch.zeros(b - a)
    for offset, part in parts.items():
        x, y = max(a, offset), min(b, offset + part.numel())
        if x < y:
            want[x - a:y - a] = part[x - offset:y - offset].float()
    assert flat.data_ptr() == out.data_ptr() and torch.equal(flat, want)
    assert out[b - a:].isnan().all()


@pytest.mark.parametrize("order", [(2, 1, 0), (1, 0, 2), (0, 2, 1), (1, 2, 0)])
def test_gathered_gradient_of_pieces_out_of_order_zeroes_the_gaps_too(order) -> None:
    """A unit whose parameters are not listed in offset order still gets zeros everywhere no
    piece covers (the spans between consecutive pieces cover them in any order)."""
    unit = _unit()
    unit.params[:3] = [unit.params[i] for i in order]
    parts = {0: torch.ones(10), 16: torch.full((6,), 2.0)}
    flat = gather_gradient(unit, parts, 0, 0, 37, torch.full((37,), float("nan")))
    want = torch.zeros(37)
    want[:10], want[16:22] = 1.0, 2.0
    assert torch.equal(flat, want)


def test_a_complete_gradient_gives_its_elements() -> None:
    flat = CompleteGradient(torch.arange(20.0), origin=100)
    assert torch.equal(flat.of(105, 110), torch.arange(5.0, 10.0))
    parts = {0: torch.ones(3)}
    held = CompleteGradient(parts)
    assert held.of(0, 5) is parts
    assert CompleteGradient(torch.arange(4.0)).of(1, 3).tolist() == [1.0, 2.0]


def test_freeing_a_held_part_gives_its_bytes_back_to_the_room() -> None:
    """A part's fp32 bytes go back (never more than the gradient still holds)."""
    room = HeldRoom(1000)
    room.take(60, lambda: False)
    gradient = CompleteGradient({0: torch.zeros(10), 16: torch.zeros(8)}, held_bytes=60,
                                room=room)
    gradient.free_part(0)
    assert gradient.held_bytes == 20 and room.held == 20 and list(gradient.values) == [16]
    gradient.free_part(16)                     # 32 bytes of part, 20 held: 20 given back
    assert gradient.held_bytes == 0 and room.held == 0 and gradient.values == {}
    no_room = CompleteGradient({0: torch.zeros(2)}, held_bytes=8)
    no_room.free_part(0)
    assert no_room.held_bytes == 0
    # a 16-bit part held as autograd made it gives back its own bytes, 2 an element
    half = CompleteGradient({0: torch.zeros(10, dtype=torch.bfloat16), 16: torch.zeros(4)},
                            held_bytes=36)
    half.free_part(0)
    assert half.held_bytes == 16


def test_give_back_releases_the_slot_and_the_bytes_once() -> None:
    class _Manager:
        def host_empty(self, numel, dtype, what):
            return torch.zeros(numel, dtype=dtype)

    pool = BufferPool(_Manager(), slot_bytes=64, count=1, name="grad")
    slot = pool.acquire()
    gradient = CompleteGradient(torch.zeros(16), slot=slot, pool=pool)
    gradient.give_back()
    assert pool.available == 1 and gradient.slot is None and gradient.values == {}
    gradient.give_back()                       # a second call does nothing
    assert pool.available == 1
    assert pool.acquire() is slot              # the slot itself went back
    room = HeldRoom(100)
    room.take(40, lambda: False)
    held = CompleteGradient({0: torch.zeros(10)}, held_bytes=40, room=room)
    held.give_back()
    assert room.held == 0 and held.held_bytes == 0 and held.values == {}
    held.give_back()
    assert room.held == 0


def test_a_home_given_back_is_at_zero_where_no_kernel_zeroed_it() -> None:
    """A gradient home stepped from (``zero_at_give_back``): ``give_back`` zeroes what the
    kernels did not leave at zero (``zeroed_by_step``: the sub-groups stepped), not the rest
    again; after a step that failed midway, the sub-groups it never reached too."""
    home = torch.arange(1.0, 21.0)            # unit elements 100..119
    gradient = CompleteGradient(home, origin=100, zero_at_give_back=True)
    home[4:10] = 0.0                           # the kernel zeroed [104, 110) and [112, 116)
    home[12:16] = 0.0
    gradient.zeroed_by_step(112, 116)
    gradient.zeroed_by_step(104, 110)
    writes = []

    class _Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.zero_:
                writes.append((args[0].data_ptr() - home.data_ptr()) // 4)
            return func(*args, **(kwargs or {}))
    with _Watch():
        gradient.give_back()
    assert not bool(home.any())
    assert writes == [0, 10, 16]               # [100, 104), [110, 112), [116, 120) only
    untouched = torch.ones(8)
    CompleteGradient(untouched, zero_at_give_back=True).give_back()   # nothing stepped
    assert not bool(untouched.any())
    kept = torch.ones(8)
    CompleteGradient(kept).give_back()         # not a home: left as it is
    assert bool((kept == 1).all())


def test_a_home_s_adds_no_thread_makes_are_claimed_for_the_step_in_order() -> None:
    """[Note: the last adds fold into the step]: ``landed`` of a home stepped from claims the
    adds no thread makes on its own (``HostAdd``) as ``addends`` (unit elements, staged values)
    instead of making them. An add made by the adder thread (made whenever its copy lands)
    before them is waited for where it stands; one that cannot be claimed (outside the home) is
    made there, the adds claimed before it made first; an add already made is not claimed
    again; given back, nothing is kept. An adder's add after claimed ones is refused: their
    order could not be kept."""
    from infinity.storage.host_adds import HostAdd
    from infinity.storage.transfers import DONE

    home, elsewhere = torch.zeros(10), torch.zeros(2)
    order: list[str] = []

    class _Queued:             # an add the adder thread makes: not claimable, waited for
        def done(self) -> bool:
            return False

        def wait(self) -> None:
            order.append("queued")
            home[2:4] += 10.0

    class _Copies:
        def host_waits(self, events) -> None:
            for event in events:
                event.wait()

    first = HostAdd(DONE, home[2:4], torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    made = HostAdd(DONE, home[0:1], torch.tensor([5.0]))
    made.wait()                                 # made already (home[0] = 5)
    outside = HostAdd(DONE, elsewhere, torch.tensor([7.0, 7.0]))
    last = HostAdd(DONE, home[6:9], torch.tensor([3.0, 4.0, 5.0]))
    gradient = CompleteGradient(home, origin=100, copies=_Copies(),
                                landing=[_Queued(), first, made, outside, last],
                                zero_at_give_back=True)
    gradient.landed()
    assert order == ["queued"] and elsewhere.tolist() == [7.0, 7.0]
    # ``first`` was made before ``outside`` (claimed adds before an unclaimable one)
    assert home.tolist() == [5.0, 0.0, 11.0, 12.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [(at, v.tolist()) for at, v in gradient.addends] == [(106, [3.0, 4.0, 5.0])]
    assert gradient.landing == [] and last.done() and last.claim() is None
    gradient.give_back()
    assert gradient.addends == [] and not bool(home.any())
    # an adder's add after a claimed one: refused, not made out of order
    other = torch.zeros(4)
    late = CompleteGradient(other, copies=_Copies(), zero_at_give_back=True,
                            landing=[HostAdd(DONE, other[0:2], torch.ones(2)), _Queued()])
    with pytest.raises(RuntimeError, match="order cannot be kept"):
        late.landed()
    # not a home stepped from: every add is made at the wait, as before
    plain = torch.zeros(2)
    CompleteGradient(torch.zeros(4), copies=_Copies(),
                     landing=[HostAdd(DONE, plain, torch.ones(2))]).landed()
    assert plain.tolist() == [1.0, 1.0]


def test_landed_waits_for_the_copies_once_through_their_owner() -> None:
    class _Copies:
        def __init__(self) -> None:
            self.waited: list[list] = []

        def host_waits(self, events) -> None:
            self.waited.append(list(events))

    copies, events = _Copies(), [object(), object()]
    gradient = CompleteGradient(torch.zeros(4), copies=copies, landing=list(events))
    gradient.landed()
    gradient.landed()                          # once: nothing left to wait for
    gradient.give_back()
    assert copies.waited == [events] and gradient.landing == []
    orphan = CompleteGradient(torch.zeros(4), landing=[object()])
    with pytest.raises(RuntimeError, match="1 copies landing and no copies' owner"):
        orphan.landed()


def test_a_landed_wait_cut_short_is_waited_again_before_the_slot_goes_back() -> None:
    """The step stream's wait for the gradient's copies fails (a device error): the events
    stay, and ``give_back`` (the failed job's gradient) waits for them before the slot goes
    back."""
    class _Copies:
        def __init__(self) -> None:
            self.waited: list[list] = []

        def host_waits(self, events) -> None:
            self.waited.append(list(events))
            if len(self.waited) == 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class _Pool:
        def __init__(self, copies: _Copies) -> None:
            self.copies, self.released_after = copies, None

        def release(self, slot) -> None:
            self.released_after = len(self.copies.waited)

    copies, events = _Copies(), [object(), object()]
    pool = _Pool(copies)
    gradient = CompleteGradient(torch.zeros(4), slot=object(), pool=pool, copies=copies,
                                landing=list(events))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        gradient.landed()
    assert gradient.landing == events
    gradient.give_back()
    assert copies.waited == [events, events] and pool.released_after == 2
    assert gradient.landing == [] and gradient.slot is None


def _job(phase: JobPhase = JobPhase.READY) -> StepJob:
    return StepJob(_state(), deque(), left=1, early=False, phase=phase)


def test_a_job_goes_through_its_life_and_its_futures_complete() -> None:
    job = _job(JobPhase.EXPECTED)
    assert not job.ready and not job.cancelled
    job.make_ready()
    assert job.phase is JobPhase.READY and job.ready
    assert not job.stepped_future.done()
    job.stepped()
    assert job.phase is JobPhase.STEPPED and job.stepped_future.result(0) is None
    assert not job.landed_future.done()
    job.landed()
    assert job.phase is JobPhase.LANDED and job.landed_future.result(0) is None
    job.reaped()
    assert job.phase is JobPhase.REAPED
    job.roll_back()
    assert job.phase is JobPhase.ROLLED_BACK


def test_a_phase_change_from_the_wrong_phase_is_refused_naming_both() -> None:
    job = _job(JobPhase.READY)
    with pytest.raises(RuntimeError) as info:
        job.landed()
    assert str(info.value) == "step job of u0: ready -> landed (allowed from ['stepped'])"
    assert job.phase is JobPhase.READY and not job.landed_future.done()
    with pytest.raises(RuntimeError) as info:
        job.make_ready()
    assert str(info.value) == "step job of u0: ready -> ready (allowed from ['expected'])"
    with pytest.raises(RuntimeError, match=r"ready -> reaped \(allowed from \['landed'\]\)"):
        job.reaped()
    with pytest.raises(RuntimeError, match=r"rolled back \(allowed from \['reaped', 'failed'\]"):
        job.roll_back()
    with pytest.raises(RuntimeError, match=r"expected -> stepped"):
        _job(JobPhase.EXPECTED).stepped()
    landed = _job(JobPhase.LANDED)
    with pytest.raises(RuntimeError, match=r"landed -> failed \(allowed from \['expected', "
                                           r"'ready', 'stepped', 'cancelled'\]\)"):
        landed.fail(OSError("late"))
    assert landed.error is None


def test_a_failed_expected_job_stays_failed_when_made_ready() -> None:
    job = _job(JobPhase.EXPECTED)
    job.fail(OSError("read failed"))
    job.make_ready()
    assert job.phase is JobPhase.FAILED


def test_cancel_only_an_expected_job_and_dropping_it_completes_its_futures() -> None:
    job = _job(JobPhase.EXPECTED)
    assert job.cancel() is True
    assert job.phase is JobPhase.CANCELLED and job.cancelled and not job.ready
    assert job.cancel() is False
    job.dropped()
    assert job.phase is JobPhase.CANCELLED
    assert job.stepped_future.result(0) is None and job.landed_future.result(0) is None
    ready = _job(JobPhase.READY)
    assert ready.cancel() is False and ready.phase is JobPhase.READY
    with pytest.raises(RuntimeError, match="ready -> cancelled"):
        ready.dropped()


def test_a_failure_reaches_both_futures_and_the_first_error_is_kept() -> None:
    job = _job(JobPhase.READY)
    first = OSError("write failed")
    job.fail(first)
    assert job.phase is JobPhase.FAILED and job.error is first and job.ready
    assert job.stepped_future.exception(0) is first and job.landed_future.exception(0) is first
    job.roll_back()
    assert job.phase is JobPhase.ROLLED_BACK
    # failed after its kernels ran: the stepped future keeps its result
    stepped = _job(JobPhase.READY)
    stepped.stepped()
    stepped.error = ValueError("kernel")          # recorded by the stream before the phase
    stepped.fail(OSError("then the write"))
    assert isinstance(stepped.error, ValueError)
    assert stepped.stepped_future.result(0) is None
    assert stepped.landed_future.exception(0) is stepped.error
    cancelled = _job(JobPhase.EXPECTED)
    cancelled.cancel()
    cancelled.fail(OSError("x"))
    assert cancelled.phase is JobPhase.FAILED


def test_counted_and_take_sq_norm() -> None:
    job = _job()
    assert not job.counted
    job.runs = []
    assert job.counted
    job.sq_norm = 2.5
    assert job.take_sq_norm() == 2.5 and job.take_sq_norm() == 0.0
    job.phase = JobPhase.ROLLED_BACK
    assert not job.counted


def test_a_units_home_gradient_goes_through_its_cycle() -> None:
    """``HomeGradient``: kept at its first micro-step, counted in the norm at the boundary,
    recounted by a second backward, cleared by its step; counting one that never came is an
    error (the cycle ran out of order), not a silent step of nothing."""
    from infinity.optim.records import HomeGradient

    state = _state()
    assert state.home_grad is HomeGradient.NONE and not state.has_grads
    with pytest.raises(RuntimeError, match="counted in the norm before any arrived"):
        state.count_norm()
    state.keep_gradient()
    state.keep_gradient()                      # a later micro-step adds to it
    assert state.home_grad is HomeGradient.KEPT and state.has_grads and not state.norm_counted
    state.count_norm()
    assert state.norm_counted and state.has_grads
    state.keep_gradient()                      # counted stays counted
    assert state.home_grad is HomeGradient.COUNTED
    state.uncount_norm()
    assert state.home_grad is HomeGradient.KEPT
    state.clear_gradient()
    assert state.home_grad is HomeGradient.NONE
    state.uncount_norm()                       # nothing to uncount: stays
    assert state.home_grad is HomeGradient.NONE
