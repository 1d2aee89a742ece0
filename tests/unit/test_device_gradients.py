"""Gradients reduced on the device with several ranks (optim/device_gradients.py, [Note:
gradients reduced on the device]; optim/gradients.py ``GradientCollector``): the path a GPU
takes, forced on the CPU device (``reduces_on_device`` patched, as the activation swapper's
tests force a GPU's copies), with two ranks' collectives computed in process (test_gradients'
``_TwoRanks``) and copies that land late behind a gate the test opens (``LateCopies``).

What is checked: the own shard that reaches the host buffer is bit for bit what the host path
leaves there (the same fp32 sums: copy first, add a second gradient, zero the gaps, the same
collective on the same values), only the shard is copied to the host, the shard is read only
after its copy's event, and a device buffer is written again only after the copy out of its
last shard (the two planted faults fail these deterministically: the gate holds every copy
until the test opens it)."""
from __future__ import annotations

import threading

import pytest
import torch
from fakes import WaitingManager
from test_gradients import _flat, _Rig, _TwoRanks, _unit

from infinity.base.budget import BudgetExceededError, MemoryBudget
from infinity.optim import device_gradients
from infinity.optim.device_gradients import DeviceGradientPool, reduces_on_device
from infinity.planner.engine_sizes import DEVICE_GRAD_BUFFERS
from infinity.storage.transfers import ImmediateCopies, LateCopies

F32 = torch.float32
SHAPES = ((40, 50), (900,))       # p0 at [0, 2000), p1 at [2000, 2900): flat 4096, trainable 3072


class _DeviceManager(WaitingManager):
    """A WaitingManager with a device budget; device buffers are CPU tensors filled with NaN
    (a reused buffer holds old bytes)."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.device_budget = MemoryBudget("device", limit)
        self.device_made: list[str] = []

    def device_empty(self, numel: int, dtype: torch.dtype, device: torch.device,
                     what: str) -> torch.Tensor:
        self.device_budget.reserve(numel * dtype.itemsize, what)
        self.device_made.append(what)
        return torch.full((numel,), float("nan"), dtype=dtype, device=device)


@pytest.fixture
def forced(monkeypatch):
    """The device path on the CPU device."""
    monkeypatch.setattr(device_gradients, "reduces_on_device", lambda device: True)


def _units(count: int, comm) -> list:
    return [_unit(i, SHAPES, comm=comm, shards=2) for i in range(count)]


def _shard(rank: int) -> tuple[int, int]:
    return (0, 2048) if rank == 0 else (2048, 3072)


def _rig(units, comm, *, scatter: bool, rank: int, **kwargs) -> _Rig:
    shards = [_shard(rank)] * len(units) if scatter else None
    return _Rig(units, home="disk", comm=comm, scatter=scatter, shards=shards,
                manager=_DeviceManager(kwargs.pop("limit", None)), **kwargs)


def _late(rig: _Rig) -> tuple[LateCopies, threading.Event]:
    """Every copy of the rig lands late, behind a gate the test opens."""
    copies, gate = LateCopies(seed=3), threading.Event()
    copies._jobs.put(gate.wait)
    rig.manager.copies = rig.g.copies = rig.pool._copies = copies
    rig.g.device_pool.copies = copies
    return copies, gate


def _grads(seed: int, dtype=F32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*s, generator=gen) * 3).to(dtype)
                 for s in ((40, 50), (900,), (900,)))


def _feed(rig: _Rig, state, grads) -> None:
    """p0's gradient, then p1's twice (a tied use: added)."""
    g0, g1, g1b = grads
    rig.grad(state, 0, g0)
    rig.grad(state, 1, g1)
    rig.grad(state, 1, g1b)


def test_only_a_cpu_device_keeps_the_host_path() -> None:
    assert not reduces_on_device(torch.device("cpu"))
    assert reduces_on_device(torch.device("cuda", 0))
    assert DEVICE_GRAD_BUFFERS == 2


def test_the_host_path_stays_on_a_cpu_device() -> None:
    comm = _TwoRanks(0, torch.zeros(4096), [True, True])
    rig = _rig(_units(1, comm), comm, scatter=True, rank=0)
    assert rig.g.device_pool is None
    rig.grad(rig.states[0], 0, torch.ones(40, 50))
    assert rig.states[0].grad.device is None and rig.states[0].grad.buffer.numel() == 4096


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("scatter", [True, False])
def test_the_shard_reduced_on_the_device_is_the_host_path_s_bit_for_bit(
        monkeypatch, scatter: bool, rank: int, dtype) -> None:
    """The same fp32 sums in the same order: the own shard equals the host path's bit for bit
    (stage 0: the whole trainable range), and only it is copied to the host."""
    other = torch.randn(4096, generator=torch.Generator().manual_seed(9))
    grads = _grads(rank, dtype)
    results = []
    for device_path in (False, True):
        monkeypatch.setattr(device_gradients, "reduces_on_device", lambda d: device_path)
        comm = _TwoRanks(rank, other, [True, False])
        rig = _rig(_units(1, comm), comm, scatter=scatter, rank=rank)
        assert (rig.g.device_pool is not None) == device_path
        state = rig.states[0]
        counted = []
        to_host = rig.g.copies.to_host
        rig.g.copies.to_host = lambda dst, src, **kwargs: (
            counted.append(src.numel()), to_host(dst, src, **kwargs))[1]
        _feed(rig, state, grads)
        rig.g.zero_unwritten(state)
        rig.g.reduce(state)
        grads_out = rig.g.finish(state, write_home=False).clone()
        results.append(grads_out)
        if device_path:
            # one copy of the own range: 1024 (or 2048) elements of the 4096 the host path moved
            assert counted == [state.numel] and state.grad.device is None
            assert rig.manager.device_made == ["u0 gradient (device gradient buffer)"]
            assert rig.g.device_pool.numel == (4096 + 2048 if scatter else 3072)
        else:
            assert counted == [2000, 900, 900]
        assert state.arrived == {0, 2000} and comm.calls[-1][0] == "any_mask"
    host, device = results
    assert host.numel() == device.numel() == (_shard(rank)[1] - _shard(rank)[0]
                                              if scatter else 3072)
    assert torch.equal(host.view(torch.int32), device.view(torch.int32))   # bits, NaN-free
    g0, g1, g1b = (g.to(F32) for g in grads)
    whole = torch.zeros(4096, dtype=torch.float64)
    whole[:3072] = _flat(_unit(0, SHAPES), g0, g1 + g1b)
    want = ((whole + other.double()) / 2)
    want = want[_shard(rank)[0]:_shard(rank)[1]] if scatter else want[:3072]
    assert torch.allclose(device.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("scatter", [True, False])
def test_the_shard_is_read_only_after_its_copy_s_event(forced, scatter: bool) -> None:
    """The reduce does not wait for the copy out (the training thread goes on); its event is
    the unit's, and finish (the deferred step's reader) and the early step's gradient wait
    for it. Planted fault (the event not kept): finish reads the NaN the copy has not
    replaced."""
    other = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    comm = _TwoRanks(1, other, [True, True])
    rig = _rig(_units(2, comm), comm, scatter=scatter, rank=1)
    copies, gate = _late(rig)
    a, b = rig.states
    for state in (a, b):
        _feed(rig, state, _grads(7))
        rig.g.reduce(state)           # no wait: the gate is shut and this returns
    assert len(a.grad.copies) == 1 and not a.grad.copies[0].done()
    waits = copies.host_waits

    def open_then_wait(events) -> None:
        gate.set()
        waits(events)
    copies.host_waits = open_then_wait
    got = rig.g.finish(a, write_home=False)
    assert not torch.isnan(got).any()
    gradient = rig.g.take(b)          # the early step: the events go with the gradient
    assert len(gradient.landing) == 1
    gradient.landed()
    assert torch.equal(gradient.values, got)       # the same gradients, the same mean
    copies.drain()
    assert copies.poisoned == copies.lost == 0


@pytest.mark.parametrize("scatter", [True, False])
def test_a_device_buffer_is_written_again_only_after_its_copy_out(forced, scatter: bool) -> None:
    """One kept buffer: unit b takes the buffer unit a's shard is still being copied out of.
    Scattered, the copy reads the shard at the buffer's back: b's gradients fill the front
    without waiting (its backward overlaps the copy) and its reduce waits for the copy's
    event; at stage 0 the copy reads the front and b's first gradient waits (the gate opens
    only when someone waits). Planted faults (no wait before the reduce, or before the first
    gradient at stage 0): b's reduce or gradients overwrite the buffer under a's copy, and a's
    host shard gets b's values."""
    other = torch.randn(4096, generator=torch.Generator().manual_seed(5))
    comm = _TwoRanks(0, other, [True, True])
    rig = _rig(_units(2, comm), comm, scatter=scatter, rank=0, device_buffers=1)
    copies, gate = _late(rig)
    a, b = rig.states
    waited = []

    def open_then_wait(event) -> None:
        waited.append(event)
        gate.set()
        event.wait()
    copies.compute_waits = open_then_wait
    _feed(rig, a, _grads(1))
    rig.g.reduce(a)
    landing = a.grad.copies[0]
    assert not landing.done() and waited == []
    _feed(rig, b, _grads(2))          # the only buffer
    assert waited == ([] if scatter else [landing])
    rig.g.reduce(b)                   # after a's copy out
    assert waited == [landing]
    gate.set()
    got_a = rig.g.finish(a, write_home=False)
    got_b = rig.g.finish(b, write_home=False)
    reference = _rig(_units(2, comm), comm, scatter=scatter, rank=0)   # immediate copies
    want = []
    for state, seed in zip(reference.states, (1, 2)):
        _feed(reference, state, _grads(seed))
        reference.g.reduce(state)
        want.append(reference.g.finish(state, write_home=False))
    assert torch.equal(got_a, want[0]) and torch.equal(got_b, want[1])
    assert waited == [landing]
    assert rig.manager.device_made == ["u0 gradient (device gradient buffer)"]
    copies.drain()
    assert copies.poisoned == copies.lost == 0


def test_a_second_kept_buffer_is_made_rather_than_waiting(forced) -> None:
    """Two kept buffers: unit b's gradients arrive while unit a's shard is copied out of the
    other buffer (no wait, no compute blocked); unit c takes the oldest buffer, its gradients
    filling the front while a's shard is copied out of the back, and its reduce waits for
    that copy."""
    comm = _TwoRanks(0, torch.zeros(4096), [True, True])
    rig = _rig(_units(3, comm), comm, scatter=True, rank=0)
    copies, gate = _late(rig)
    waited = []
    real = copies.compute_waits
    copies.compute_waits = lambda event: (waited.append(event), gate.set(), real(event))
    a, b, c = rig.states
    _feed(rig, a, _grads(1))
    rig.g.reduce(a)
    first = a.grad.copies[0]
    _feed(rig, b, _grads(2))
    assert waited == [] and len(rig.manager.device_made) == 2
    rig.g.reduce(b)
    _feed(rig, c, _grads(3))
    assert waited == [] and len(rig.manager.device_made) == 2
    rig.g.reduce(c)
    assert waited == [first] and len(rig.manager.device_made) == 2
    gate.set()
    for state in (a, b, c):
        rig.g.drop_buffer(state)
    copies.drain()


def test_a_third_incomplete_unit_gets_a_buffer_beyond_the_pool_in_the_budget(forced) -> None:
    """A tied weight keeps a unit incomplete: with both kept buffers collecting, a third unit
    gets one more, inside the device budget, given back (and its bytes) at its reduce; where
    the budget has no room the error says how much is missing and what to do."""
    comm = _TwoRanks(0, torch.zeros(4096), [True, True])
    nbytes = (4096 + 2048) * 4
    rig = _rig(_units(3, comm), comm, scatter=True, rank=0, limit=3 * nbytes)
    a, b, c = rig.states
    for state in (a, b, c):
        rig.grad(state, 0, torch.ones(40, 50))
    pool = rig.g.device_pool
    assert (pool.made, pool.extra) == (2, 1)
    assert rig.manager.device_budget.held == 3 * nbytes
    rig.g.reduce(c)
    assert (pool.made, pool.extra) == (2, 0) and rig.manager.device_budget.held == 2 * nbytes
    tight = _rig(_units(3, comm), comm, scatter=True, rank=0, limit=2 * nbytes)
    for state in tight.states[:2]:
        tight.grad(state, 0, torch.ones(40, 50))
    with pytest.raises(BudgetExceededError, match=r"u2 gradient.*all 2 kept ones.*"
                       r"device_memory_budget by 24\.00 KiB"):
        tight.grad(tight.states[2], 0, torch.ones(40, 50))
    rig.g.close()
    assert rig.manager.device_budget.held == 0


def test_a_failed_backward_gives_the_device_buffer_back(forced) -> None:
    comm = _TwoRanks(0, torch.zeros(4096), [True, True])
    rig = _rig(_units(1, comm), comm, scatter=True, rank=0, device_buffers=1)
    state = rig.states[0]
    rig.grad(state, 0, torch.ones(40, 50))
    buffer = state.grad.device
    assert rig.g.drop_cycle() == 1
    assert state.grad.device is None and state.grad.written is None
    rig.grad(state, 1, torch.ones(900))
    assert state.grad.device is buffer       # the pool's one buffer, taken again
    assert torch.equal(state.grad.device.values[2000:2900], torch.ones(900))


def test_the_pool_refuses_a_gradient_larger_than_its_buffers() -> None:
    pool = DeviceGradientPool(_DeviceManager(), ImmediateCopies(), 100)
    with pytest.raises(ValueError, match="80 \\+ 40 elements"):
        pool.acquire(80, 40, what="u9 gradient")
    with pytest.raises(ValueError, match="count must be >= 1"):
        DeviceGradientPool(_DeviceManager(), ImmediateCopies(), 100, count=0)


class _RecordedWaits(ImmediateCopies):
    """Immediate copies that record each event compute is made to wait for."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def compute_waits(self, event) -> None:
        self.waited.append(event)


class _Pending:
    """A copy out still running (never done)."""

    def done(self) -> bool:
        return False


def test_a_copy_out_no_reduce_waited_for_is_waited_for_by_the_next_taker() -> None:
    """A unit takes the buffer a shard is still being copied out of (its front: no wait), and
    its backward fails before the reduce: the buffer goes back with no copy of its own, and
    the copy from before is still what the next taker's reduce waits for; a copy out of the
    front (stage 0's values) makes the next first gradient wait. Planted fault (the pending
    copy forgotten at the release): the third reduce writes under a running copy."""
    copies = _RecordedWaits()
    pool = DeviceGradientPool(_DeviceManager(), copies, 100, count=1)
    first = pool.acquire(60, 20, what="u0 gradient")
    assert first.shard.storage_offset() - first.tensor.storage_offset() == 80   # at the back
    running = _Pending()
    pool.release(first, running, first.shard[:15])
    failed = pool.acquire(60, 20, what="u1 gradient")
    assert copies.waited == []                  # the front is not what the copy reads
    pool.release(failed, None)                  # a backward that failed before its reduce
    third = pool.acquire(70, 20, what="u2 gradient")
    assert copies.waited == []
    pool.before_reduce(third)
    assert copies.waited == [running]
    front = _Pending()
    pool.release(third, front, third.values[:50])
    pool.acquire(10, 0, what="u3 gradient")     # stage 0: the copy read the front
    assert copies.waited == [running, front]
    with pytest.raises(ValueError, match="not a view of the buffer's 100"):
        pool.release(third, _Pending(), torch.zeros(5))
