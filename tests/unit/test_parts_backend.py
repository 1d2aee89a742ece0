"""The engine's backend and the dry run's (simulate/backend.py) both implement what the one
assembly asks of a backend (engine/assembly.py ``PartsBackend``): every attribute, and every
method with the same parameters, so ``assemble`` builds the engine's parts and the dry run's
alike. A member added to the Protocol, or a parameter changed on one side only, fails here."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from infinity.engine.assembly import PartsBackend
from infinity.engine.engine import _EngineBackend
from infinity.simulate.backend import SimBackend
from infinity.simulate.clock import SimClock
from infinity.simulate.collectives import SimCollectives
from infinity.simulate.compute import SimCompute
from infinity.simulate.storage import SimManager

METHODS = [name for name, value in vars(PartsBackend).items()
           if not name.startswith("_") and callable(value)]
ATTRIBUTES = list(PartsBackend.__annotations__)


def _backends() -> list[object]:
    clock = SimClock()
    manager = SimManager(None, None, clock=clock, read_Bps=1e9, write_Bps=1e9, device_is_cpu=True)
    sim = SimBackend(manager, SimCollectives(1, clock, 0.0), SimCompute(clock, 1e9),
                     adam_params_per_s=1e9, grad_dtype=torch.float32, instant=True,
                     direct=False)
    engine = _EngineBackend(SimpleNamespace(manager=object(), device=torch.device("cpu")),
                            owner=None, values=None)
    return [engine, sim]


def _parameters(method) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]


def test_the_protocol_has_members() -> None:
    assert METHODS == ["pool", "unit_factory", "stepper"], METHODS
    assert ATTRIBUTES == ["manager", "device"], ATTRIBUTES


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: type(b).__name__)
def test_each_backend_implements_every_member_alike(backend: object) -> None:
    for name in ATTRIBUTES:
        assert hasattr(backend, name), f"{type(backend).__name__} lacks PartsBackend.{name}"
    for name in METHODS:
        expected = _parameters(getattr(PartsBackend, name))
        got = _parameters(getattr(type(backend), name))
        assert got == expected, (type(backend).__name__, name, got, expected)
