"""The copies' owner (storage/transfers.py) on a machine without CUDA: the immediate copies'
device-to-host copy and add are today's bits (storage/host_adds.py ``add_widened`` among them, the widening add in
chunks), and the late copies' device-to-host copies land only on the helper thread, behind a
gate the tests hold shut: until a reader waits (``host_waits``) a copied destination reads NaN
and an added one lacks the add, and a pool buffer given back while a copy still writes it is
poisoned and the copy lost. (The CUDA streams: tests/gpu/test_cuda_copies.py.)"""
from __future__ import annotations

import threading

import pytest
import torch
from fakes import RecordingManager
from torch.overrides import TorchFunctionMode

from infinity.storage import _add_native, transfers
from infinity.storage.buffer_pool import BufferPool
from infinity.storage import host_adds
from infinity.storage.host_adds import add_widened
from infinity.storage.transfers import (
    ImmediateCopies,
    LateCopies,
    device_copies,
)

F32 = torch.float32


class _AddCalls(TorchFunctionMode):
    """Records the shape of what each ``Tensor.add_`` adds."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.add_:
            self.shapes.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, transpose", [((6, 3), False), ((3, 6), True), ((20,), False)])
def testadd_widened_is_bit_for_bit_torch_add_of_the_float32_gradient(monkeypatch, dtype, shape,
                                                                      transpose) -> None:
    monkeypatch.setattr(host_adds, "ADD_CHUNK_NUMEL", 7)
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(shape, generator=gen).to(dtype)
    if transpose:
        grad = grad.t()              # not contiguous: sliced as it is
    target = torch.randn(grad.shape, generator=gen)
    want = target.clone().add_(grad.to(F32))
    add_widened(target, grad)
    assert torch.equal(target, want)


def testadd_widened_slices_a_strided_16_bit_gradient_by_rows_and_adds_others_whole(
        monkeypatch) -> None:
    """The add torch makes (a gradient the native add does not read: strided, or into a 16-bit
    home) goes in slices of about ADD_CHUNK_NUMEL elements (whole rows, at least one) where it
    widens; a 16-bit one into a 16-bit home, a small one or a 0-d one is added at once. A
    contiguous float32 target with a contiguous gradient goes to the native add: no torch
    add_ at all."""
    monkeypatch.setattr(host_adds, "ADD_CHUNK_NUMEL", 7)
    cases = [
        (torch.zeros(7, 3), torch.ones(3, 7, dtype=torch.bfloat16).t(), [(2, 3), (2, 3), (2, 3), (1, 3)]),
        (torch.zeros(3, 9), torch.ones(9, 3, dtype=torch.float16).t(), [(1, 9), (1, 9), (1, 9)]),
        (torch.zeros(7, 3), torch.ones(7, 3), []),
        (torch.zeros(7, 3), torch.ones(7, 3, dtype=torch.bfloat16), []),
        (torch.zeros(7, 3, dtype=torch.bfloat16), torch.ones(7, 3, dtype=torch.bfloat16), [(7, 3)]),
        (torch.zeros(7), torch.ones(7, 2, dtype=torch.bfloat16)[:, 0], [(7,)]),
        (torch.zeros(8), torch.ones(8, 2, dtype=torch.bfloat16)[:, 0], [(7,), (1,)]),
    ]
    for target, grad, want in cases:
        with _AddCalls() as calls:
            add_widened(target, grad)
        assert calls.shapes == want, (target.dtype, grad.dtype, grad.shape)
        assert torch.equal(target, torch.ones_like(target))
    monkeypatch.setattr(host_adds, "ADD_CHUNK_NUMEL", 0)
    target = torch.zeros(())
    add_widened(target, torch.tensor(2.5, dtype=torch.bfloat16))   # 0-d: nothing to slice
    assert target.item() == 2.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel, offset", [(1, 0), (7, 1), (8, 0), (4099, 3), (300_001, 5)])
def test_the_native_add_is_bit_for_bit_torch_add_of_the_float32_gradient(dtype, numel,
                                                                        offset) -> None:
    """Every element (unaligned starts, tails shorter than a vector, several threads' chunks;
    16-bit subnormals, infinities, signed zeros) has the bits of ``target.add_(grad.float())``:
    the widening is exact and the add is one float32 add either way."""
    gen = torch.Generator().manual_seed(numel)
    grad = (torch.randn(numel + offset, generator=gen) * 4).to(dtype)[offset:]
    specials = torch.tensor([float("inf"), -float("inf"), -0.0, 6e-8, -3e-5, 1e-40],
                            dtype=torch.float32).to(dtype)
    grad[: min(numel, specials.numel())] = specials[: min(numel, specials.numel())]
    target = torch.randn(numel + 2, generator=gen)[1:-1]
    want = target.clone().add_(grad.to(F32))
    _add_native.accumulate(target, grad)
    assert torch.equal(target, want)


def test_the_native_add_refuses_what_it_does_not_read() -> None:
    with pytest.raises(ValueError, match="contiguous float32 CPU target"):
        _add_native.accumulate(torch.zeros(4), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 of its size"):
        _add_native.accumulate(torch.zeros(4), torch.zeros(5))


def _grads(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(6, 4, generator=gen).to(dtype), torch.randn(6, 4, generator=gen).to(dtype),
            torch.randn(6, 4, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_immediate_copies_to_the_host_are_over_at_once_and_today_s_bits(dtype) -> None:
    first, second, _ = _grads(dtype)
    copies = ImmediateCopies()
    dst = torch.full((6, 4), float("nan"))
    events = [copies.to_host(dst, first), copies.to_host(dst, second, add=True)]
    assert all(e.done() for e in events)      # nothing to wait for: no thread, no stream
    want = torch.empty(6, 4)
    want.copy_(first)
    add_widened(want, second)
    assert torch.equal(dst, want)
    copies.host_waits(events)
    assert torch.equal(dst, want)


def _gated(seed: int = 3) -> tuple[LateCopies, threading.Event]:
    """Late copies whose helper thread is held at a gate until the test opens it."""
    copies, gate = LateCopies(seed), threading.Event()
    copies._jobs.put(gate.wait)          # the thread runs queued jobs in order
    return copies, gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_late_copies_to_the_host_land_only_for_a_reader_that_waits(dtype) -> None:
    first, second, home = _grads(dtype)
    copies, gate = _gated()
    fresh, kept = torch.zeros(6, 4), home.clone()
    events = [copies.to_host(fresh, first), copies.to_host(fresh, second, add=True),
              copies.to_host(kept, second, add=True)]
    assert copies.copies == copies.to_host_copies == 3
    assert torch.isnan(fresh).all() and not any(e.done() for e in events)
    assert torch.equal(kept, home)           # an add is made at the wait, not before
    gate.set()
    copies.drain()                           # every copy ran: the adds still wait for a reader
    assert torch.equal(fresh, first.to(F32))     # copied, not yet added to
    assert torch.equal(kept, home) and not events[2].done()
    copies.host_waits(events)
    want_fresh = torch.empty(6, 4)
    want_fresh.copy_(first)
    add_widened(want_fresh, second)
    want_kept = home.clone()
    add_widened(want_kept, second)
    assert torch.equal(fresh, want_fresh) and torch.equal(kept, want_kept)
    assert all(e.done() for e in events) and copies.poisoned == copies.lost == 0


def test_a_pool_buffer_given_back_before_its_copy_to_the_host_is_poisoned_and_the_copy_lost(
        ) -> None:
    manager = RecordingManager()
    copies, gate = _gated()
    manager.copies = copies
    pool = BufferPool(manager, 64, 1, "gradient")
    slot = pool.acquire()
    copies.to_host(slot.buffer.view(F32), torch.ones(16))
    pool.release(slot)                       # no wait for the copy: the planted fault
    again = pool.acquire()
    assert copies.poisoned == 1 and torch.isnan(again.buffer.view(F32)).all()
    again.buffer.view(F32).fill_(7.0)        # the next user's bytes
    gate.set()
    copies.drain()
    assert copies.lost == 1 and torch.equal(again.buffer.view(F32), torch.full((16,), 7.0))


def test_a_pool_buffer_given_back_after_the_wait_is_not_poisoned() -> None:
    manager = RecordingManager()
    copies, gate = _gated()
    manager.copies = copies
    pool = BufferPool(manager, 64, 1, "gradient")
    slot = pool.acquire()
    event = copies.to_host(slot.buffer.view(F32), torch.ones(16))
    gate.set()
    copies.host_waits([event])
    pool.release(slot)
    assert copies.poisoned == copies.lost == 0
    assert torch.equal(pool.acquire().buffer.view(F32), torch.ones(16))


def test_a_step_s_write_ordered_after_the_copy_that_filled_its_memory_lands_after_it() -> None:
    """A step's write of a unit's device copy (``write_device``) issued while the unit's fetch
    copy is still in flight (a step started ahead of the use) lands after that copy when it is
    ordered after it, and reads NaN until then for a reader that does not wait."""
    copies, gate = _gated()
    flat, fetched, stepped = torch.zeros(8), torch.full((8,), 1.0), torch.full((8,), 2.0)
    fill = copies.to_device(flat, fetched)
    write = copies.write_device(flat, stepped, after=fill)
    assert torch.isnan(flat).all() and not write.done()
    gate.set()
    write.wait()
    assert torch.equal(flat, stepped) and copies.overtaking == 0


def test_a_step_s_write_not_ordered_after_a_copy_in_flight_into_its_memory_is_overwritten(
        ) -> None:
    """The planted fault: the write not ordered after the fetch copy still in flight lands
    first (the worst order two streams allow), and the copy leaves the fetched values; a write
    into other memory, or after that copy landed, is not affected."""
    copies, gate = _gated()
    flat, other = torch.zeros(8), torch.zeros(8)
    fetched, stepped = torch.full((8,), 1.0), torch.full((8,), 2.0)
    copies.to_device(flat, fetched)
    copies.write_device(flat, stepped)                 # no ``after``
    elsewhere = copies.write_device(other, stepped)    # nothing in flight into its memory
    gate.set()
    copies.drain()
    elsewhere.wait()
    assert torch.equal(flat, fetched) and copies.overtaking == 1
    assert torch.equal(other, stepped)
    late = copies.write_device(flat, stepped)          # the copy landed: nothing to overtake
    late.wait()
    assert torch.equal(flat, stepped) and copies.overtaking == 1


def test_immediate_copies_write_at_once() -> None:
    flat = torch.zeros(4)
    event = ImmediateCopies().write_device(flat, torch.ones(4), after=transfers.DONE)
    assert event.done() and torch.equal(flat, torch.ones(4))


def test_device_copies_picks_late_copies_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(transfers.LATE_ENV, "4")
    assert isinstance(device_copies(torch.device("cpu")), LateCopies)
    monkeypatch.setenv(transfers.LATE_ENV, "soon")
    with pytest.raises(ValueError, match="'soon'"):
        device_copies(torch.device("cpu"))
    monkeypatch.delenv(transfers.LATE_ENV)
    assert type(device_copies(torch.device("cpu"))) is ImmediateCopies


class _Stream:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


class _AtOnce:
    """A release queue whose releaser runs at once (no thread): ``done`` is set on put."""

    def put(self, item) -> None:
        item[2].set()


def test_cuda_drain_waits_for_host_to_device_copies_too() -> None:
    """A copy from a host home has no ``release_after`` (its source is the home itself), so
    the release queue does not wait for it, nor for a step's write: drain synchronizes every
    copy stream as well."""
    from types import SimpleNamespace
    copies = SimpleNamespace(_releases=_AtOnce(), h2d=_Stream(), d2h=_Stream(), writes=_Stream(),
                             _error=None, _adder=host_adds.HostAdder())
    transfers.CudaCopies.drain(copies)
    assert (copies.h2d.synchronized, copies.writes.synchronized,
            copies.d2h.synchronized) == (1, 1, 1)


class _Stop(Exception):
    pass


def test_the_releaser_keeps_no_released_buffer_while_it_waits() -> None:
    """The release thread's loop must not hold the last release (a closure over a pool slot)
    while it waits for the next: checked at its next ``get``, on the calling thread."""
    import gc
    import weakref
    from types import SimpleNamespace

    buffer = torch.zeros(16)
    ref = weakref.ref(buffer)
    released = []
    items = [(transfers.DONE, lambda b=buffer: released.append(b.numel()), None)]
    del buffer
    alive_at_next_get: list[bool] = []

    class _Queue:
        def get(self):
            if items:
                return items.pop()
            gc.collect()
            alive_at_next_get.append(ref() is not None)
            raise _Stop     # ends the loop instead of blocking
    copies = SimpleNamespace(_releases=_Queue(), _error=None)
    with pytest.raises(_Stop):
        transfers.CudaCopies._release_when_done(copies)
    assert released == [16] and alive_at_next_get == [False]


class _WatchedEvent(transfers._LateEvent):
    """A late copy's event (fires when the test sets it) that also says when someone started
    waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def wait(self) -> None:
        self.entered.set()
        super().wait()


def test_the_host_adder_adds_each_as_its_copy_lands_in_the_order_given() -> None:
    """On a GPU the adds into a gradient's host home are made by the adder thread, not at the
    reader's wait (see [Note: host adds off the training thread]): an add is made once its copy
    has landed, with nobody waiting, and in the order given, so the fp32 sum has the bits of
    the adds made one by one; an add whose copy has not landed holds back those after it. (The
    adder is seen blocked on the first copy before anything is checked: no race with it.)"""
    adder = host_adds.HostAdder()
    dst = torch.zeros(4096)
    parts = [torch.randn(4096).to(torch.bfloat16) for _ in range(3)]
    events = [_WatchedEvent() for _ in parts]
    added = [adder.add(host_adds.HostAdd(e, dst, p)) for e, p in zip(events, parts)]
    events[1]._over.set()
    events[2]._over.set()
    assert events[0].entered.wait(timeout=60), "the adder never waited for the first copy"
    assert not any(a.done() for a in added)            # the first copy has not landed
    assert torch.equal(dst, torch.zeros(4096))
    events[0]._over.set()
    added[2].wait()
    assert all(a.done() for a in added)
    want = torch.zeros(4096)
    for p in parts:
        want.add_(p.float())
    assert torch.equal(dst, want)
    adder.drain()


def test_an_add_that_fails_raises_at_its_wait_and_the_adder_goes_on() -> None:
    adder = host_adds.HostAdder()
    broken = adder.add(host_adds.HostAdd(transfers.DONE, torch.zeros(4), torch.zeros(5)))
    dst = torch.zeros(4)
    fine = adder.add(host_adds.HostAdd(transfers.DONE, dst, torch.ones(4)))
    with pytest.raises(RuntimeError, match="gradient add failed"):
        broken.wait()
    fine.wait()
    assert not broken.done() and fine.done() and torch.equal(dst, torch.ones(4))
    adder.drain()
