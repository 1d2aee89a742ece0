"""Units from infinity.unit_modules: a class name the model does not have is a clear error."""
from __future__ import annotations

import pytest
from torch import nn

from infinity.zero.partition import partition


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
