"""How gradients reach the optimizer (optim/gradients.py) at unit level: real units, states,
buffer pools and tensors, a held room and collectives that record, and a flat store on a
pretend disk (fakes.py). Numbers are
checked against float64 sums or torch's own add, exactly where the code promises bits."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from fakes import MemoryStore, WaitingManager
from torch import nn

from infinity.optim import _adam_native as N
from infinity.optim import gradients
from infinity.optim.grad_norm import sum_of_squares
from infinity.optim.gradients import GradientCollector, gradients_held
from infinity.optim.records import OptimTimers, UnitOptimState
from infinity.planner.engine_sizes import accumulate_chunk_numel, held_room_bytes
from infinity.storage.buffer_pool import BufferPool, Slot
from infinity.storage.manager import FlatStore
from infinity.storage.tiers import Tier
from infinity.storage.transfers import LateCopies
from infinity.zero.unit import Unit

F32 = torch.float32


# -- stand-ins -------------------------------------------------------------------------------
class _Room:
    """A held room that records each take (bytes, and whether it would wait now) and each
    give; every take reports ``wait_s`` seconds waited."""

    def __init__(self, wait_s: float = 0.0) -> None:
        self.taken: list[tuple[int, bool]] = []
        self.given: list[int] = []
        self.wait_s = wait_s

    def take(self, nbytes: int, may_wait) -> float:
        self.taken.append((nbytes, may_wait()))
        return self.wait_s

    def give(self, nbytes: int) -> None:
        self.given.append(nbytes)


class _TwoRanks:
    """Rank ``rank`` of two, the other rank's flat gradient and arrival mask given: the
    collectives compute what two ranks would (means, the OR of the masks) and record calls."""

    active = True
    world_size = 2

    def __init__(self, rank: int, other: torch.Tensor, other_mask: list[bool]) -> None:
        self.rank = rank
        self.other = other
        self.other_mask = torch.tensor(other_mask)
        self.calls: list[tuple] = []

    def reduce_scatter_mean(self, output, source, tag=None) -> None:
        if output.dtype != source.dtype:     # as reduce_scatter_tensor requires
            raise TypeError(f"reduce-scatter of {source.dtype} into {output.dtype}")
        self.calls.append(("reduce_scatter", source.numel(), tag))
        n = output.numel()
        output.copy_(((source + self.other) / 2)[self.rank * n:(self.rank + 1) * n])

    def all_reduce_mean(self, tensor, tag=None) -> None:
        self.calls.append(("all_reduce", tensor.numel(), tag))
        tensor.copy_((tensor + self.other[:tensor.numel()]) / 2)

    def any_mask(self, mask):
        self.calls.append(("any_mask", mask.tolist()))
        return mask | self.other_mask


def _unit(index: int = 0, shapes=((3, 5), (7,)), *, comm=None, shards: int = 1) -> Unit:
    """Trainable parameters of ``shapes`` (group 0) and a frozen one: with the default shapes
    p0 lies at [0, 15), p1 at [16, 23), the trainable range is 1024 elements."""
    named = [(f"p{i}", nn.Parameter(torch.zeros(s)), 0) for i, s in enumerate(shapes)]
    named.append(("frozen", nn.Parameter(torch.zeros(4), requires_grad=False), -1))
    extra = {} if comm is None else {"comm": comm, "shards": shards}
    return Unit(index, f"u{index}", nn.Module(), named, F32, torch.device("cpu"), **extra)


def _host_store(n: int) -> FlatStore:
    return FlatStore(WaitingManager(), "grad", n, F32, Tier.HOST)


class _Rig:
    """A collector over ``units`` as the optimizer makes it: ``home`` "host" (a resident
    gradient home), "disk" (a store on the pretend disk) or None (early step); slots of the
    gradient pool are filled with NaN, as a reused buffer holds old bytes."""

    def __init__(self, units: list[Unit], *, home: str | None = "host", early_step=False,
                 holds_grads=False, slots: int = 2, comm=None, scatter=False,
                 max_trainable: int | None = None, room=None, shards=None, manager=None,
                 device_buffers: int | None = None, device_dtype: str | None = None) -> None:
        self.manager = manager if manager is not None else WaitingManager()
        self.running = False
        self.speculated: set[int] = set()
        self.states = []
        for i, unit in enumerate(units):
            shard = None if shards is None else shards[i]
            n = unit.trainable_numel if shard is None else shard[1] - shard[0]
            store = None if home is None else (
                _host_store(max(n, 1)) if home == "host" else MemoryStore(max(n, 1), name="grad"))
            self.states.append(UnitOptimState(unit, None, None, None, store, shard=shard))
        largest = max(u.flat_numel if scatter else u.trainable_numel for u in units)
        self.pool = BufferPool(self.manager, largest * 4, slots, "gradient") if slots else None
        if self.pool is not None:
            for slot in self.pool._free:
                slot.buffer.fill_(0xFF)      # float32 NaN
        self.room = room if room is not None else _Room()
        self.timers = OptimTimers()
        extra = {} if comm is None else {"comm": comm}
        if scatter:    # with NO_COMM too: scattering needs several ranks
            extra["scatter"] = True       # else the default: an all-reduce (stage 0)
        if device_buffers is not None:
            extra["device_buffers"] = device_buffers
        if device_dtype is not None:
            extra["device_dtype"] = device_dtype
        self.g = GradientCollector(
            self.states, self.manager, early_step=early_step, holds_grads=holds_grads,
            grad_pool=self.pool, held_room=self.room, timers=self.timers,
            max_trainable=max_trainable if max_trainable is not None else largest,
            steps_running=lambda: self.running,
            speculates=lambda state: state.unit.index in self.speculated, **extra)

    def grad(self, state: UnitOptimState, index: int, values: torch.Tensor) -> None:
        self.g.on_grad(state.unit, state.unit.trainable_entries()[index], values)


def _flat(unit: Unit, *grads: torch.Tensor | None) -> torch.Tensor:
    """The unit's trainable range with ``grads`` (by trainable entry) at their places."""
    out = torch.zeros(unit.trainable_numel, dtype=torch.float64)
    for entry, g in zip(unit.trainable_entries(), grads):
        if g is not None:
            out[entry.offset:entry.offset + entry.numel] = g.double().reshape(-1)
    return out


# -- module functions ------------------------------------------------------------------------
def test_held_room_is_one_largest_unit_of_float32_gradient() -> None:
    assert held_room_bytes(1000) == 4000 and isinstance(held_room_bytes(1000), int)
    assert held_room_bytes(0) == 0


def test_gradients_are_held_only_on_a_cpu_device() -> None:
    assert gradients_held(torch.device("cpu"))
    assert not gradients_held(torch.device("cuda", 0))
    assert not gradients_held(torch.device("meta"))


def test_collect_numel_is_the_trainable_range_or_every_shard_when_scattered() -> None:
    comm = _TwoRanks(1, torch.zeros(4096), [False, False])
    unit = _unit(shapes=((40, 50), (900,)), comm=comm, shards=2)
    assert (unit.trainable_numel, unit.flat_numel) == (3072, 4096)
    assert _Rig([unit]).g.collect_numel(unit) == 3072                  # one rank
    assert _Rig([unit], comm=comm).g.collect_numel(unit) == 3072       # all-reduce (stage 0)
    assert _Rig([unit], comm=comm, scatter=True).g.collect_numel(unit) == 4096
    rig = _Rig([unit], scatter=True)      # scattering needs several ranks
    assert not rig.g.reduces and not rig.g.scatter and rig.g.collect_numel(unit) == 3072


def test_begin_backward_recounts_the_norm_only_at_the_boundary() -> None:
    rig = _Rig([_unit(0), _unit(1)])
    rig.g.sq_norm = 5.0
    for s in rig.states:
        s.keep_gradient()
        s.count_norm()
    rig.g.begin_backward(False)
    assert rig.g.boundary is False and rig.g.sq_norm == 5.0
    assert all(s.norm_counted for s in rig.states)
    rig.g.begin_backward(True)
    assert rig.g.boundary is True and rig.g.sq_norm == 0.0
    assert not any(s.norm_counted for s in rig.states)


def test_gradients_accumulate_in_a_resident_home_in_place() -> None:
    rig = _Rig([_unit()])
    state = rig.states[0]
    g0, g1 = torch.randn(3, 5), torch.randn(7, dtype=torch.bfloat16)
    rig.grad(state, 0, g0)
    first = rig.timers.grad_s
    assert first > 0.0
    rig.grad(state, 1, g1)
    rig.grad(state, 0, g0)         # a second gradient of p0 (a tied use) adds
    assert rig.timers.grad_s > first
    assert torch.equal(state.grad_store.tensor[:1024].double(), _flat(state.unit, 2 * g0, g1))
    assert state.arrived == {0, 16} and state.grad.seen == 3
    assert state.grad.buffer is None and rig.pool.available == 2    # no buffer taken


def test_a_fresh_buffer_is_copied_into_then_added_to_and_its_gaps_zeroed() -> None:
    rig = _Rig([_unit()], home="disk")
    state = rig.states[0]
    g1 = torch.randn(7)
    rig.grad(state, 1, g1)
    assert rig.pool.available == 1 and state.grad.slot is not None
    assert state.grad.buffer.numel() == 1024 and state.grad.written == {16}
    assert torch.equal(state.grad.buffer[16:23], g1)                  # copied over the NaNs
    assert torch.isnan(state.grad.buffer[:16]).all() and torch.isnan(state.grad.buffer[23:]).all()
    rig.grad(state, 1, g1)
    assert torch.equal(state.grad.buffer[16:23], 2 * g1)              # the second one adds
    rig.g.zero_unwritten(state)
    assert torch.equal(state.grad.buffer.double(), _flat(state.unit, None, 2 * g1))
    assert state.grad.written is None
    state.grad.buffer[:16] = 1.0
    rig.g.zero_unwritten(state)          # nothing fresh any more: a no-op
    assert (state.grad.buffer[:16] == 1.0).all()


def test_zero_unwritten_covers_every_gap_around_written_parameters() -> None:
    rig = _Rig([_unit(shapes=((3,), (20,), (5,)))], home="disk")
    state = rig.states[0]
    offsets = [e.offset for e in state.unit.trainable_entries()]
    assert offsets == [0, 16, 48]
    g0, g2 = torch.randn(3), torch.randn(5)
    rig.grad(state, 2, g2)
    rig.grad(state, 0, g0)
    rig.g.zero_unwritten(state)
    assert torch.equal(state.grad.buffer.double(), _flat(state.unit, g0, None, g2))
    rig2 = _Rig([_unit()], home="disk")
    rig2.g.zero_unwritten(rig2.states[0])          # no buffer yet: nothing to do
    assert rig2.states[0].grad.buffer is None and rig2.pool.available == 2


def test_a_unit_without_a_free_slot_lands_the_oldest_write_first() -> None:
    units = [_unit(0), _unit(1), _unit(2)]
    rig = _Rig(units, home="disk")
    a, b, c = rig.states
    for s in (a, b):
        rig.grad(s, 0, torch.full((3, 5), float(s.unit.index + 1)))
        rig.g.zero_unwritten(s)
        rig.g.finish(s)                      # written home in the background
    assert rig.pool.available == 0 and a.grad_store.data[0] == 0.0     # not landed yet
    rig.grad(c, 0, torch.ones(3, 5))
    assert a.grad_store.data[0] == 1.0 and b.grad_store.data[0] == 0.0  # only the oldest
    assert rig.pool.available == 0 and c.grad.slot is not None
    rig.g.land_writes()
    assert b.grad_store.data[0] == 2.0 and rig.pool.available == 1     # c holds one
    rig.g.drop_buffer(c)
    assert rig.pool.available == 2


def test_without_a_slot_it_waits_for_a_running_step_else_takes_a_budgeted_buffer() -> None:
    rig = _Rig([_unit(0), _unit(1), _unit(2)], home="disk", slots=1)
    a, b, c = rig.states
    rig.grad(a, 0, torch.ones(3, 5))
    asked = []
    spare = Slot(9, torch.zeros(4096, dtype=torch.uint8))

    def acquire(timeout=None):
        asked.append(timeout)
        return spare
    rig.pool.acquire = acquire
    rig.running = True
    rig.grad(b, 0, torch.ones(3, 5))
    assert asked == [600.0] and b.grad.slot is spare
    rig.running = False
    rig.grad(c, 1, torch.ones(7))
    assert asked == [600.0] and c.grad.slot is None
    assert rig.manager.calls[-1] == (1024, F32, "u2 gradient")
    assert c.grad.buffer.numel() == 1024 and c.grad.written == {16}


def test_an_early_step_holds_autograd_gradients_in_their_dtype() -> None:
    room = _Room(wait_s=0.25)
    rig = _Rig([_unit()], home=None, early_step=True, holds_grads=True, room=room)
    rig.running = True
    state = rig.states[0]
    g0 = torch.randn(5, 3, dtype=torch.bfloat16).t()     # 16-bit, not contiguous
    g1 = torch.randn(7)
    rig.grad(state, 0, g0)
    rig.grad(state, 1, g1)
    keep = g1.clone()
    rig.grad(state, 1, g1)           # a second gradient of p1: a new sum
    assert torch.equal(g1, keep)     # autograd's tensor is not added to in place
    parts = state.grad.parts
    assert sorted(parts) == [0, 16]
    # bf16 as autograd made it (the kernels widen it exactly), made contiguous
    assert parts[0].dtype == torch.bfloat16 and parts[0].is_contiguous()
    assert parts[0].shape == (15,) and torch.equal(parts[0], g0.reshape(-1))
    assert torch.equal(parts[16], g1 + g1)
    # room in the parts' own bytes: one take per part, the unit's first never waits, later
    # ones while steps run; a second fp32 gradient of p1 adds no bytes
    assert room.taken == [(30, False), (28, True)]
    assert state.grad.held_bytes == 58 and state.grad.seen == 3 and state.arrived == {0, 16}
    assert rig.timers.grad_wait_s == 0.5 and rig.timers.grad_s > 0.0
    assert state.grad.buffer is None and rig.pool.available == 2


def test_a_second_16bit_gradient_is_summed_in_fp32_and_takes_the_wider_bytes() -> None:
    room = _Room(wait_s=0.0)
    rig = _Rig([_unit()], home=None, early_step=True, holds_grads=True, room=room)
    state = rig.states[0]
    g0 = torch.randn(15, dtype=torch.bfloat16)
    rig.grad(state, 0, g0)
    rig.grad(state, 0, g0)
    part = state.grad.parts[0]
    assert part.dtype == F32 and torch.equal(part, g0.float() + g0.float())
    assert room.taken == [(30, False), (30, False)]   # 2 -> 4 bytes an element
    assert state.grad.held_bytes == 60


def test_held_parts_wait_for_a_running_step_with_a_real_room(monkeypatch) -> None:
    """With the room full the unit's second part waits while steps run (a negative limit
    makes the wait give up at once); its first part never waits."""
    from infinity.optim import held_room
    from infinity.optim.held_room import HeldRoom

    monkeypatch.setattr(held_room, "WAIT_LIMIT_S", -1.0)
    room = HeldRoom(10)
    rig = _Rig([_unit()], home=None, early_step=True, holds_grads=True, room=room)
    rig.running = True
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))       # 60 bytes over a room of 10: taken
    assert room.held == 60
    with pytest.raises(RuntimeError, match="the step stream is stuck"):
        rig.grad(state, 1, torch.ones(7))
    rig.running = False
    rig.grad(state, 1, torch.ones(7))           # no step runs: taken over the capacity
    assert room.held == 88 == state.grad.held_bytes


def test_a_deferred_unit_holds_only_a_speculated_gradient_that_starts_the_cycle() -> None:
    rig = _Rig([_unit(0), _unit(1), _unit(2)], home="disk", holds_grads=True)
    a, b, c = rig.states
    rig.speculated = {0, 1}
    b.keep_gradient()                      # accumulated: added to its home through a buffer
    for s in (a, b, c):
        rig.grad(s, 0, torch.ones(3, 5))
    assert a.grad.parts is not None and a.grad.buffer is None
    assert b.grad.parts is None and b.grad.buffer is not None
    assert c.grad.parts is None and c.grad.buffer is not None          # not speculated
    rig.speculated = set()
    rig.grad(a, 1, torch.ones(7))          # once holding, the unit keeps holding
    assert sorted(a.grad.parts) == [0, 16] and a.grad.buffer is None
    rig.speculated = {2}
    rig.grad(c, 1, torch.ones(7))          # a buffer already taken: no holding
    assert c.grad.parts is None and c.grad.written == {0, 16}


def test_nothing_is_held_where_the_optimizer_does_not_hold_gradients() -> None:
    rig = _Rig([_unit()], home=None, early_step=True, holds_grads=False)
    state = rig.states[0]
    rig.speculated = {0}
    rig.grad(state, 0, torch.ones(3, 5))
    assert state.grad.parts is None and state.grad.written == {0}
    assert rig.room.taken == []


def test_finish_in_a_resident_home_leaves_the_norm_to_the_step() -> None:
    """One rank's gradient added into its resident home is not read by ``finish``, at the
    boundary either: the unit is kept uncounted, and the step sums its norm from the home
    (what ``home_gradient`` gives: both micro-steps' sum)."""
    rig = _Rig([_unit()])
    state = rig.states[0]
    g0 = torch.randn(3, 5)
    for boundary in (False, True):
        rig.g.begin_backward(boundary)
        rig.grad(state, 0, g0)
        grads = rig.g.finish(state)
        assert grads.data_ptr() == state.grad_store.tensor.data_ptr() and grads.numel() == 1024
        assert state.has_grads and not state.norm_counted and rig.g.sq_norm == 0.0
    (start, home), = rig.g.home_gradient(state)
    assert start == 0 and torch.equal(home[:15], (2 * g0).reshape(-1))
    rig.g.land_writes()
    assert rig.manager.waits == []        # nothing written: the home is the memory


def test_at_most_folding_units_leave_their_adds_to_their_steps(monkeypatch) -> None:
    """[Note: the last adds fold into the step]: in the last micro-batch a unit the boundary
    steps take has its adds into its home left for its step (``to_host(deferred=True)``), but
    at most ``FOLDING_UNITS`` units hold such adds (their staging) at once: the next units'
    adds are made as before, for the rest of that backward (never an adder's add after a
    deferred one over the same elements); room comes back as a unit's adds are made (waited
    for) or its step gives its gradient back; a unit the steps do not take never defers, even
    one that did in an earlier backward."""
    from infinity.optim import gradients as gradients_module
    monkeypatch.setattr(gradients_module, "FOLDING_UNITS", 2)
    units = [_unit(i) for i in range(4)]
    rig = _Rig(units, home="host")
    taken = {0, 1, 2}
    rig.g._folds = lambda state: state.unit.index in taken
    deferred: list[bool] = []
    to_host = rig.g.copies.to_host

    def recording(dst, src, **kwargs):
        deferred.append(kwargs.get("deferred", False))
        return to_host(dst, src, **kwargs)
    monkeypatch.setattr(rig.g.copies, "to_host", recording)
    g = torch.ones(3, 5)
    rig.g.begin_backward(True)
    for state in rig.states:           # a first gradient copies (not an add): then one add each
        rig.grad(state, 0, g)
    for state in rig.states:
        rig.grad(state, 0, g)
    assert deferred[4:] == [True, True, False, False]
    assert rig.g._folding == {0, 1}
    for state in rig.states:                            # each unit's backward is done
        rig.g.finish(state, norm=False)
        rig.g.drop_buffer(state, forget=True)
    gradient = rig.g.take_home(rig.states[0])          # unit 0's step took its adds ...
    gradient.give_back()                                # ... and gave its gradient back
    rig.g.home_copies_landed()                          # units 1-3: their adds made here
    assert rig.g._folding == set()
    rig.grad(rig.states[2], 0, g)
    assert deferred[-1] is False      # decided at its first add of this backward: the adder's
    rig.g.begin_backward(True)                          # the next cycle's last backward
    rig.grad(rig.states[2], 0, g)
    assert deferred[-1] is True                         # room again
    rig.g._folds = lambda state: False                  # a backward whose steps take none
    rig.grad(rig.states[2], 0, g)
    assert deferred[-1] is False


def test_finish_in_a_resident_home_does_not_wait_for_its_copies() -> None:
    """The adds into a resident home are still landing when ``finish`` returns (it must not
    wait: on a GPU the training thread would stop queueing the backward); whoever reads the
    home waits for them first, and reads both micro-steps' sum."""
    rig, copies, gate = _late_rig("host")
    state = rig.states[0]
    g0 = torch.randn(3, 5)
    waits = _training_thread_must_not_wait(copies, gate)
    rig.g.begin_backward(False)
    rig.grad(state, 0, g0)
    rig.g.finish(state)
    rig.g.drop_buffer(state, forget=True)
    rig.g.begin_backward(True)
    rig.grad(state, 0, g0)
    rig.g.finish(state)
    rig.g.drop_buffer(state, forget=True)
    landing = rig.g._home_copies[state.unit.index]
    assert len(landing) == 2 and not any(e.done() for e in landing)
    rig.g.land_copies(homes=False)         # a backward's end: the home's adds go on
    assert len(rig.g._home_copies[state.unit.index]) == 2
    copies.host_waits = waits
    gate.set()
    (start, home), = rig.g.home_gradient(state)
    assert rig.g._home_copies == {} and torch.equal(home[:15], (2 * g0).reshape(-1))
    assert copies.poisoned == copies.lost == 0


def test_a_resident_home_read_before_its_adds_misses_them(monkeypatch) -> None:
    """The planted fault: without the wait for the home's copies the home reads without the
    adds still landing (zero here), not the gradient."""
    rig, copies, gate = _late_rig("host")
    monkeypatch.setattr(GradientCollector, "home_copies_landed", lambda self, keep=0: None)
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))
    rig.g.finish(state)
    (_, home), = rig.g.home_gradient(state)
    assert torch.equal(home[:15], torch.zeros(15))
    gate.set()
    copies.drain()


def test_finish_writes_a_disk_gradient_home_in_the_background() -> None:
    rig = _Rig([_unit()], home="disk")
    state = rig.states[0]
    g1 = torch.randn(7)
    rig.grad(state, 1, g1)
    rig.g.zero_unwritten(state)
    slot = state.grad.slot
    grads = rig.g.finish(state)
    assert torch.equal(grads.double(), _flat(state.unit, None, g1))
    assert state.grad.buffer is None and state.grad.slot is None and state.has_grads
    assert rig.g.sq_norm == pytest.approx(float((g1.double() ** 2).sum()), rel=1e-12)
    assert state.norm_counted
    assert rig.pool.available == 1 and float(state.grad_store.data.abs().sum()) == 0.0
    rig.g.land_writes()
    assert torch.equal(state.grad_store.data.double(), _flat(state.unit, None, g1))
    assert rig.pool.available == 2 and slot in rig.pool._free
    rig.g.land_writes()
    assert len(rig.manager.waits) == 1


def test_finish_adds_what_earlier_micro_steps_left_on_disk_chunk_by_chunk() -> None:
    unit = _unit(shapes=((1500,), (7,)))
    assert unit.trainable_numel == 2048
    rig = _Rig([unit], home="disk", max_trainable=1)
    state = rig.states[0]
    assert accumulate_chunk_numel(1) == 1024
    earlier = torch.randn(2048)
    state.grad_store.data.copy_(earlier)
    state.keep_gradient()
    g0, g1 = torch.randn(1500), torch.randn(7)
    rig.grad(state, 0, g0)
    rig.grad(state, 1, g1)
    rig.g.zero_unwritten(state)
    grads = rig.g.finish(state, write_home=False)
    assert torch.allclose(grads.double(), earlier.double() + _flat(unit, g0, g1), rtol=0,
                          atol=1e-6)
    assert state.grad.buffer is grads and state.grad.slot is not None     # not sent home
    assert len(rig.manager.waits) == 2        # two chunks of 1024
    assert [c for c in rig.manager.calls if c[2] == "gradient accumulation chunk"] == [
        (1024, F32, "gradient accumulation chunk")]
    rig.g.land_writes()
    assert torch.equal(state.grad_store.data, earlier)


def test_home_gradient_pieces_and_the_one_chunk_buffer() -> None:
    unit = _unit(shapes=((2100,),))
    rig = _Rig([unit], home="disk", max_trainable=1)
    state = rig.states[0]
    values = torch.arange(3072, dtype=F32)
    state.grad_store.data.copy_(values)
    pieces = [(start, part.clone()) for start, part in rig.g.home_gradient(state)]
    assert [(s, p.numel()) for s, p in pieces] == [(0, 1024), (1024, 1024), (2048, 1024)]
    assert torch.equal(torch.cat([p for _, p in pieces]), values)
    assert rig.g.chunk_buffer() is rig.g.chunk_buffer()
    assert [c[2] for c in rig.manager.calls].count("gradient accumulation chunk") == 1
    resident = _Rig([_unit()])
    rs = resident.states[0]
    rs.grad_store.tensor[:1024] = 3.0
    [(start, part)] = list(resident.g.home_gradient(rs))
    assert start == 0 and part.numel() == 1024
    assert part.data_ptr() == rs.grad_store.tensor.data_ptr()
    assert "gradient accumulation chunk" not in [c[2] for c in resident.manager.calls]


def test_a_shard_past_the_trainable_part_writes_nothing() -> None:
    rig = _Rig([_unit()], home="disk", shards=[(1024, 1024)])
    state = rig.states[0]
    assert state.numel == 0
    state.grad.collect_into(torch.zeros(0), None)
    assert rig.g.finish(state).numel() == 0
    rig.g.land_writes()
    assert rig.manager.waits == [] and state.grad.buffer is not None


def test_drop_cycle_forgets_every_gradient_and_counts_the_units_that_had_some() -> None:
    room = _Room()
    rig = _Rig([_unit(0), _unit(1), _unit(2), _unit(3)], home="host", holds_grads=True, room=room)
    a, b, c, d = rig.states
    rig.grad(a, 0, torch.ones(3, 5))                  # in its resident home
    rig.speculated = {1}
    rig.grad(b, 1, torch.ones(7))                     # held
    c.keep_gradient()                                 # an earlier micro-step's
    d.grad_store.tensor.fill_(7.0)                    # untouched: left as it is
    rig.g.sq_norm = 3.0
    a.keep_gradient()
    a.count_norm()
    assert rig.g.drop_cycle() == 3
    assert rig.g.sq_norm == 0.0
    assert float(a.grad_store.tensor.abs().sum()) == 0.0
    assert (d.grad_store.tensor == 7.0).all()
    for s in (a, b, c):
        assert not s.arrived and s.grad.seen == 0 and not s.has_grads and not s.norm_counted
        assert s.grad.parts is None and s.grad.held_bytes == 0
    assert 28 in room.given
    assert rig.g.drop_cycle() == 0


def test_drop_cycle_gives_a_buffer_slot_back() -> None:
    rig = _Rig([_unit()], home="disk")
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))
    assert rig.pool.available == 1
    assert rig.g.drop_cycle() == 1
    assert rig.pool.available == 2 and state.grad.buffer is None and state.grad.written is None
    assert float(state.grad_store.data.abs().sum()) == 0.0


def test_reduce_is_a_no_op_with_one_rank() -> None:
    rig = _Rig([_unit()], home="disk")
    state = rig.states[0]
    rig.grad(state, 1, torch.ones(7))
    buffer = state.grad.buffer
    rig.g.reduce(state)
    assert state.grad.buffer is buffer and state.grad.written == {16}   # gaps not yet zeroed


def test_reduce_all_reduces_the_trainable_range_at_stage_0() -> None:
    other = torch.randn(1024)
    comm = _TwoRanks(0, other, [False, True])
    unit = _unit(index=4)
    rig = _Rig([unit], home="host", comm=comm)
    state = rig.states[0]
    g0 = torch.randn(3, 5)
    rig.grad(state, 0, g0)
    assert state.grad.buffer is not None       # several ranks: never into the home
    rig.g.reduce(state)
    assert torch.allclose(state.grad.buffer.double(), (_flat(unit, g0) + other.double()) / 2,
                          rtol=0, atol=1e-6)
    assert state.arrived == {0, 16}
    assert comm.calls == [("all_reduce", 1024, 4), ("any_mask", [True, False])]
    stored = state.grad_store.tensor[:1024].clone()
    grads = rig.g.finish(state)          # added to the own home
    assert torch.equal(grads, stored + state.grad.buffer)


def test_reduce_scatters_the_own_shard_to_the_front_of_the_buffer() -> None:
    other = torch.randn(4096)
    comm = _TwoRanks(1, other, [True, False])
    unit = _unit(index=2, shapes=((40, 50), (900,)), comm=comm, shards=2)
    rig = _Rig([unit], home="disk", comm=comm, scatter=True, shards=[(2048, 3072)])
    state = rig.states[0]
    g1 = torch.randn(900)
    rig.grad(state, 1, g1)
    assert state.grad.buffer.numel() == 4096
    rig.g.reduce(state)
    whole = torch.zeros(4096, dtype=torch.float64)
    whole[2000:2900] = g1.double()
    want = ((whole + other.double()) / 2)[2048:3072]
    assert state.grad.buffer.numel() == 1024
    assert torch.allclose(state.grad.buffer.double(), want, rtol=0, atol=1e-6)
    assert state.arrived == {0, 2000}
    assert comm.calls == [("reduce_scatter", 4096, 2), ("any_mask", [False, True])]
    gradient = rig.g.take(state)
    assert gradient.origin == 2048 and gradient.values.numel() == 1024


def test_land_writes_gives_the_slot_back_when_the_write_failed() -> None:
    rig = _Rig([_unit()], home="disk")
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))
    rig.g.zero_unwritten(state)

    class _Failed:
        def wait(self, timeout=None):
            raise OSError("disk gone")
    state.grad_store.store_async = lambda *a, **k: _Failed()
    rig.g.finish(state)
    assert rig.pool.available == 1
    with pytest.raises(OSError, match="disk gone"):
        rig.g.land_writes()
    assert rig.pool.available == 2
    rig.g.land_writes()                     # gone from the list: nothing left to wait for
    assert len(rig.manager.waits) == 1


def test_drop_buffer_gives_back_slot_and_held_bytes() -> None:
    room = _Room()
    rig = _Rig([_unit(0), _unit(1)], home=None, early_step=True, holds_grads=True, room=room)
    held, buffered = rig.states
    rig.grad(held, 1, torch.ones(7))
    rig.g.drop_buffer(held)
    assert room.given == [28] and held.grad.held_bytes == 0 and held.grad.parts is None
    rig.g.holds_grads = False
    rig.grad(buffered, 1, torch.ones(7))
    assert rig.pool.available == 1
    rig.g.drop_buffer(buffered)
    assert rig.pool.available == 2 and buffered.grad.slot is None
    assert buffered.grad.buffer is None and buffered.grad.written is None


def test_take_arrived_hands_the_parameters_over_once() -> None:
    rig = _Rig([_unit()])
    state = rig.states[0]
    rig.grad(state, 1, torch.ones(7))
    arrived = rig.g.take_arrived(state)
    assert arrived == frozenset({16}) and isinstance(arrived, frozenset)
    assert state.arrived == set() and rig.g.take_arrived(state) == frozenset()


def test_take_moves_held_parts_or_the_buffer_into_a_complete_gradient() -> None:
    room = _Room()
    rig = _Rig([_unit(0), _unit(1)], home=None, early_step=True, holds_grads=True, room=room)
    held, buffered = rig.states
    rig.grad(held, 0, torch.ones(3, 5))
    parts = held.grad.parts
    gradient = rig.g.take(held)
    assert gradient.values is parts and gradient.held_bytes == 60 and gradient.slot is None
    assert gradient.room is room and gradient.pool is rig.pool and gradient.origin == 0
    assert held.grad.parts is None and held.grad.held_bytes == 0 and held.grad.seen == 0
    rig.g.holds_grads = False
    rig.grad(buffered, 0, torch.ones(3, 5))
    slot, buffer = buffered.grad.slot, buffered.grad.buffer
    gradient = rig.g.take(buffered)
    assert gradient.values is buffer and gradient.slot is slot and gradient.held_bytes == 0
    assert (buffered.grad.buffer, buffered.grad.slot, buffered.grad.written) == (None, None, None)
    assert buffered.grad.seen == 0
    assert rig.pool.available == 1          # the gradient holds the slot now
    gradient.give_back()
    assert rig.pool.available == 2
    values = torch.ones(4)
    assert rig.g.take(buffered, values).values is values
    assert rig.g.take(buffered).values == {}           # nothing collected


def test_gradient_time_is_added_to_the_timers_and_bounded_by_the_wall_time() -> None:
    """Each gradient's handling time is added to ``grad_s`` (held or copied alike): more than
    what was there, less than that plus the wall time around the calls."""
    for kwargs in (dict(home=None, early_step=True, holds_grads=True), dict(home="disk")):
        rig = _Rig([_unit()], **kwargs)
        state = rig.states[0]
        rig.timers.grad_s = 100.0
        t0 = time.perf_counter()
        rig.grad(state, 0, torch.ones(3, 5))
        rig.grad(state, 1, torch.ones(7))
        wall = time.perf_counter() - t0
        assert 100.0 < rig.timers.grad_s <= 100.0 + wall, kwargs


def test_a_strided_gradient_is_held_contiguous() -> None:
    """autograd may hand a 1-D float32 gradient with a stride (a view): the held part is a
    contiguous copy, as the Adam kernel reads it flat."""
    rig = _Rig([_unit()], home=None, early_step=True, holds_grads=True)
    state = rig.states[0]
    base = torch.randn(14)
    rig.grad(state, 1, base[::2])
    part = state.grad.parts[16]
    assert part.is_contiguous() and torch.equal(part, base[::2])


def test_the_boundary_norm_sums_every_unit() -> None:
    rig = _Rig([_unit(0), _unit(1)], home="disk")
    a, b = rig.states
    g0, g1 = torch.randn(3, 5), torch.randn(7)
    rig.grad(a, 0, g0)
    rig.grad(b, 1, g1)
    for s in (a, b):
        rig.g.zero_unwritten(s)
        rig.g.finish(s)
    want = float((g0.double() ** 2).sum() + (g1.double() ** 2).sum())
    assert rig.g.sq_norm == pytest.approx(want, rel=1e-12)


def test_home_gradient_reads_a_short_last_chunk() -> None:
    """A unit larger than the chunk (over 8 MiB in the engine; here a 2048-element chunk and a
    3072-element unit) is read in full chunks and a short last one, never past its end."""
    unit = _unit(shapes=((2100,),))
    rig = _Rig([unit], home="disk", max_trainable=2048)
    state = rig.states[0]
    values = torch.arange(3072, dtype=F32)
    state.grad_store.data.copy_(values)
    pieces = [(start, part.clone()) for start, part in rig.g.home_gradient(state)]
    assert [(s, p.numel()) for s, p in pieces] == [(0, 2048), (2048, 1024)]
    assert torch.equal(torch.cat([p for _, p in pieces]), values)


def test_a_slot_given_back_is_the_next_units_buffer() -> None:
    rig = _Rig([_unit(0), _unit(1)], home="disk", slots=1)
    a, b = rig.states
    rig.grad(a, 0, torch.ones(3, 5))
    slot = a.grad.slot
    rig.g.drop_buffer(a)
    rig.grad(b, 0, torch.ones(3, 5))
    assert b.grad.slot is slot and rig.manager.calls == [(1024 * 4, torch.uint8, "gradient slot 0")]


def test_the_scattered_shard_is_float32_whatever_the_default_dtype() -> None:
    """A user's ``torch.set_default_dtype(torch.float64)`` must not make the reduce-scatter's
    output a float64 tensor against the float32 gradient."""
    other = torch.randn(4096)
    comm = _TwoRanks(0, other, [True, True])
    unit = _unit(shapes=((40, 50), (900,)), comm=comm, shards=2)
    rig = _Rig([unit], home="disk", comm=comm, scatter=True, shards=[(0, 2048)])
    state = rig.states[0]
    g0 = torch.randn(40, 50)
    rig.grad(state, 0, g0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        rig.g.reduce(state)
    finally:
        torch.set_default_dtype(default)
    whole = torch.zeros(4096, dtype=torch.float64)
    whole[:2000] = g0.double().reshape(-1)
    assert state.grad.buffer.dtype == F32
    assert torch.allclose(state.grad.buffer.double(), ((whole + other.double()) / 2)[:2048],
                          rtol=0, atol=1e-6)


def _late_rig(home: str, **kwargs) -> tuple[_Rig, LateCopies, threading.Event]:
    """A rig whose copies to the host land late, behind a gate the test opens."""
    rig = _Rig([_unit()], home=home, **kwargs)
    copies, gate = LateCopies(seed=2), threading.Event()
    copies._jobs.put(gate.wait)
    rig.manager.copies = rig.g.copies = rig.pool._copies = copies
    return rig, copies, gate


@pytest.mark.parametrize("home", ["disk", "host"])
def test_a_unit_s_gradient_is_read_only_after_its_copies_to_the_host(home: str) -> None:
    """Copied into a fresh slot (disk home) or added into the resident home: nothing lands
    before the gate opens, and finish reads the complete gradient, after the wait."""
    rig, copies, gate = _late_rig(home)
    state = rig.states[0]
    g0, g1 = torch.randn(3, 5), torch.randn(7)
    rig.grad(state, 0, g0)
    rig.grad(state, 1, g1)
    rig.grad(state, 1, g1)                   # a second gradient of one parameter: added
    assert len(state.grad.copies) == 3 and copies.to_host_copies == 3
    _training_thread_must_not_wait(copies, gate)
    rig.g.zero_unwritten(state)      # only what no copy writes: nothing to wait for
    assert len(state.grad.copies) == 3 and not any(e.done() for e in state.grad.copies)
    gate.set()
    grads = rig.g.finish(state, write_home=False)
    assert state.grad.copies == []
    assert torch.equal(grads.double(), _flat(state.unit, g0, 2 * g1))
    rig.g.drop_buffer(state)
    assert copies.poisoned == copies.lost == 0


def test_a_slot_goes_back_only_after_its_copies_to_the_host() -> None:
    rig, copies, gate = _late_rig("disk")
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))
    waits = copies.host_waits

    def open_then_wait(events) -> None:        # the copy can land only once someone waits
        gate.set()
        waits(events)
    copies.host_waits = open_then_wait
    rig.g.drop_cycle()                        # waits for the copy, then gives the slot back
    assert copies.poisoned == copies.lost == 0 and rig.pool.available == 2


def test_a_wait_cut_short_leaves_the_copies_to_the_next_one() -> None:
    """A wait for a unit's copies that is cut short (Ctrl-C between two events, a device
    error) loses none of them: the backward's error path (drop_buffer) still waits for every
    copy before the slot goes back, so no copy lands in the slot's next user's bytes."""
    rig, copies, gate = _late_rig("disk")
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))
    rig.grad(state, 1, torch.ones(7))
    waits, calls = copies.host_waits, []

    def interrupted_then_open(events) -> None:
        calls.append(len(list(events)))
        if len(calls) == 1:
            raise KeyboardInterrupt           # before any copy landed (the gate is shut)
        gate.set()                           # the copies land only once someone waits
        waits(events)
    copies.host_waits = interrupted_then_open
    with pytest.raises(KeyboardInterrupt):
        rig.g.finish(state, write_home=False)
    rig.g.drop_buffer(state)                 # the backward raised: its gradient is dropped
    poisoned = copies.poisoned               # the slot given back under a copy: poisoned
    gate.set()
    copies.drain()
    assert calls == [2, 2] and state.grad.copies == []
    assert poisoned == copies.poisoned == copies.lost == 0 and rig.pool.available == 2


def test_a_gradient_read_before_its_copies_to_the_host_is_wrong(monkeypatch) -> None:
    """The planted fault: without the wait the reader sees the NaN the copy has not replaced."""
    rig, copies, gate = _late_rig("disk")
    monkeypatch.setattr(GradientCollector, "copies_landed", lambda self, state: None)
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))
    rig.g.zero_unwritten(state)
    grads = rig.g.finish(state, write_home=False)
    assert torch.isnan(grads[:15]).all()
    gate.set()
    copies.drain()


def _training_thread_must_not_wait(copies: LateCopies, gate: threading.Event):
    """Make a wait for a copy the gate still holds raise instead of hanging (the training
    thread blocked); a wait once the gate is open goes through. Returns the real
    ``host_waits``."""
    waits = copies.host_waits

    def refuse(events) -> None:
        events = list(events)
        if not gate.is_set() and not all(e.done() for e in events):
            raise AssertionError(f"waited for {len(events)} copies still landing")
        waits(events)
    copies.host_waits = refuse
    return waits


def test_take_hands_the_copies_still_landing_over_with_the_gradient() -> None:
    """The early step's take (after zero_unwritten, as the optimizer calls them) does not
    wait: the gradient leaves with the events of its copies, which the step waits for
    (``landed``) before reading it, and ``give_back`` before the slot goes back."""
    rig, copies, gate = _late_rig(None, early_step=True)
    state = rig.states[0]
    g0, g1 = torch.randn(3, 5), torch.randn(7)
    rig.grad(state, 0, g0)
    rig.grad(state, 1, g1)
    rig.grad(state, 1, g1)                   # added at the wait, on the waiting thread
    events = list(state.grad.copies)
    _training_thread_must_not_wait(copies, gate)
    rig.g.zero_unwritten(state)
    gradient = rig.g.take(state)
    assert gradient.landing == events and gradient.copies is copies
    assert state.grad.copies == [] and not any(e.done() for e in events)
    values = gradient.values
    assert torch.isnan(values[:15]).all()    # still landing: a read now would see NaN
    assert values[15] == 0 and not values[23:].any()   # the gaps zeroed all the same
    assert rig.pool.available == 1           # the gradient holds the slot
    gate.set()
    gradient.landed()
    assert gradient.landing == [] and all(e.done() for e in events)
    assert torch.equal(values.double(), _flat(state.unit, g0, 2 * g1))
    gradient.give_back()
    assert rig.pool.available == 2 and copies.poisoned == copies.lost == 0


def test_a_gradient_given_back_waits_for_its_copies_before_the_slot() -> None:
    """A step that never read its gradient (it failed first) still waits for the copies
    before the slot goes back: the next unit's buffer is not written by a late copy."""
    rig, copies, gate = _late_rig(None, early_step=True)
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(3, 5))
    gradient = rig.g.take(state)
    waits = copies.host_waits

    def open_then_wait(events) -> None:      # the copy can land only once someone waits
        gate.set()
        waits(events)
    copies.host_waits = open_then_wait
    gradient.give_back()
    assert gate.is_set() and copies.poisoned == copies.lost == 0 and rig.pool.available == 2


def test_a_gradient_on_another_device_is_never_held() -> None:
    rig = _Rig([_unit()], home=None, early_step=True, holds_grads=True)
    state = rig.states[0]
    with pytest.raises(RuntimeError, match="meta would be held"):
        rig.grad(state, 0, torch.ones(3, 5, device="meta"))


def test_the_norm_the_training_thread_waits_for_is_summed_on_torch_s_threads(
        monkeypatch) -> None:
    """The deferred step's norm (``finish`` at the boundary, and the step's sum over the
    homes) is waited for by the training thread before any step: it takes torch's threads
    (the same bits: inf_grad_sq_sum sums chunks in order whatever the count)."""
    calls = []
    real = N.grad_sq_sum

    def recording(ptr, numel, dtype, threads):
        calls.append(threads)
        return real(ptr, numel, dtype, threads)
    monkeypatch.setattr(N, "grad_sq_sum", recording)
    rig = _Rig([_unit()], home="disk")
    state = rig.states[0]
    rig.g.begin_backward(True)
    rig.grad(state, 0, torch.randn(3, 5))
    rig.g.zero_unwritten(state)
    rig.g.finish(state)
    rig.g.land_writes()
    assert calls == [torch.get_num_threads()]
    values = torch.randn(300_000)
    assert sum_of_squares(values, threads=2) == sum_of_squares(values)


def test_at_most_two_units_copies_into_their_homes_are_in_flight() -> None:
    """Each add into a resident home holds its gradient's staging until it is made: a third
    unit's finish waits for the oldest unit's copies (the first), not for its own or the
    second's; the home of the first then holds its add."""
    from infinity.optim.gradients import HOME_COPIES_IN_FLIGHT
    rig = _Rig([_unit(0), _unit(1), _unit(2)])
    copies, gate = LateCopies(seed=2), threading.Event()
    copies._jobs.put(gate.wait)
    rig.manager.copies = rig.g.copies = rig.pool._copies = copies
    waits, waited = copies.host_waits, []

    def open_then_wait(events) -> None:
        events = list(events)
        waited.append(len(events))
        gate.set()
        waits(events)
    copies.host_waits = open_then_wait
    g0 = torch.randn(3, 5)
    for state in rig.states[:HOME_COPIES_IN_FLIGHT]:
        rig.grad(state, 0, g0)
        rig.g.finish(state)
    assert waited == [] and list(rig.g._home_copies) == [0, 1]
    third = rig.states[2]
    rig.grad(third, 0, g0)
    rig.g.finish(third)
    assert waited == [1] and list(rig.g._home_copies) == [1, 2]
    assert torch.equal(rig.states[0].grad_store.tensor[:15], g0.reshape(-1))
    rig.g.home_copies_landed()
    copies.drain()
