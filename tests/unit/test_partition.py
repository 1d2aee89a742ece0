"""Units from infinity.unit_modules: a class name the model does not have is a clear error."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.zero.partition import modules_needing, partition


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(4, 2)


def test_unit_modules_by_class_name() -> None:
    specs = partition(Net(), ["Layer"])
    assert [s.name for s in specs] == ["layers.0", "layers.1", "layers.2", "head"]


def test_a_misspelt_unit_module_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"'Layr' \(did you mean 'Layer'\?\)"):
        partition(Net(), ["Layr"])


class DictBlock(nn.ModuleDict):
    def __init__(self) -> None:
        super().__init__({"norm": nn.LayerNorm(4), "fc": nn.Linear(4, 4)})


class DictNet(nn.Module):
    """Blocks that are ModuleDicts (never called: the parent calls their entries), and a
    ParameterList indexed by the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DictBlock() for _ in range(2))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(4)) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block, scale in zip(self.blocks, self.scales):
            x = block["fc"](block["norm"](x)) * scale
        return self.head(x)


def test_units_rooted_at_containers_are_fetched_by_what_is_called() -> None:
    model = DictNet()
    specs = partition(model)
    unit_of = {spec.name: i for i, spec in enumerate(specs)}
    hooks = {id(m): (m, ids) for m, ids in modules_needing(model, specs)}
    for i, block in enumerate(model.blocks):
        for entry in block.values():           # each called entry fetches the whole block
            assert unit_of[f"blocks.{i}"] in hooks[id(entry)][1]
        assert id(block) not in hooks
    assert unit_of["scales"] in hooks[id(model)][1]    # the parent indexes the list
