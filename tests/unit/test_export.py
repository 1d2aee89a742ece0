"""Weights out of infinity (checkpoint/export.py) at unit level, on real tensor files and real
Units: a checkpoint read back
as one state_dict (slices of every rank, aliases, tag, checksums), and an engine's weights
written as one safetensors file (names, dtypes, buffers, frozen ones or not, metadata, the
checks before, the temporary name, the old file kept on a failure, and rank 0 writing while
every rank gathers)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from fakes import failing_on_call, recording_training_state
from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.checkpoint import export
from infinity.checkpoint.directory import FORMAT, MANIFEST, VERSION
from infinity.checkpoint.export import consolidated_state_dict, save_model_weights
from infinity.checkpoint.tensor_file import (
    CheckpointError,
    TensorFileReader,
    TensorFileWriter,
)
from infinity.checkpoint.training_state import TrainingState
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.unit import Unit

W = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 0.5


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    writer = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for name, values in tensors.items():
        writer.append(name, values.reshape(-1))
    writer.close()
    return path


def _checkpoint(directory: Path) -> dict:
    """Two ranks: ``w`` (3 x 4) as slices w#0 (rank 0) and w#5 (rank 1), a buffer on rank 0,
    and ``head.weight`` tied to ``w``."""
    directory.mkdir(parents=True)
    flat = W.reshape(-1)
    parts = [{"w#0": flat[:5], "buf": torch.tensor([7, 8])}, {"w#5": flat[5:]}]
    files = {}
    for r, tensors in enumerate(parts):
        path = _write(directory / f"rank{r}_model.safetensors", tensors)
        data = path.read_bytes()
        files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": FORMAT, "version": VERSION, "world_size": 2, "files": files,
                "params": {"w": {"shape": [3, 4]}}, "aliases": {"head.weight": "w"}}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_a_checkpoint_reads_back_as_one_state_dict_with_its_aliases(tmp_path: Path) -> None:
    """Every rank's slices put together by the manifest's shapes; an alias is the same tensor
    as the name it stands for; the checkpoint found by its own directory, a tag or latest."""
    _checkpoint(tmp_path / "step3")
    state = consolidated_state_dict(tmp_path / "step3")
    assert sorted(state) == ["buf", "head.weight", "w"]
    assert torch.equal(state["w"], W) and torch.equal(state["buf"], torch.tensor([7, 8]))
    assert state["head.weight"] is state["w"]
    assert torch.equal(consolidated_state_dict(str(tmp_path), "step3")["w"], W)
    (tmp_path / "latest").write_text("step3\n")
    assert torch.equal(consolidated_state_dict(tmp_path)["w"], W)


def test_checksums_are_verified_unless_told_not_to(tmp_path: Path) -> None:
    """A model file whose bytes changed (same size) is refused by default, read with
    verify_checksums=False."""
    _checkpoint(tmp_path / "ck")
    path = tmp_path / "ck" / "rank1_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank1_model.safetensors"):
        consolidated_state_dict(tmp_path / "ck")
    state = consolidated_state_dict(tmp_path / "ck", verify_checksums=False)
    assert not torch.equal(state["w"], W) and torch.equal(state["w"].reshape(-1)[:11],
                                                          W.reshape(-1)[:11])


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.b = nn.Parameter(torch.arange(4.0) + 100)
        self.frozen = nn.Parameter(torch.full((5,), -1.0), requires_grad=False)
        self.register_buffer("running", torch.tensor([1.5, 2.5]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


class _Comm:
    """Two ranks, the other of which always succeeds."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, 2

    def all_gather_objects(self, value):
        return [value, (None, None)] if self.rank == 0 else [(None, None), value]


def _state(model: _Model, dtype: torch.dtype = torch.float32, comm=None, log=None,
           u1_home: Tier = Tier.HOST, nvme: Path | None = None, **over) -> TrainingState:
    log = [] if log is None else log
    units = [Unit(0, "u0", model, [("a", model.a, 0), ("frozen", model.frozen, -1)], dtype,
                  torch.device("cpu")),
             Unit(1, "u1", model, [("b", model.b, 0)], dtype, torch.device("cpu"))]
    # u0 kept in (device) memory for good, u1 released to its host home (unless u1_home is
    # DEVICE too: with several ranks every unit is read from its gathered copy)
    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                          nvme_path=None if nvme is None else str(nvme))
    units[0].adopt(manager, Tier.DEVICE, persistent=True)
    units[1].adopt(manager, u1_home, persistent=u1_home is Tier.DEVICE)
    return recording_training_state(model, units, dtype, comm, log,
                                    **{"manager": manager, **over})


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    reader = TensorFileReader(path)
    try:
        return {n: reader.read(n) for n in reader.tensors}, dict(reader.metadata)
    finally:
        reader.close()


def test_weights_are_written_unit_by_unit_with_the_buffers_in_one_file(tmp_path: Path) -> None:
    """Every parameter under its name and shape in the units' dtype, then the persistent
    buffers (not the others), with the {"format": "pt"} metadata; a missing parent is made;
    the engine was asked whether it may save and flushed first; no temporary file is left."""
    log: list = []
    model = _Model()
    path = tmp_path / "out" / "sub" / "model.safetensors"
    assert save_model_weights(_state(model, torch.bfloat16, log=log), str(path)) == path
    tensors, metadata = _read(path)
    assert list(tensors) == ["a", "frozen", "b", "running"]
    assert metadata == {"format": "pt"}
    assert tensors["a"].dtype == torch.bfloat16 and tensors["running"].dtype == torch.float32
    assert torch.equal(tensors["a"], model.a.detach().to(torch.bfloat16))
    assert torch.equal(tensors["b"], (torch.arange(4.0) + 100).to(torch.bfloat16))
    assert torch.equal(tensors["frozen"], torch.full((5,), -1.0, dtype=torch.bfloat16))
    assert torch.equal(tensors["running"], torch.tensor([1.5, 2.5]))
    assert log == [("open", "save_16bit_model"), ("flush",)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.safetensors"]


def test_without_frozen_parameters_only_the_trainable_ones_are_written(tmp_path: Path) -> None:
    path = save_model_weights(_state(_Model()), tmp_path / "m.safetensors", with_frozen=False)
    tensors, _ = _read(path)
    assert list(tensors) == ["a", "b", "running"]


@pytest.mark.parametrize("name", ["model.bin", "model.pt", "model.pth"])
def test_pickle_file_names_are_refused(tmp_path: Path, name: str) -> None:
    log: list = []
    with pytest.raises(ValueError) as info:
        save_model_weights(_state(_Model(), log=log), tmp_path / name)
    assert str(info.value) == (f"{name}: infinity writes safetensors only (no pickle); name "
                               "the file *.safetensors (transformers loads model.safetensors)")
    assert log == [] and list(tmp_path.iterdir()) == []


def test_a_weights_file_between_backward_and_step_is_refused(tmp_path: Path) -> None:
    """check_at_rest, named after the engine call: nothing flushed, nothing written."""
    log: list = []
    with pytest.raises(RuntimeError) as info:
        save_model_weights(_state(_Model(), log=log, backwards_since_step=1),
                           tmp_path / "m.safetensors")
    assert str(info.value).startswith("engine.save_16bit_model() between backward() and step()")
    assert log == [("open", "save_16bit_model")] and list(tmp_path.iterdir()) == []


def test_an_existing_file_is_replaced_whole_or_kept(tmp_path: Path, monkeypatch) -> None:
    """A stale temporary file is replaced; a write that fails half-way leaves the old file
    as it was and no temporary file; the next write replaces the old file."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"old weights")
    stale = tmp_path / ".m.safetensors.partial"
    stale.write_bytes(b"stale")
    real = export.save_entries
    failing, calls = failing_on_call(real, 2, OSError(28, "No space left on device"))

    monkeypatch.setattr(export, "save_entries", failing)
    with pytest.raises(OSError, match="No space left"):
        save_model_weights(_state(_Model()), path)
    assert path.read_bytes() == b"old weights" and not stale.exists()
    monkeypatch.setattr(export, "save_entries", real)
    stale.symlink_to(tmp_path / "elsewhere")
    save_model_weights(_state(_Model()), path)
    assert list(_read(path)[0]) == ["a", "frozen", "b", "running"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_with_two_ranks_rank0_writes_what_every_rank_gathers(tmp_path: Path) -> None:
    """Each unit is gathered on every rank (all enter together); rank 0 writes the file from
    the gathered parameters, rank 1 writes nothing and creates nothing."""
    log0: list = []
    path = tmp_path / "w" / "model.safetensors"
    assert save_model_weights(_state(_Model(), comm=_Comm(0), log=log0, u1_home=Tier.DEVICE),
                              path) == path
    assert [e for e in log0 if e[0] == "gathered"] == [("gathered", "u0"), ("gathered", "u1")]
    tensors, _ = _read(path)
    assert list(tensors) == ["a", "frozen", "b", "running"]
    assert torch.equal(tensors["a"], torch.arange(6.0).reshape(2, 3))
    log1: list = []
    other = tmp_path / "r1" / "model.safetensors"
    assert save_model_weights(_state(_Model(), comm=_Comm(1), log=log1, u1_home=Tier.DEVICE),
                              other) == other
    assert [e for e in log1 if e[0] == "gathered"] == [("gathered", "u0"), ("gathered", "u1")]
    assert not (tmp_path / "r1").exists()


def test_a_rank_that_fails_to_write_makes_every_rank_raise(tmp_path: Path) -> None:
    """Over ranks the write is agreed: rank 1 told that rank 0 failed (here when it opened the
    file, the first agreement) raises a CheckpointError saying no file was written."""

    class _Failed(_Comm):
        def all_gather_objects(self, value):
            return [(None, "OSError: disk full"), value]

    with pytest.raises(CheckpointError) as info:
        save_model_weights(_state(_Model(), comm=_Failed(1)), tmp_path / "m.safetensors")
    assert str(info.value) == "rank 0 failed (OSError: disk full); no file was written"


# -- manifests without aliases, and the edges of reading and writing --------------------

def test_a_manifest_without_aliases_reads_back(tmp_path: Path) -> None:
    """A checkpoint whose manifest has no "aliases" (nothing tied) is read, not an
    AttributeError."""
    _checkpoint(tmp_path / "ck")
    path = tmp_path / "ck" / MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["aliases"]
    path.write_text(json.dumps(manifest))
    assert sorted(consolidated_state_dict(tmp_path / "ck")) == ["buf", "w"]


def test_weights_of_an_nvme_home_are_read_through_a_pool_of_its_own(tmp_path: Path,
                                                                    disk_dir: Path) -> None:
    """u1 released to NVMe and no pool to borrow: its chunks go through a small pool the
    export makes from the engine's tier manager."""
    state = _state(_Model(), u1_home=Tier.NVME, nvme=disk_dir)
    try:
        tensors, _ = _read(save_model_weights(state, tmp_path / "m.safetensors"))
    finally:
        state.manager.close()
    assert torch.equal(tensors["b"], torch.arange(4.0) + 100)
    assert torch.equal(tensors["a"], torch.arange(6.0).reshape(2, 3))


def test_an_error_after_the_rename_is_the_one_raised(tmp_path: Path, monkeypatch) -> None:
    """An interruption landing after the file was renamed into place: the temporary file is
    gone, and its removal must not replace the interruption with a FileNotFoundError."""
    real = os.replace

    def replace_then_interrupt(src, dst):
        real(src, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_model_weights(_state(_Model()), tmp_path / "m.safetensors")
    monkeypatch.undo()
    assert list(_read(tmp_path / "m.safetensors")[0]) == ["a", "frozen", "b", "running"]
