"""Gradients reduced on the device in the communication dtype ([Note: gradients reduced on the
device] in optim/device_gradients.py; ``communication_data_type``), the GPU's path forced on the
CPU device as in test_device_gradients.py, two ranks' collectives computed in process.

The rule checked bit for bit, with bf16 compute and a bf16 reduce over 2 ranks: the device
buffer holds each parameter's bf16 gradient as autograd made it (a second gradient of the same
parameter added in bf16: ``bf16(float(g) + float(g'))``), the collective sums the two ranks'
bf16 values with one rounding to bf16 and halves them (exact: a power of two, no value near
bf16's smallest), and the host widens that bf16 exactly to fp32:
``shard = float(bf16(bf16(float(a) + float(b)) / 2))``, a and b the ranks' bf16 buffers.
``Collectives.reduce_scatter_mean`` halves each rank's 16-bit values first and then sums
(``bf16(a/2 + b/2)``), ``_TwoRanks`` sums then halves: the same bits at 2 ranks (scaling by a
power of two commutes with rounding), and what a CPU's bf16 add gives (float add, one
rounding). With "fp32" the shard is the host path's, bit for bit (today's).

A 16-bit shard lands in the back half of its fp32 host buffer and is widened there by whoever
waits for its copy; the device buffer is written again after the copy's own event. Late
copies behind a gate that only the copy's own wait opens make a widen before that event read
the NaN the late copies leave in the staging, deterministically (planted: ``Widened.wait``
without ``self.copied.wait()``: the shard is NaN)."""
from __future__ import annotations

import threading

import pytest
import torch
from test_device_gradients import SHAPES, _DeviceManager, _feed, _grads, _rig, _shard, _units
from test_gradients import _TwoRanks

from infinity.optim import device_gradients
from infinity.optim.device_gradients import (
    WIDEN_TAIL,
    Widened,
    narrow_staging,
    widen_in_place,
)
from infinity.storage.transfers import LateCopies

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(device_gradients, "reduces_on_device", lambda device: True)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("n", [1, 2, 3, WIDEN_TAIL, WIDEN_TAIL + 1, 2 * WIDEN_TAIL + 7, 100_003])
def test_widening_in_place_is_exact_and_reads_every_value_before_it_is_overwritten(
        dtype, n: int) -> None:
    """Every 16-bit value of the back half comes out as its fp32 value, bit for bit (a
    chunk written over values not yet read would give others)."""
    wide = torch.full((n,), float("nan"))
    narrow = narrow_staging(wide, dtype)
    assert narrow.numel() == n and narrow.data_ptr() == wide.data_ptr() + 2 * n
    values = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100).to(dtype)
    values[0] = -0.0
    narrow.copy_(values)
    widen_in_place(wide, dtype)
    assert torch.equal(wide.view(torch.int32), values.float().view(torch.int32))


def test_a_staging_is_only_a_16_bit_view_of_a_contiguous_fp32_buffer() -> None:
    with pytest.raises(ValueError, match="16-bit"):
        narrow_staging(torch.zeros(8), F32)
    with pytest.raises(ValueError, match="contiguous fp32"):
        narrow_staging(torch.zeros(16)[::2], BF16)


def _run(rig, state, grads) -> torch.Tensor:
    _feed(rig, state, grads)
    rig.g.reduce(state)
    return rig.g.finish(state, write_home=False).clone()


def _counting(rig) -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) of each copy to the host."""
    counted = []
    to_host = rig.g.copies.to_host
    rig.g.copies.to_host = lambda dst, src, **kwargs: (
        counted.append((src.dtype, src.numel())), to_host(dst, src, **kwargs))[1]
    return counted


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("scatter", [True, False])
@pytest.mark.parametrize("name, dtype", [("bf16", BF16), ("fp16", torch.float16)])
def test_a_16_bit_reduce_of_16_bit_gradients_gives_the_rounded_sum_s_half(
        forced, scatter: bool, rank: int, name: str, dtype: torch.dtype) -> None:
    """bf16 (bf16 compute) and fp16 (fp16 compute, the loss-scaled gradients' own dtype)."""
    other = (torch.randn(4096, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    comm = _TwoRanks(rank, other, [True, True])
    rig = _rig(_units(1, comm), comm, scatter=scatter, rank=rank, device_dtype=name)
    pool = rig.g.device_pool
    assert pool.dtype == dtype and pool.nbytes == pool.numel * 2
    assert rig.manager.device_budget.held == 0
    counted = _counting(rig)
    state = rig.states[0]
    got = _run(rig, state, _grads(rank, dtype))
    assert rig.manager.device_budget.held == pool.nbytes       # the 16-bit buffer's bytes
    assert counted == [(dtype, state.numel)]                   # only the shard, in 16 bits
    # the rule, computed apart from the engine's code: fp32 adds, each rounded once to 16 bits
    g0, g1, g1b = (g.reshape(-1) for g in _grads(rank, dtype))
    mine = torch.zeros(4096, dtype=dtype)
    mine[0:2000] = g0
    mine[2000:2900] = (g1.float() + g1b.float()).to(dtype)
    total = (mine.float() + other.float()).to(dtype)
    want = (total.float() / 2).to(dtype).float()
    lo, hi = _shard(rank) if scatter else (0, 3072)
    assert torch.equal(got.view(torch.int32), want[lo:hi].view(torch.int32))
    assert got.dtype == F32


@pytest.mark.parametrize("scatter", [True, False])
def test_an_fp32_communication_dtype_is_the_host_path_bit_for_bit(monkeypatch,
                                                                   scatter: bool) -> None:
    """bf16 gradients with "fp32" asked: summed in fp32 on the device as on the host, copied
    in fp32 (no staging, no widening)."""
    other = torch.randn(4096, generator=torch.Generator().manual_seed(9))
    results = []
    for device_path in (False, True):
        monkeypatch.setattr(device_gradients, "reduces_on_device", lambda d: device_path)
        comm = _TwoRanks(0, other, [True, True])
        rig = _rig(_units(1, comm), comm, scatter=scatter, rank=0, device_dtype="fp32")
        counted = _counting(rig)
        results.append(_run(rig, rig.states[0], _grads(0, BF16)))
        if device_path:
            assert counted == [(F32, rig.states[0].numel)]
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))


def _gated(rig) -> LateCopies:
    """Late copies (the NaN they leave in a destination until the copy runs included)."""
    copies = LateCopies(seed=3)
    rig.manager.copies = rig.g.copies = rig.pool._copies = copies
    rig.g.device_pool.copies = copies
    return copies


def _gate(copies: LateCopies) -> threading.Event:
    """The copies issued from now on run only once the gate opens."""
    gate = threading.Event()
    copies._jobs.put(gate.wait)
    return gate


def _opens_on_wait(event, gate: threading.Event) -> None:
    """Waiting for ``event`` (a copy's own) opens ``gate`` first: only that wait lets the copy
    land."""
    real = event.wait
    event.wait = lambda: (gate.set(), real())[1]


@pytest.mark.parametrize("scatter", [True, False])
def test_the_widen_waits_for_the_copy_s_event(forced, scatter: bool) -> None:
    """Whoever waits widens: the training thread (finish) and the early step's stream
    (``CompleteGradient.landed``), each after the copy's own event."""
    other = (torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 3).to(BF16)
    comm = _TwoRanks(1, other, [True, True])
    reference = _rig(_units(2, comm), comm, scatter=scatter, rank=1, device_dtype="bf16")
    want = [_run(reference, state, _grads(7 + i, BF16))
            for i, state in enumerate(reference.states)]
    rig = _rig(_units(2, comm), comm, scatter=scatter, rank=1, device_dtype="bf16")
    copies = _gated(rig)
    a, b = rig.states
    gate = _gate(copies)
    _feed(rig, a, _grads(7, BF16))
    rig.g.reduce(a)
    landing = a.grad.copies[0]
    assert isinstance(landing, Widened) and not landing.done()
    assert torch.isnan(a.grad.buffer[a.numel // 2:]).all()   # the staging, not yet landed
    _opens_on_wait(landing.copied, gate)
    got_a = rig.g.finish(a, write_home=False)        # the training thread widens a's
    gate = _gate(copies)
    _feed(rig, b, _grads(8, BF16))
    rig.g.reduce(b)
    gradient = rig.g.take(b)                         # the early step: the step stream's
    assert [type(e) for e in gradient.landing] == [Widened]
    _opens_on_wait(gradient.landing[0].copied, gate)
    gradient.landed()
    for got, expect in ((got_a, want[0]), (gradient.values, want[1])):
        assert not torch.isnan(got).any()
        assert torch.equal(got.view(torch.int32), expect.view(torch.int32))
    gradient.give_back()
    copies.drain()
    assert copies.poisoned == copies.lost == 0


def test_the_device_buffer_waits_for_the_copy_not_for_the_widen(forced) -> None:
    """One kept buffer: the next unit's reduce waits (on the device) for the copy out of the
    shard before it, not for its widening on the host (that waits for the unit's reader)."""
    comm = _TwoRanks(0, torch.zeros(4096, dtype=BF16), [True, True])
    rig = _rig(_units(2, comm), comm, scatter=True, rank=0, device_dtype="bf16",
               device_buffers=1)
    copies = _gated(rig)
    waited = []
    copies.compute_waits = lambda event: (waited.append(event), event.wait())
    a, b = rig.states
    _feed(rig, a, _grads(1, BF16))
    rig.g.reduce(a)
    landing = a.grad.copies[0]
    _feed(rig, b, _grads(2, BF16))
    rig.g.reduce(b)
    assert waited == [landing.copied] and landing.copied.done() and not landing.done()
    for state in (a, b):
        assert not torch.isnan(rig.g.finish(state, write_home=False)).any()
    copies.drain()
    assert copies.poisoned == copies.lost == 0


def test_a_widen_cut_short_is_not_widened_again(monkeypatch) -> None:
    """A widen interrupted midway (Ctrl-C, here any exception) has overwritten narrow values
    it cannot read again: a later wait must not widen the buffer a second time from them."""
    from infinity.storage.transfers import DONE

    class CutShort(Exception):
        pass

    calls = []

    def interrupted(buffer, dtype):
        calls.append(dtype)
        raise CutShort
    monkeypatch.setattr(device_gradients, "widen_in_place", interrupted)
    landing = Widened(DONE, torch.zeros(8), torch.bfloat16)
    with pytest.raises(CutShort):
        landing.wait()
    landing.wait()
    assert calls == [torch.bfloat16] and landing.done()
