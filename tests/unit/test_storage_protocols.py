"""The tier manager and the dry run's byte-free backend both implement the storage Protocols
the parts are built over (storage/protocols.py): every member, and every method with the same
parameters (names, kinds, defaults), so the one assembly (engine/assembly.py) builds the
engine's parts and the dry run's alike. A member added to a Protocol, or a parameter changed
on one side only, fails here."""
from __future__ import annotations

import inspect

import pytest
import torch

from infinity.base.budget import MemoryBudget
from infinity.simulate.clock import SimClock
from infinity.simulate.storage import SimManager, SimPool
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.protocols import (
    PROTOCOL_MEMBERS,
    DeviceMemory,
    SlotPool,
    StorageBackend,
    Store,
)
from infinity.storage.tiers import Tier


def _pairs():
    real = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    sim = SimManager(None, None, clock=SimClock(), read_Bps=1e9, write_Bps=1e9,
                     device_is_cpu=True)
    return {
        StorageBackend: (real, sim),
        Store: (real.create("s", 10, torch.float32, Tier.HOST),
                sim.create("s", 10, torch.float32, Tier.HOST)),
        DeviceMemory: (real.device_cache, sim.device_cache),
        SlotPool: (BufferPool(real, 4096, 2, "p"), SimPool(sim, 4096, 2, "p")),
    }


def _parameters(method) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]


@pytest.mark.parametrize("protocol", list(PROTOCOL_MEMBERS), ids=lambda p: p.__name__)
def test_both_backends_implement_every_member_alike(protocol) -> None:
    real, sim = _pairs()[protocol]
    members = PROTOCOL_MEMBERS[protocol]
    assert members, protocol
    for name in members:
        for impl in (real, sim):
            assert hasattr(impl, name), f"{type(impl).__name__} lacks {protocol.__name__}.{name}"
        declared = vars(protocol).get(name)
        if callable(declared) and not isinstance(declared, property):
            expected = _parameters(declared)
            for impl in (real, sim):
                got = _parameters(getattr(type(impl), name))
                assert [p[0] for p in got] == [p[0] for p in expected], \
                    (type(impl).__name__, name, got, expected)
                assert got == expected, (type(impl).__name__, name, got, expected)
        elif isinstance(declared, property):
            for impl in (real, sim):
                assert isinstance(getattr(type(impl), name, None), property), \
                    f"{type(impl).__name__}.{name} is not a property"
