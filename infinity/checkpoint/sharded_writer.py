"""Tensors into a transformers weights directory, one save at a time: ``ShardedWriter`` writes
them in order into shards of at most a size (transformers' rule: ``plan_shards``) under hidden
names and commits the whole save at one point, under the directory's save lock (see [Note:
committing a weights directory] in checkpoint/weights_dir.py); ``write_weights`` is one save
through it, over ranks where several gather and rank 0 writes. What the tensors are (an
engine's units, a checkpoint's slices) is checkpoint/pretrained_write.py's."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from infinity.base.sizes import format_bytes
from infinity.checkpoint.pretrained_files import SINGLE_NAME
from infinity.checkpoint.save import RankAgreement
from infinity.checkpoint.tensor_file import TensorFileWriter, itemsize
from infinity.checkpoint.weights_dir import (
    CARRIED_FILES,
    commit_weights,
    fsync_dir,
    partial_path,
    remove_stale_partials,
    replace_with,
    shard_names,
    weight_files,
    write_text,
)
from infinity.checkpoint.writer_lock import SaveLock
from infinity.storage.preflight import free_bytes

Table = list[tuple[str, torch.dtype, tuple[int, ...]]]


def plan_shards(tensors: Table, max_bytes: int) -> list[Table]:
    """The tensors split into files of at most ``max_bytes`` each, in order (transformers'
    rule: a tensor that would take a shard past the size starts the next one)."""
    shards: list[Table] = [[]]
    size = 0
    for name, dtype, shape in tensors:
        n = itemsize(dtype)
        for d in shape:
            n *= d
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dtype, shape))
        size += n
    return shards


class ShardedWriter:
    """Writes ``tensors`` into transformers' sharded layout in ``directory``, in order:
    ``append(name, values)`` as ``TensorFileWriter`` takes them; ``close()`` commits the whole
    save at one point (see [Note: committing a weights directory] in checkpoint/weights_dir.py),
    ``abort()`` leaves the directory as it was. Holds the directory's save lock from
    construction to ``close``/``abort``. ``single_name``: the one file's name when everything
    fits in one (another name than ``model.safetensors`` is a file of its own, renamed into
    place, which no index involves)."""

    def __init__(self, directory: Path, tensors: Table, max_bytes: int,
                 single_name: str = SINGLE_NAME, what: str = "save") -> None:
        self.directory = directory
        self.what = what
        self.plan = plan_shards(tensors, max_bytes)
        self.total = sum(itemsize(d) * numel(s) for _, d, s in tensors)
        _make_directory(directory, what)
        self._lock: SaveLock | None = SaveLock.acquire(directory)
        self._index = -1
        self._writer: TensorFileWriter | None = None
        self._written: list[Path] = []
        self.names: list[str] = []
        try:
            remove_stale_partials(directory)
            self.names = shard_names(len(self.plan), weight_files(directory))
            if len(self.plan) == 1:
                self.names = [single_name]
            self.file_of = {t[0]: file for file, shard in zip(self.names, self.plan)
                            for t in shard}
            headers = sum(4096 + 128 * len(shard) for shard in self.plan)
            check_room(directory, self.total + headers, what)
            self._next()
        except BaseException:
            self.abort()
            raise

    def _partial(self, index: int) -> Path:
        return partial_path(self.directory, self.names[index])

    def _next(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._written.append(self._partial(self._index))
            self._writer = None
        self._index += 1
        while self._index < len(self.plan):
            shard = self.plan[self._index]
            path = self._partial(self._index)
            path.unlink(missing_ok=True)
            self._writer = TensorFileWriter(path, shard, {"format": "pt"})
            if not self._writer.complete:
                return
            self._writer.close()        # only empty tensors: complete already
            self._written.append(path)
            self._writer = None
            self._index += 1

    def append(self, name: str, values: torch.Tensor) -> None:
        if self._writer is None:
            raise ValueError(f"{self.directory}: every tensor is written; got more for {name}")
        self._writer.append(name, values)
        if self._writer.complete:
            self._next()

    def close(self, texts: Mapping[str, str] | None = None,
              carry_from: Path | None = None) -> list[Path]:
        """Write ``texts`` (config.json ...) and the files ``carry_from`` has
        (``write_model_files``), then commit the weights and remove the earlier save's; the
        weight files in place. Releases the lock."""
        if self._writer is not None or self._index < len(self.plan):
            self.abort()
            raise ValueError(f"{self.directory}: not every tensor was written")
        try:
            write_model_files(self.directory, texts or {}, carry_from)
            staged = list(zip(self._written, self.names))
            if len(self.names) == 1 and self.names[0] != SINGLE_NAME:
                os.replace(staged[0][0], self.directory / self.names[0])
                fsync_dir(self.directory)
                final = [self.directory / self.names[0]]
            else:
                index = None if len(self.names) == 1 else {
                    "metadata": {"total_size": self.total},
                    "weight_map": dict(sorted(self.file_of.items()))}
                final = commit_weights(self.directory, staged, index)
        except BaseException:
            self.abort()
            raise
        self._release()
        return final

    def abort(self) -> None:
        """Remove what this save wrote under hidden names; the directory's weights are the
        earlier save's. Releases the lock."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        if self._lock is not None:       # without it, the hidden names may be another writer's
            for i in range(len(self.names)):
                self._partial(i).unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def write_weights(directory: Path, tensors: Table, max_bytes: int,
                  fill: Callable[[ShardedWriter | None], None], *,
                  texts: Mapping[str, str] | None = None, carry_from: Path | None = None,
                  what: str = "save", writes: bool = True,
                  single_name: str = SINGLE_NAME,
                  agreement: RankAgreement | None = None,
                  layout: Callable[[ShardedWriter], Any] | None = None) -> list[Path]:
    """One save into ``directory``: a ``ShardedWriter`` (where ``writes``: rank 0 of
    several) that ``fill`` appends every tensor to, then closed with ``texts`` and the files
    of ``carry_from``; on any failure the hidden files are removed and the earlier save stays
    whole (a full disk says so). ``fill(None)`` is called where this rank writes nothing (it
    takes part in the gathers). ``layout``: what ``fill`` appends to, made of the writer (a
    renaming or splitting layer). The weight files in place ([] without ``writes``).

    [Note: one rank writes while every rank gathers]
    With several ranks (``agreement``) every rank's ``fill`` gathers each unit and rank 0
    writes it. A failure on rank 0 alone (a directory it cannot make, a full disk, a write
    error) must not leave it out of the gathers the others are in: gloo aborts the process on
    the mismatched collective, and the clear error is lost with the training state. So the
    writer is opened where every rank agrees on it (``decided_by_first``) before any gather,
    and a write that fails during ``fill`` aborts the save and is kept, rank 0 going on with
    the gathers (``_FirstWriteFailure``), to be raised once they are over, where the caller's
    agreement tells every rank. The catcher is outermost (over ``layout``'s layer too), so a
    failure while a tensor is renamed or split is kept the same way."""
    opened: list[ShardedWriter] = []

    def open_writer() -> None:
        if writes:
            opened.append(ShardedWriter(directory, tensors, max_bytes, single_name, what))

    if agreement is not None:
        agreement.decided_by_first(open_writer)
    else:
        open_writer()
    writer = opened[0] if opened else None
    need = writer.total if writer is not None else 0
    try:
        target = layout(writer) if writer is not None and layout is not None else writer
        if writer is not None and agreement is not None and agreement.comm is not None:
            sink = _FirstWriteFailure(writer, target)
            fill(sink)              # type: ignore[arg-type]
            sink.raise_failure()
        else:
            fill(target)
        return writer.close(texts, carry_from) if writer is not None else []
    except BaseException as exc:
        if writer is not None:
            writer.abort()
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise full_disk_error(exc, directory, need, what) from exc
        raise


class _FirstWriteFailure:
    """Rank 0's writer while every rank gathers (see [Note: one rank writes while every rank
    gathers]): the first append that fails aborts the save and is kept, the tensors after it
    are dropped, and ``raise_failure`` raises it after ``fill``."""

    def __init__(self, writer: ShardedWriter, target: Any) -> None:
        self.writer, self.target = writer, target    # target: the writer, or a layer over it
        self.failure: Exception | None = None

    def append(self, name: str, values: torch.Tensor) -> None:
        if self.failure is not None:
            return
        try:
            self.target.append(name, values)
        except Exception as exc:  # noqa: BLE001 - raised after the gathers (raise_failure)
            self.failure = exc
            self.writer.abort()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


def _make_directory(directory: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"{what}: cannot create {directory}: {exc.strerror}; choose a "
                                 "writable directory") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"{what}: {directory} is not writable; choose another directory "
                              "or fix its permissions")


def check_room(directory: Path, need: int, what: str) -> None:
    """Refuse, before writing anything, a save that cannot fit in ``directory``'s free space
    (its files are written beside the earlier save's, which stay until the commit)."""
    free = free_bytes(directory)
    if free < need:
        raise OSError(errno.ENOSPC, f"{what} into {directory} needs {format_bytes(need)}, and its "
                                    f"disk has {format_bytes(free)} free; nothing was written "
                                    "and the earlier save there is unchanged: free space or "
                                    "choose another directory")


def full_disk_error(exc: OSError, directory: Path, need: int, what: str) -> OSError:
    """The error of a disk that filled up during a save (the hidden files removed first):
    the directory, the bytes needed and free, and that the earlier save is unchanged."""
    return OSError(exc.errno, f"{what} into {directory}: the disk filled up while writing "
                              f"({exc.strerror}; {format_bytes(need)} needed, "
                              f"{format_bytes(free_bytes(directory))} free now that the partial "
                              "files are removed); the earlier save there is unchanged: free "
                              "space or choose another directory")


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_model_files(directory: Path, texts: Mapping[str, str],
                      carry_from: Path | None) -> None:
    """``config.json`` and the like (``texts``: file name -> its text), then the files of
    ``CARRIED_FILES`` that ``carry_from`` (the directory the model was loaded from) has and
    ``texts`` does not, each replaced atomically."""
    for name, text in texts.items():
        write_text(directory / name, text)
    carry_files(directory, carry_from, written=texts)


def carry_files(directory: Path, carry_from: Path | None, written: Iterable[str] = ()) -> None:
    """The files of ``CARRIED_FILES`` (tokenizer, generation config) that ``carry_from`` (the
    directory the model was loaded from) has, into ``directory``, each replaced atomically;
    those named in ``written`` (the save wrote its own) are left as they are."""
    if carry_from is None or Path(carry_from).resolve() == directory.resolve():
        return
    kept = set(written)
    for name in CARRIED_FILES:
        src = Path(carry_from) / name
        if name not in kept and src.is_file():
            replace_with(directory / name, src.read_bytes())
