"""The tensor files of every rank of a checkpoint read as one set of whole tensors.

Why: a checkpoint saved at N ranks holds each parameter as slices spread over N files (see
[Note: checkpoints by parameter and slice] in checkpoint/layout.py). A load at M ranks, or an
export, asks for elements of a parameter by its name; ``SlicedReader`` answers from whichever
files hold them, so the loading code reads one "file" whatever N was.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from infinity.checkpoint.directory import checkpoint_directory
from infinity.checkpoint.layout import SLICE_MARK, model_file
from infinity.checkpoint.pinned import PinnedSave, pin_save
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader, TensorInfo

# (first element, element count, reader, file tensor name)
_Slice = tuple[int, int, TensorFileReader, str]


class SlicedReader:
    """Tensors by their whole name over several ``TensorFileReader``s. A file tensor
    ``<name>#<first>`` is elements [first, first + n) of the flattened tensor ``name``, whose
    shape ``shapes`` gives (the manifest's); any other name is a whole tensor.

    ``mixed_dtypes``: the slices of one tensor may have different dtypes (Adam's moments: a
    rank whose state is under 4096 elements keeps fp32 where the others saved int8 codes, see
    [Note: moments in their format in a checkpoint] in checkpoint/moment_files.py); such a
    tensor's ``info`` says float32 and it is read slice by slice (``slices``), not by
    ``read_into``."""

    def __init__(self, readers: Sequence[TensorFileReader], shapes: dict[str, Sequence[int]],
                 what: Path, mixed_dtypes: bool = False) -> None:
        self.readers = list(readers)
        self._slices: dict[str, list[_Slice]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        dtypes: dict[str, torch.dtype] = {}
        for reader in self.readers:
            for file_name, info in reader.tensors.items():
                base, mark, first = file_name.rpartition(SLICE_MARK)
                if mark and first.isdigit() and base in shapes:
                    name, start = base, int(first)
                else:
                    name, start = file_name, 0
                    if name in self.tensors:
                        raise CheckpointError(f"checkpoint {what}: tensor {name} is in two "
                                              "files: the checkpoint is damaged")
                    self.tensors[name] = info
                if dtypes.setdefault(name, info.dtype) != info.dtype and mixed_dtypes:
                    dtypes[name] = torch.float32
                elif dtypes[name] != info.dtype:
                    raise CheckpointError(f"checkpoint {what}: the slices of {name} have two "
                                          f"dtypes ({dtypes[name]}, {info.dtype}): damaged")
                self._slices.setdefault(name, []).append((start, info.numel, reader, file_name))
        for name, slices in self._slices.items():
            slices.sort(key=lambda s: s[0])
            if name in self.tensors:
                continue
            shape = tuple(int(d) for d in shapes[name])
            numel = 1
            for d in shape:
                numel *= d
            cursor = 0
            for start, count, _, _ in slices:
                if start != cursor:
                    raise CheckpointError(
                        f"checkpoint {what}: the slices of {name} leave elements [{cursor}, "
                        f"{start}) of {numel} in no rank's file: a rank's files are missing or "
                        "damaged; load another tag")
                cursor = start + count
            if cursor != numel:
                raise CheckpointError(
                    f"checkpoint {what}: the slices of {name} cover {cursor} of its {numel} "
                    "elements: a rank's files are missing or damaged; load another tag")
            self.tensors[name] = TensorInfo(name, dtypes[name], shape, 0, 0)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"the checkpoint has no tensor {name}") from None

    def slices(self, name: str, start: int = 0, end: int | None = None) -> list[_Slice]:
        """The file slices of ``name`` that hold elements of [start, end), in order (one for
        a whole tensor): (first element, element count, reader, file tensor name)."""
        self.info(name)
        end = self.tensors[name].numel if end is None else end
        return [s for s in self._slices[name] if s[0] < end and start < s[0] + s[1]]

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Fill host tensor ``out`` with elements [start, start + out.numel()) of ``name``."""
        end = start + out.numel()
        self.info(name)
        for first, count, reader, file_name in self._slices[name]:
            a, b = max(start, first), min(end, first + count)
            if a < b:
                reader.read_into(file_name, out[a - start:b - start], a - first)

    def read(self, name: str) -> torch.Tensor:
        info = self.info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        if out.numel():
            self.read_into(name, out.reshape(-1))
        return out

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> "SlicedReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_ranks(save: PinnedSave, names: Sequence[str], shapes: dict[str, Sequence[int]],
               mixed_dtypes: bool = False) -> SlicedReader:
    """The files ``names`` of a pinned checkpoint (one per saving rank) as one
    ``SlicedReader``."""
    readers: list[TensorFileReader] = []
    try:
        for name in names:
            readers.append(save.reader(name))
        return SlicedReader(readers, shapes, save.directory, mixed_dtypes)
    except BaseException:
        for reader in readers:
            reader.close()
        raise


def saved_ranks(manifest: dict[str, Any], directory: Path) -> int:
    """How many ranks saved the checkpoint (each wrote a model and an optim file)."""
    world = manifest.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CheckpointError(f"checkpoint {directory}: its manifest.json has world_size = "
                              f"{world!r}: the manifest was edited or damaged")
    return world


def param_shapes(manifest: dict[str, Any]) -> dict[str, Sequence[int]]:
    """Each saved parameter's full shape, by name (what a slice is a part of)."""
    return {name: p.get("shape", []) for name, p in manifest.get("params", {}).items()
            if isinstance(p, dict)}


def model_files_of(root: Path, tag: str | None, verify_checksums: bool,
                   tag_hint: str = "tag=") -> tuple[PinnedSave, list[str]]:
    """A checkpoint read without an engine: the save pinned (``root`` is a save directory,
    then ``tag`` or ``latest`` picks it, or one checkpoint's directory; the caller closes it)
    and every saving rank's model file, checked against its manifest (sizes; sha256 with
    ``verify_checksums``)."""
    def locate() -> Path:
        directory = checkpoint_directory(root, tag)
        if directory is None:
            raise CheckpointError(f"{root} holds no checkpoint manifest and no 'latest' file; "
                                  f"pass a checkpoint directory or {tag_hint}")
        return directory

    def files_of(save: PinnedSave) -> list[str]:
        return [model_file(r) for r in range(saved_ranks(save.manifest, save.directory))]

    save = pin_save(locate, files_of, verify_checksums)
    assert save is not None
    return save, files_of(save)


def refuse_without_frozen(directory: Path, manifest: dict, what: str, instead: str) -> None:
    """Refuse to make a whole model's weights of a checkpoint saved without its frozen
    parameters (``exclude_frozen_parameters``): a loader would initialize the missing ones at
    random (transformers only lists them as missing)."""
    if manifest.get("frozen_excluded"):
        raise CheckpointError(
            f"{what}: {directory} was saved with exclude_frozen_parameters=True, so it holds "
            "only the trainable parameters, not a whole model; weights made of it would leave "
            "the frozen ones to random initialization. Save a checkpoint without "
            f"exclude_frozen_parameters, or {instead}")
