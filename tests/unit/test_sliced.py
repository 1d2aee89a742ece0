"""The rank files of a checkpoint read as whole tensors (checkpoint/sliced.py) at unit level, on
real tensor files: slices put
together in any file order, every way a set of slices can fail to make a tensor, names that
only look like slices, the manifest's world size and shapes, and a checkpoint's model files
found and checked without an engine."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from infinity.checkpoint.directory import FORMAT, MANIFEST, VERSION
from infinity.checkpoint.pinned import PinnedSave
from infinity.checkpoint.sliced import (
    SlicedReader, model_files_of, open_ranks, param_shapes, saved_ranks)
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader, TensorFileWriter

W = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 0.5


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    writer = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for name, values in tensors.items():
        if values.numel():
            writer.append(name, values.reshape(-1))
    writer.close()
    return path


_NAMES = itertools.count()


def _readers(tmp_path: Path, *files: dict[str, torch.Tensor]) -> list[TensorFileReader]:
    return [TensorFileReader(_write(tmp_path / f"f{next(_NAMES)}", f)) for f in files]


def _open_fds() -> set[int]:
    return set(os.listdir("/proc/self/fd"))


def test_slices_in_any_file_order_read_as_the_whole_tensor(tmp_path: Path) -> None:
    """``w#5`` in the first file, ``w#0`` in the second: ``w`` reads whole, with the
    manifest's shape and the files' dtype; whole tensors are read as they are."""
    flat = W.reshape(-1)
    readers = _readers(tmp_path, {"w#5": flat[5:], "buf": torch.tensor([7, 8])},
                       {"w#0": flat[:5]})
    with SlicedReader(readers, {"w": [3, 4]}, tmp_path) as reader:
        assert set(reader.tensors) == {"w", "buf"}
        info = reader.info("w")
        assert (info.name, info.dtype, info.shape) == ("w", torch.float32, (3, 4))
        assert torch.equal(reader.read("w"), W)
        assert torch.equal(reader.read("buf"), torch.tensor([7, 8]))
        assert reader.info("buf") is readers[0].tensors["buf"]
        part = torch.zeros(4)
        reader.read_into("w", part, 3)                 # across the two files
        assert torch.equal(part, flat[3:7])
        reader.read_into("w", part, 8)                 # inside the second slice
        assert torch.equal(part, flat[8:12])
        one = torch.zeros(1)
        reader.read_into("w", one, 4)                  # the last element of the first slice
        assert one.item() == flat[4].item()
        reader.read_into("w", one)                     # from element 0 by default
        assert one.item() == flat[0].item()
    assert all(r._fd < 0 for r in readers)             # closed on leaving the block


def test_a_tensor_of_no_elements_reads_empty(tmp_path: Path) -> None:
    readers = _readers(tmp_path, {"e": torch.zeros(0, 3)})
    reader = SlicedReader(readers, {}, tmp_path)
    got = reader.read("e")
    assert got.shape == (0, 3) and got.dtype == torch.float32
    reader.close()
    assert readers[0]._fd < 0


def test_names_that_only_look_like_slices_are_whole_tensors(tmp_path: Path) -> None:
    """A ``#`` name is a slice only when what follows is digits and what precedes it is a
    parameter of the manifest (the last ``#`` counts)."""
    readers = _readers(tmp_path, {"x#3": torch.ones(2), "w#a": torch.ones(1),
                                  "a#b#0": torch.arange(4.0)})
    reader = SlicedReader(readers, {"w": [1], "a#b": [2, 2]}, tmp_path)
    assert set(reader.tensors) == {"x#3", "w#a", "a#b"}
    assert torch.equal(reader.read("x#3"), torch.ones(2))
    assert torch.equal(reader.read("a#b"), torch.arange(4.0).reshape(2, 2))
    with pytest.raises(CheckpointError) as info:
        reader.info("w")
    assert str(info.value) == "the checkpoint has no tensor w"


def test_a_gap_between_slices_names_the_missing_elements(tmp_path: Path) -> None:
    flat = W.reshape(-1)
    readers = _readers(tmp_path, {"w#0": flat[:4]}, {"w#6": flat[6:]})
    with pytest.raises(CheckpointError) as info:
        SlicedReader(readers, {"w": (3, 4)}, tmp_path / "ck")
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'ck'}: the slices of w leave elements [4, 6) of 12 in no "
        "rank's file: a rank's files are missing or damaged; load another tag")


def test_a_first_slice_missing_or_slices_overlapping_are_refused(tmp_path: Path) -> None:
    flat = W.reshape(-1)
    with pytest.raises(CheckpointError, match=r"leave elements \[0, 2\) of 12"):
        SlicedReader(_readers(tmp_path, {"w#2": flat[2:]}), {"w": [3, 4]}, tmp_path)
    with pytest.raises(CheckpointError, match=r"leave elements \[6, 4\) of 12"):
        SlicedReader(_readers(tmp_path, {"w#0": flat[:6]}, {"w#4": flat[4:]}),
                     {"w": [3, 4]}, tmp_path)


def test_two_slices_from_the_same_element_are_refused_as_damage(tmp_path: Path) -> None:
    """Two rank files holding the same slice (a rank's file copied over another's): a
    CheckpointError, not a TypeError from comparing the readers while ordering the slices."""
    flat = W.reshape(-1)
    readers = _readers(tmp_path, {"w#0": flat[:6]}, {"w#0": flat[:6]}, {"w#6": flat[6:]})
    with pytest.raises(CheckpointError) as info:
        SlicedReader(readers, {"w": [3, 4]}, tmp_path)
    assert str(info.value).startswith(f"checkpoint {tmp_path}: the slices of w leave elements "
                                      "[6, 0) of 12")


def test_slices_short_of_the_shape_are_refused(tmp_path: Path) -> None:
    flat = W.reshape(-1)
    readers = _readers(tmp_path, {"w#0": flat[:5]}, {"w#5": flat[5:10]})
    with pytest.raises(CheckpointError) as info:
        SlicedReader(readers, {"w": [3, 4]}, tmp_path)
    assert str(info.value) == (
        f"checkpoint {tmp_path}: the slices of w cover 10 of its 12 elements: a rank's files "
        "are missing or damaged; load another tag")
    # a tensor of no elements needs no slice, and a shape of one element one of one element
    reader = SlicedReader(_readers(tmp_path, {"s#0": torch.ones(1)}), {"s": [1, 1]}, tmp_path)
    assert reader.info("s").shape == (1, 1)


def test_a_whole_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    readers = _readers(tmp_path, {"buf": torch.ones(2)}, {"buf": torch.ones(2)})
    with pytest.raises(CheckpointError) as info:
        SlicedReader(readers, {}, tmp_path)
    assert str(info.value) == (f"checkpoint {tmp_path}: tensor buf is in two files: the "
                               "checkpoint is damaged")


def test_slices_of_two_dtypes_are_refused(tmp_path: Path) -> None:
    flat = W.reshape(-1)
    readers = _readers(tmp_path, {"w#0": flat[:6]}, {"w#6": flat[6:].to(torch.bfloat16)})
    with pytest.raises(CheckpointError) as info:
        SlicedReader(readers, {"w": [3, 4]}, tmp_path)
    assert str(info.value) == (f"checkpoint {tmp_path}: the slices of w have two dtypes "
                               "(torch.float32, torch.bfloat16): damaged")


def _pinned(directory: Path) -> PinnedSave:
    """``directory`` pinned as a checkpoint (a manifest listing no files)."""
    (directory / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION}))
    return PinnedSave(directory)


def test_open_ranks_reads_the_named_files_as_one(tmp_path: Path) -> None:
    flat = W.reshape(-1)
    _write(tmp_path / "r0", {"w#0": flat[:7]})
    _write(tmp_path / "r1", {"w#7": flat[7:]})
    with _pinned(tmp_path) as save, open_ranks(save, ["r0", "r1"], {"w": [3, 4]}) as reader:
        assert [r.path for r in reader.readers] == [tmp_path / "r0", tmp_path / "r1"]
        assert torch.equal(reader.read("w"), W)


def test_open_ranks_closes_what_it_opened_when_a_file_fails(tmp_path: Path) -> None:
    """A missing rank file or slices that do not make a tensor: every reader opened before is
    closed (no fd left behind), and the error is the reader's."""
    flat = W.reshape(-1)
    _write(tmp_path / "r0", {"w#0": flat[:7]})
    save = _pinned(tmp_path)
    save.open_all(["r0"])
    before = _open_fds()
    with pytest.raises(CheckpointError, match="r1 is missing"):
        open_ranks(save, ["r0", "r1"], {"w": [3, 4]})
    assert _open_fds() == before
    with pytest.raises(CheckpointError) as info:
        open_ranks(save, ["r0"], {"w": [3, 4]})
    assert str(info.value).startswith(f"checkpoint {tmp_path}: the slices of w cover 7 of its 12")
    assert _open_fds() == before
    save.close()


def test_saved_ranks_is_the_manifests_world_size() -> None:
    assert saved_ranks({}, Path("ck")) == 1
    assert saved_ranks({"world_size": 1}, Path("ck")) == 1
    assert saved_ranks({"world_size": 3}, Path("ck")) == 3
    for bad in (0, -2, True, False, "2", 2.0, None):
        with pytest.raises(CheckpointError) as info:
            saved_ranks({"world_size": bad}, Path("ck"))
        assert str(info.value) == (f"checkpoint ck: its manifest.json has world_size = {bad!r}: "
                                   "the manifest was edited or damaged")


def test_param_shapes_are_the_manifests_shapes_by_name() -> None:
    manifest = {"params": {"w": {"shape": [3, 4]}, "b": {}, "odd": [1, 2], "s": {"shape": []}}}
    assert param_shapes(manifest) == {"w": [3, 4], "b": [], "s": []}
    assert param_shapes({}) == {}


def _checkpoint(directory: Path, world: int = 2) -> dict:
    directory.mkdir(parents=True)
    files = {}
    for r in range(world):
        path = _write(directory / f"rank{r}_model.safetensors", {f"w#{r}": torch.ones(1)})
        data = path.read_bytes()
        files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": FORMAT, "version": VERSION, "world_size": world, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_model_files_of_a_checkpoint_directory_or_a_save_dir(tmp_path: Path) -> None:
    """A checkpoint's own directory, or a save directory with ``latest`` or a tag: its
    directory, manifest and every saving rank's model file."""
    manifest = _checkpoint(tmp_path / "step3")
    want = (tmp_path / "step3", manifest, ["rank0_model.safetensors", "rank1_model.safetensors"])

    def found(*args) -> tuple:
        save, files = model_files_of(*args)
        with save:
            return save.directory, save.manifest, files

    assert found(tmp_path / "step3", None, True) == want
    assert found(tmp_path, "step3", True) == want
    (tmp_path / "latest").write_text("step3\n")
    assert found(tmp_path, None, False) == want


def test_model_files_of_a_directory_without_a_checkpoint_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        model_files_of(tmp_path, None, True)
    assert str(info.value) == (f"{tmp_path} holds no checkpoint manifest and no 'latest' file; "
                               "pass a checkpoint directory or tag=")
    with pytest.raises(CheckpointError) as info:
        model_files_of(tmp_path, None, True, tag_hint="--tag")
    assert str(info.value).endswith("pass a checkpoint directory or --tag")


def test_model_files_of_checks_sizes_and_checksums_only_when_asked(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ck", world=1)
    path = tmp_path / "ck" / "rank0_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF                                    # same size, other bytes
    path.write_bytes(bytes(data))
    save, files = model_files_of(tmp_path / "ck", None, False)
    save.close()
    assert files == ["rank0_model.safetensors"]
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        model_files_of(tmp_path / "ck", None, True)
    path.write_bytes(bytes(data) + b"x")
    with pytest.raises(CheckpointError, match="bytes, its manifest says"):
        model_files_of(tmp_path / "ck", None, False)


def test_model_files_of_refuses_a_bad_world_size(tmp_path: Path) -> None:
    manifest = _checkpoint(tmp_path / "ck", world=1)
    manifest["world_size"] = 0
    (tmp_path / "ck" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        model_files_of(tmp_path / "ck", None, False)
    assert str(info.value).startswith(f"checkpoint {tmp_path / 'ck'}: its manifest.json has "
                                      "world_size = 0")
