"""A load pinned to one save (checkpoint/pinned.py): the manifest and the files it verifies are
the ones it reads, whatever a concurrent save renames onto the tag's path."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from infinity.checkpoint import CheckpointError
from infinity.checkpoint import directory as d
from infinity.checkpoint import pinned
from infinity.checkpoint.pinned import PinnedSave, SavedWhileLoading, pin_save
from infinity.checkpoint.tensor_file import TensorFileWriter

NAME = "rank0_model.safetensors"


def _save(directory: Path, value: float, step: int) -> Path:
    """A one-file checkpoint whose tensor is ``value`` and whose manifest says ``step``."""
    directory.mkdir(parents=True)
    writer = TensorFileWriter(directory / NAME, [("w", torch.float32, (4,))])
    writer.append("w", torch.full((4,), value))
    nbytes, digest = writer.close()
    (directory / d.MANIFEST).write_text(json.dumps({
        "format": d.FORMAT, "version": d.VERSION, "global_steps": step,
        "files": {NAME: {"bytes": nbytes, "sha256": digest}}}))
    return directory


def _resave(save_dir: Path, tag: str, value: float, step: int) -> None:
    """What a save of an existing tag does: a staged directory exchanged in, the old files
    removed (checkpoint/directory.py ``commit``)."""
    staging = _save(save_dir / f".{tag}.partial.0000abcd", value, step)
    d.commit(staging, save_dir, tag)


def test_a_resave_after_the_pin_changes_nothing_the_load_reads(tmp_path: Path) -> None:
    tag = _save(tmp_path / "t", 1.0, step=1)
    with PinnedSave(tag) as save:
        save.verify([NAME], checksums=True)
        _resave(tmp_path, "t", 2.0, step=2)        # the old files are removed by now
        assert json.loads((tmp_path / "t" / d.MANIFEST).read_text())["global_steps"] == 2
        assert save.replaced()
        reader = save.reader(NAME)
        try:
            assert save.manifest["global_steps"] == 1
            assert torch.equal(reader.read("w"), torch.full((4,), 1.0))   # not the new 2.0
        finally:
            reader.close()
    with PinnedSave(tmp_path / "t") as save:
        save.verify([NAME], checksums=True)
        assert save.manifest["global_steps"] == 2 and not save.replaced()


def test_a_file_removed_by_a_resave_before_it_is_opened_says_a_save_happened(tmp_path: Path) -> None:
    tag = _save(tmp_path / "t", 1.0, step=1)
    save = PinnedSave(tag)            # the manifest of save 1 read; its tensor file not yet open
    try:
        _resave(tmp_path, "t", 2.0, step=2)
        with pytest.raises(SavedWhileLoading, match="replaced by another save of that tag while "
                                                    "it was being opened .*load again"):
            save.verify([NAME], checksums=False)
    finally:
        save.close()


def test_pin_save_opens_the_tag_again_when_a_save_replaced_it(tmp_path: Path, monkeypatch) -> None:
    _save(tmp_path / "t", 1.0, step=1)
    resaves = iter([3.0, 4.0, 5.0, 6.0])
    real_open = PinnedSave._open

    def resave_before_the_tensor_file(self, name):
        if name == NAME and name not in self._fds and (value := next(resaves, None)) is not None:
            _resave(tmp_path, "t", value, step=int(value))
        return real_open(self, name)

    monkeypatch.setattr(PinnedSave, "_open", resave_before_the_tensor_file)
    with pytest.raises(SavedWhileLoading, match=f"tried {pinned.ATTEMPTS} times"):
        pin_save(lambda: tmp_path / "t", lambda s: [NAME], checksums=True)
    # the saves stop: the next attempt pins the last one whole
    monkeypatch.setattr(pinned, "ATTEMPTS", 2)
    resaves = iter([7.0])
    save = pin_save(lambda: tmp_path / "t", lambda s: [NAME], checksums=True)
    with save:
        assert save.manifest["global_steps"] == 7
        with save.reader(NAME) as reader:
            assert torch.equal(reader.read("w"), torch.full((4,), 7.0))


def test_verify_checks_listing_presence_kind_size_and_checksum(tmp_path: Path) -> None:
    data = b"0123456789"
    for name in ("rank0_model.safetensors", "rank0_optim.safetensors"):
        (tmp_path / name).write_bytes(data)
    good = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    files = {"rank0_model.safetensors": good, "rank0_optim.safetensors": dict(good)}
    needed = ["rank0_model.safetensors", "rank0_optim.safetensors"]

    def verify(checksums: bool, names: list[str]) -> None:
        (tmp_path / d.MANIFEST).write_text(json.dumps(
            {"format": d.FORMAT, "version": d.VERSION, "files": files}))
        with PinnedSave(tmp_path) as save:
            save.verify(names, checksums)

    verify(True, needed)
    with pytest.raises(CheckpointError, match=f"the manifest of {tmp_path} lists no rank1_model"):
        verify(False, ["rank1_model.safetensors"])
    files["rank1_model.safetensors"] = good
    with pytest.raises(CheckpointError,
                       match=f"checkpoint file {tmp_path / 'rank1_model.safetensors'} is missing"):
        verify(False, ["rank1_model.safetensors"])
    (tmp_path / "rank1_model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="is not a regular file"):
        verify(False, ["rank1_model.safetensors"])
    files["rank0_optim.safetensors"]["bytes"] = 11
    with pytest.raises(CheckpointError) as info:
        verify(False, needed)
    assert (f"checkpoint file {tmp_path / 'rank0_optim.safetensors'} has 10 bytes, its manifest "
            "says 11: the file is truncated or was changed") in str(info.value)
    files["rank0_optim.safetensors"] = {"bytes": 10, "sha256": "0" * 64}
    verify(False, needed)
    with pytest.raises(CheckpointError) as info:
        verify(True, needed)
    assert (f"checkpoint file {tmp_path / 'rank0_optim.safetensors'} does not match its sha256 "
            "in the manifest") in str(info.value)


def test_a_manifest_naming_a_path_is_refused_and_opens_nothing_outside(tmp_path: Path) -> None:
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    tag = tmp_path / "t"
    tag.mkdir()
    (tag / d.MANIFEST).write_text(json.dumps({"format": d.FORMAT, "version": d.VERSION,
                                              "files": {"../outside.safetensors": {"bytes": 1}}}))
    with PinnedSave(tag) as save, pytest.raises(CheckpointError, match="is not a file name in it"):
        save.verify(["../outside.safetensors"], checksums=False)


def test_close_closes_every_descriptor(tmp_path: Path) -> None:
    tag = _save(tmp_path / "t", 1.0, step=1)
    before = set(os.listdir("/proc/self/fd"))
    save = PinnedSave(tag)
    save.verify([NAME], checksums=True)
    save.reader(NAME).close()
    save.close()
    save.close()      # twice is harmless
    assert set(os.listdir("/proc/self/fd")) == before
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        PinnedSave(tmp_path)


def test_a_file_of_another_save_is_refused_with_or_without_checksums(tmp_path: Path) -> None:
    """[Note: which save a file belongs to]: the same tensors, the same size, another save's
    id (or none) in its header: refused naming both ids, checksums verified or not; a manifest
    without an id (an older save) is not checked."""
    def save(directory: Path, value: float, save_id: str | None) -> dict:
        directory.mkdir()
        # without an id, another key of the same length: the file keeps the same size
        meta = {d.SAVE_ID: save_id} if save_id else {"no_save": "c" * 32}
        writer = TensorFileWriter(directory / NAME, [("w", torch.float32, (4,))],
                                  {"format": d.FORMAT, **meta})
        writer.append("w", torch.full((4,), value))
        nbytes, digest = writer.close()
        manifest = {"format": d.FORMAT, "version": d.VERSION,
                    "files": {NAME: {"bytes": nbytes, "sha256": digest}}}
        if save_id:
            manifest[d.SAVE_ID] = save_id
        (directory / d.MANIFEST).write_text(json.dumps(manifest))
        return manifest

    ours, theirs = "a" * 32, "b" * 32
    save(tmp_path / "one", 1.0, ours)
    save(tmp_path / "two", 2.0, theirs)
    with PinnedSave(tmp_path / "one") as pin:
        pin.verify([NAME], checksums=True)
    os.replace(tmp_path / "two" / NAME, tmp_path / "one" / NAME)
    for checksums in (False, True):
        with PinnedSave(tmp_path / "one") as pin, pytest.raises(CheckpointError) as info:
            pin.verify([NAME], checksums)
        assert f"carries save {theirs}'s id, not this checkpoint's ({ours}" in str(info.value)
    save(tmp_path / "old", 3.0, None)        # an older save: no id anywhere, loads as before
    with PinnedSave(tmp_path / "old") as pin:
        pin.verify([NAME], checksums=False)
    os.replace(tmp_path / "old" / NAME, tmp_path / "one" / NAME)
    with PinnedSave(tmp_path / "one") as pin, pytest.raises(CheckpointError, match="carries no save id"):
        pin.verify([NAME], checksums=False)
