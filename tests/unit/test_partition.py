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


class AttributeLayers(nn.Module):
    """No repeated blocks in a list: layers are attributes of a body module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Module()
        self.body.first = nn.Linear(8, 8)
        self.body.second = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.body.third = nn.Linear(8, 8)
        self.body.gain = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 2)


def test_a_unit_holding_most_of_a_blockless_model_is_split() -> None:
    """See [Note: units too large to stream]: 'body' holds ~70% of the parameters, so its
    children are units and its direct parameter one more; nothing holds more than half."""
    model = AttributeLayers()
    specs = partition(model)
    assert [s.name for s in specs] == ["embed", "body", "body.first", "body.second",
                                       "body.third", "head"]
    assert [n for n, _ in specs[1].params] == ["body.gain"]
    total = sum(p.numel() for p in model.parameters())
    assert max(sum(p.numel() for _, p in s.params) for s in specs) * 2 <= total
    assert sorted(n for s in specs for n, _ in s.params) == sorted(
        n for n, _ in model.named_parameters())


def test_block_models_and_big_leaves_keep_their_units() -> None:
    """The split leaves models with blocks alone, and a leaf (a big embedding) whole."""
    assert [s.name for s in partition(Net())] == ["layers.0", "layers.1", "layers.2", "head"]
    big_leaf = nn.Sequential(nn.Embedding(1000, 8), nn.Linear(8, 2))
    assert [s.name for s in partition(big_leaf)] == ["0", "1"]


def test_an_integer_parameter_is_refused_with_the_fix() -> None:
    """A unit's flat buffer holds the compute dtype: an int64 index table would come back as
    floats and break the forward that indexes with it."""
    net = Net()
    net.index = nn.Parameter(torch.arange(4), requires_grad=False)
    with pytest.raises(TypeError, match=r"index \(int64\).*register_buffer"):
        partition(net)
    net.index = None
    net.register_buffer("table", torch.arange(4))
    assert [s.name for s in partition(net)] == ["layers.0", "layers.1", "layers.2", "head"]


def test_a_float64_model_and_sparse_embeddings_are_refused_with_the_fix() -> None:
    """Both used to be accepted: float64 weights were cast to float32 (the forward then met a
    float64 input), and a sparse embedding failed at the first backward inside the engine."""
    with pytest.raises(TypeError, match=r"4 parameter\(s\) of Sequential are float64.*model.float"):
        partition(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)).double())
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"sparse gradients \(sparse=True: 0\).*sparse=False"):
        partition(sparse)
    sparse[0].weight.requires_grad_(False)           # frozen: no gradient at all
    assert [s.name for s in partition(sparse)] == ["0", "1"]
