"""``initialize(training_data=...)`` is checked before the engine is built."""
from __future__ import annotations

import pytest
import torch

from infinity.engine.entry import check_training_data


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from (torch.full((4,), i) for i in range(7))


def test_a_stream_at_several_ranks_is_refused_before_anything_is_built(monkeypatch) -> None:
    """An IterableDataset cannot be split into each rank's share (torch's DistributedSampler
    refuses one): every rank trained on the same samples without a word. Refused from the
    launcher's WORLD_SIZE, before the engine (and the group) exist; one rank takes it."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="IterableDataset \\(Stream\\) at 3 ranks.*every rank "
                                         "would train on the same samples"):
        check_training_data(Stream())
    check_training_data(torch.utils.data.TensorDataset(torch.zeros(6, 2)))
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_training_data(Stream())
    with pytest.raises(TypeError, match="must be a torch.utils.data.Dataset, got list"):
        check_training_data([1, 2, 3])


def test_a_loader_from_a_config_naming_no_batch_size_is_refused(tmp_path) -> None:
    """The loader gave batches of one sample without a word (DeepSpeed refuses the config)."""
    from infinity.engine.entry import check_loader_batch_named

    data = torch.utils.data.TensorDataset(torch.zeros(6, 2))
    file = tmp_path / "ds.json"
    file.write_text('{"zero_optimization": {"stage": 0}}')
    for source in ({"zero_optimization": {"stage": 0}}, str(file), file):
        with pytest.raises(ValueError, match="names no batch size.*train_micro_batch_size_per_gpu"):
            check_loader_batch_named(source, data)
    check_loader_batch_named({"train_batch_size": 4}, data)
    check_loader_batch_named({"train_micro_batch_size_per_gpu": 2}, data)
    check_loader_batch_named({}, None)                     # no loader: the engine's 1 is fine
