"""Activation swaps through the copies' owner under late copies (zero/activation_swap.py,
[Note: activation copies]; storage/transfers.py ``LateCopies``, issue 36).

On a GPU a swapped tensor leaves the device by ``copies.to_host`` into a staging chunk (written
to NVMe only after ``host_waits``) and comes back by ``copies.to_device`` into a fresh device
tensor (used only after ``compute_waits``, its host buffer given up only after the copy's event,
``release_after``). A CPU device needs no copy, so these tests force a GPU's path on it
(``needs_device_copies`` true: the "device" tensor is a separate CPU tensor) and run it under
late copies: each copy lands on a helper thread after a seeded random delay, its destination NaN
until then, and a buffer given back while a copy still uses it is NaN-filled. Activation offload
must then train exactly as torch AdamW does, nothing poisoned or lost; and it must fail when an
unpacked tensor is used before its copy's event, when a staging chunk is written before its
copy to the host landed, or when a read buffer is given up before its copy to the device.

Tolerances: gradients bit for bit against plain autograd (the bytes autograd gets back are the
bytes it saved); fp32 losses within 1e-5 relative per step, as the other parity tests."""
from __future__ import annotations

import math

import pytest
import torch
from parity import make_model, run_parity, zero_config

from infinity.base.budget import MemoryBudget
from infinity.engine import sizing as engine_sizing
from infinity.storage import transfers
from infinity.storage.device_cache import DeviceMemoryCache
from infinity.storage.integrity import SwapCorruptionError
from infinity.storage.manager import TierManager
from infinity.zero import activation_swap
from infinity.zero.activation_swap import ActivationSwapper


def _force_device_copies(monkeypatch, seed: int) -> None:
    """Late copies, and the swapper treating the CPU device as one that needs copies."""
    monkeypatch.setenv(transfers.LATE_ENV, str(seed))
    monkeypatch.setattr(activation_swap, "needs_device_copies", lambda device: True)


def _swapper(disk_dir, window: int) -> ActivationSwapper:
    manager = TierManager(host_budget=MemoryBudget("host", 1 << 30),
                          device_budget=MemoryBudget("device", 1 << 30), nvme_path=str(disk_dir))
    return ActivationSwapper(manager, min_bytes=1, window_bytes=window,
                             is_parameter_storage=lambda t: False)


def _close(swapper: ActivationSwapper) -> None:
    swapper.close()
    swapper.manager.close()


def _weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 64, generator=gen) / 8).requires_grad_() for _ in range(6)]


def _forward(w: list[torch.Tensor]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(8, 64, generator=gen)
    for i in range(0, len(w), 3):
        # h is saved by three matmuls: one handle, three unpacks
        h = torch.tanh(h @ w[i] + h @ w[i + 1] + h @ w[i + 2])
    return (h * h).sum()


@pytest.mark.parametrize("window", [0, 4096, 1 << 20])
@pytest.mark.parametrize("seed", [1, 2])
def test_swapped_tensors_come_back_through_late_copies_bit_for_bit(disk_dir, monkeypatch,
                                                                    window: int,
                                                                    seed: int) -> None:
    _force_device_copies(monkeypatch, seed)
    swapper = _swapper(disk_dir, window)
    try:
        copies = swapper.manager.copies
        assert isinstance(copies, transfers.LateCopies)
        w = _weights()
        expected = torch.autograd.grad(_forward(w), w)
        with swapper.hooks():
            loss = _forward(w)
        first = torch.autograd.grad(loss, w, retain_graph=True)
        second = torch.autograd.grad(loss, w)         # the extents kept: read and copied again
        for e, a, b in zip(expected, first, second):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
            torch.testing.assert_close(b, e, rtol=0, atol=0)
        stats = swapper.stats
        assert stats.shared > 0, swapper.describe()
        if window < 1 << 20:      # written, read and copied both ways
            assert stats.to_host_copies > 0 and stats.to_device_copies > 0, swapper.describe()
        else:                     # all held on the device: no copy at all
            assert stats.to_host_copies == stats.to_device_copies == 0, swapper.describe()
        del loss
        swapper.release_forgotten()
        copies.drain()
        assert swapper._live == 0 and swapper.manager.swap.bytes_allocated == 0
        assert copies.copies == stats.to_host_copies + stats.to_device_copies
        assert copies.poisoned == 0 and copies.lost == 0
    finally:
        _close(swapper)


def test_a_read_that_landed_is_copied_to_the_device_before_its_unpack(disk_dir,
                                                                       monkeypatch) -> None:
    """The hooks called by hand: once the reads issued ahead are over, the next unpack starts
    their copies to the device (read-ahead records are lifted before their own unpack), and
    each unpack hands back the saved values."""
    _force_device_copies(monkeypatch, 3)
    swapper = _swapper(disk_dir, 0)
    gen = torch.Generator().manual_seed(2)
    saved = [torch.randn(256, generator=gen) for _ in range(6)]
    handles = [swapper._pack(t) for t in saved]          # window 0: every one written
    try:
        swapper.window_bytes = 1 << 20                   # reads ahead of the whole backward
        swapper._ahead_low = len(swapper._order)
        first = swapper._unpack(handles[-1])             # read on the spot, others read ahead
        for record in list(swapper._reading):
            record.read.wait()
        second = swapper._unpack(handles[-2])            # lifts every landed read
        # the four records not yet unpacked are on the device (the second one was lifted at
        # the first unpack where its read was over by then, else at its own)
        assert not swapper._reading
        assert all(ref().lifted is not None for ref in swapper._order[:-2])
        assert swapper.stats.lifted_ahead >= len(saved) - 2, swapper.describe()
        rest = [swapper._unpack(h) for h in reversed(handles[:-2])]
        for want, got in zip(reversed(saved), [first, second, *rest]):
            assert got.data_ptr() != want.data_ptr()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        swapper.manager.copies.drain()
        assert swapper.manager.copies.poisoned == 0
    finally:
        del handles
        _close(swapper)


SWAP_FAULTS = ["unpack does not wait for its copy", "chunk written before its copy landed",
               "read buffer given up before its copy"]


def _plant(monkeypatch, fault: str) -> None:
    if fault == SWAP_FAULTS[0]:
        monkeypatch.setattr(transfers.LateCopies, "compute_waits", lambda self, event: None)
    elif fault == SWAP_FAULTS[1]:
        # the swapper takes a copy to the host for landed without its event
        monkeypatch.setattr(transfers.LateCopies, "host_waits", lambda self, events: None)
        monkeypatch.setattr(transfers._LateEvent, "done", lambda self: True)
    else:
        monkeypatch.setattr(transfers.LateCopies, "release_after",
                            lambda self, event, release: release())


@pytest.mark.parametrize("fault", SWAP_FAULTS)
def test_a_missing_wait_in_the_swap_fails(disk_dir, monkeypatch, fault: str) -> None:
    _force_device_copies(monkeypatch, 4)
    # long delays: a copy is still pending when the faulty code goes on
    monkeypatch.setattr(transfers.LateCopies.__init__, "__defaults__", (0.02,))
    _plant(monkeypatch, fault)
    swapper = _swapper(disk_dir, 0)
    try:
        w = _weights()
        expected = torch.autograd.grad(_forward(w), w)
        with swapper.hooks():
            loss = _forward(w)
        got = torch.autograd.grad(loss, w)
        assert any(not torch.equal(a, e) for a, e in zip(got, expected)), fault
    except SwapCorruptionError:
        # a chunk written while its copy still lands in it: the page changed under the write
        assert fault == SWAP_FAULTS[1]
    finally:
        swapper.manager.copies.drain()
        _close(swapper)


def _config(disk_dir, early_step: str) -> dict:
    # a window of a few tensors of these tiny models: most are written and read back
    return zero_config(3, "nvme", "nvme", str(disk_dir), offload_activations="nvme",
                       activation_min_bytes=1, activation_window="16KiB",
                       early_step=early_step)


def _train(disk_dir, family: str, early_step: str = "off", steps: int = 4, prepare=None):
    return run_parity(make_model(family, layers=2, width=32), _config(disk_dir, early_step),
                      steps=steps, close=False, prepare=prepare)


@pytest.mark.parametrize("family, early_step, gpu_fetch", [
    ("llama", "off", False), ("gpt2", "on", False), ("torch", "off", False),
    ("llama", "on", True)])
def test_activation_offload_under_late_copies_trains_as_torch(disk_dir, monkeypatch, family,
                                                              early_step, gpu_fetch) -> None:
    """``gpu_fetch``: the units' fetches and the gradients take a GPU's path too (slots and
    copies, as tests/integration/test_late_transfers.py), so every copy of a step is late."""
    _force_device_copies(monkeypatch, seed=len(family) + (early_step == "on"))
    if gpu_fetch:
        monkeypatch.setattr(DeviceMemoryCache, "supported", staticmethod(lambda device: False))
        monkeypatch.setattr(engine_sizing, "gradients_held", lambda device: False)
    result = _train(disk_dir, family, early_step)
    engine = result.engine
    try:
        swapper = engine.activation_swapper.swapper
        stats = swapper.stats
        copies = engine.manager.copies
        assert isinstance(copies, transfers.LateCopies)
        copies.drain()
        assert result.worst_relative <= 1e-5 and copies.poisoned == copies.lost == 0, \
            (result.losses, result.ref_losses, copies.poisoned, copies.lost, swapper.describe())
        assert stats.written > 0 and stats.to_host_copies > 0, swapper.describe()
        assert stats.to_device_copies > 0, swapper.describe()
        if gpu_fetch:
            assert copies.copies > stats.to_host_copies + stats.to_device_copies
        else:          # the units are read straight into the device: the swap's copies only
            assert copies.copies == stats.to_host_copies + stats.to_device_copies
        assert swapper._live == 0 and not swapper._landing and not swapper._reading
    finally:
        engine.close()


@pytest.mark.parametrize("fault", SWAP_FAULTS)
def test_a_missing_wait_in_the_swap_fails_training(disk_dir, monkeypatch, fault: str) -> None:
    """The faults planted in the engine: NaN losses, losses off torch's, or (a chunk written
    while its copy still lands in it) the swap's integrity check finding the page changed
    under its write; not a pass. The units' fetches take the CPU device's direct reads here:
    the swap's are the only copies."""
    _force_device_copies(monkeypatch, seed=7)
    _plant(monkeypatch, fault)
    engines: list = []
    try:
        result = _train(disk_dir, "llama", steps=3, prepare=engines.append)
        bad = not all(math.isfinite(x) for x in result.losses) or \
            result.worst_relative > 1e-3
        assert bad, (fault, result.losses, result.ref_losses)
    except SwapCorruptionError:
        assert fault == SWAP_FAULTS[1]
    finally:
        for engine in engines:
            engine.manager.copies.drain()
            engine.close()
