"""The rank's own GPU under a launcher (comm/group.py ``use_local_gpu``), checked on any machine
with torch.cuda's answers replaced: a model with no device yet computed on GPU 0 in every
rank of a node (nothing set the current device, which DeepSpeed's engine sets)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.engine.model_methods import model_device


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch.cuda as a 4-GPU machine answers it; returns the devices set, in order."""
    current, chosen = [0], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    def set_device(index: int) -> None:
        chosen.append(index)
        current[0] = index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return chosen


@pytest.mark.parametrize("local_rank, device", [("0", 0), ("3", 3), ("5", 1)])
def test_a_model_without_a_device_takes_the_ranks_own_gpu(monkeypatch, four_gpus, local_rank,
                                                          device) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    assert model_device(model) == torch.device("cuda", device)
    assert four_gpus == ([device] if device else [])


def test_no_launcher_or_a_placed_model_keeps_the_current_device(monkeypatch, four_gpus) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with torch.device("meta"):
        assert model_device(nn.Linear(2, 2)) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")     # the user's placement
    assert four_gpus == []
