"""The engine's own handling of the user's module (engine/model_methods.py): where a model built
under ``zero.Init`` keeps its buffers, and on which device the engine then computes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.engine.model_methods import model_device, place_buffers


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("positions", torch.arange(4), persistent=False)
        self.register_buffer("scale", torch.ones(4))
        self.inner = nn.Module()
        self.inner.register_buffer("shared", torch.zeros(2))
        self.twin = nn.Module()
        self.twin.register_buffer("shared", self.inner.shared)   # one tensor, two modules
        self.inner.register_buffer("absent", None)


def test_every_buffer_moves_to_the_engine_device_and_a_shared_one_stays_shared() -> None:
    """The device here is "meta" (the one other device a CPU-only torch has): what a CUDA
    device is to the engine on a GPU, where an Init-built model's CPU buffers would otherwise
    meet CUDA parameters in the first forward."""
    model = _WithBuffers()
    meta = torch.device("meta")
    assert place_buffers(model, meta) == 3
    assert all(b.device == meta for b in model.buffers())
    assert model.twin.shared is model.inner.shared
    assert model.inner.absent is None
    assert "positions" in model._non_persistent_buffers_set        # registration untouched
    assert model.lin.weight.device.type == "cpu"                    # parameters are the units'
    assert place_buffers(model, meta) == 0                          # already there: nothing


def test_buffers_already_on_the_device_are_the_same_tensors() -> None:
    model = _WithBuffers()
    before = dict(model.named_buffers())
    assert place_buffers(model, model_device(model)) == 0
    assert all(before[name] is buf for name, buf in model.named_buffers())


def test_a_buffer_left_on_the_meta_device_is_refused_naming_it() -> None:
    """A buffer made from a parameter under zero.Init (an L2-SP reference copy) stayed on the
    meta device and failed the first forward with a device mismatch pointing elsewhere."""
    model = _WithBuffers()
    model.register_buffer("reference", torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="model buffer.*reference are on the meta device"):
        place_buffers(model, torch.device("cpu"))
    assert place_buffers(model, torch.device("meta")) == 3     # placing on meta keeps them
