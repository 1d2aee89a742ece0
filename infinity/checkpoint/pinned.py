"""One save of a checkpoint held open: its manifest and the files it lists, each opened once
through the directory's descriptor, so a load reads the save whose manifest it checked.

Why: a load used to read the manifest and hash the files by path, then open them again by
path; a save of the same tag that swapped the tag's directory in between went unnoticed, and
the load took the counters and ``client_state`` of one save and the weights of the next.

[Note: a load pinned to one save]
* The tag's directory is opened once; the manifest and every file are opened through that
  descriptor (``openat``), so they all come from one directory inode, whatever is renamed onto
  the tag's path meanwhile.
* A committed checkpoint's directory never gets files of another save: a save writes a
  staging directory of its own and exchanges it in (checkpoint/directory.py), then removes
  the old directory's files. So the files opened through one descriptor are one save's.
* Every file a load needs is opened before any is hashed or read; once open, a concurrent
  save cannot change what is read (a removed file stays readable through its descriptor).
  A file already removed when it is opened means a save replaced the tag while it was being
  opened: ``SavedWhileLoading``, and ``pin_save`` opens the tag again (a few times).
* The ranks of one load each pin their own; the load compares their manifests' sha256, and
  refuses when they pinned two saves (checkpoint/load.py).
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any, Callable, Sequence

from infinity.base.log import get_logger
from infinity.checkpoint.directory import MANIFEST, SAVE_ID, parse_manifest
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader, sha256_of_fd

log = get_logger("checkpoint")

ATTEMPTS = 3
"""How many times ``pin_save`` opens a tag that a save keeps replacing before it gives up."""


class SavedWhileLoading(CheckpointError):
    """A save replaced the checkpoint while a load was opening it (nothing was loaded)."""


class PinnedSave:
    """A checkpoint directory opened by descriptor: ``manifest`` and ``open_all`` / ``reader``
    of the files it lists (see [Note: a load pinned to one save])."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fds: dict[str, int] = {}
        try:
            self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SavedWhileLoading(f"checkpoint {directory} disappeared as it was opened: a "
                                    "save of that tag replaced it; load again") from None
        except NotADirectoryError:
            raise CheckpointError(f"{directory} is not a directory: not a checkpoint") from None
        try:
            raw = self._read(MANIFEST)
            self.manifest: dict[str, Any] = parse_manifest(raw, directory / MANIFEST)
            self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
            """Which save this is (the ranks of a load compare it)."""
        except BaseException:
            self.close()
            raise

    def _read(self, name: str) -> bytes:
        fd = self._open(name)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    def _open(self, name: str) -> int:
        if name in self._fds:
            return self._fds[name]
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {self.directory}: {name!r} is not a file name in "
                                  "it: the manifest was edited or damaged")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            if self.replaced():
                raise SavedWhileLoading(
                    f"checkpoint {self.directory} was replaced by another save of that tag "
                    f"while it was being opened ({name} was removed): nothing was loaded; load "
                    "again") from None
            if name == MANIFEST:
                raise CheckpointError(f"{self.directory} has no {MANIFEST}: it is not a "
                                      "checkpoint, or its save did not finish") from None
            raise CheckpointError(f"checkpoint file {self.directory / name} is missing: the "
                                  "checkpoint is incomplete; load another tag") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"checkpoint file {self.directory / name} is not a regular "
                                  "file: the checkpoint is damaged; load another tag")
        self._fds[name] = fd
        return fd

    def replaced(self) -> bool:
        """Whether the directory's path no longer names the directory this holds."""
        try:
            now = os.stat(self.directory)
        except FileNotFoundError:
            return True
        held = os.fstat(self._dir_fd)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def open_all(self, names: Sequence[str]) -> None:
        """Open every file of ``names`` (before any is read: see the Note)."""
        for name in names:
            self._open(name)

    def verify(self, needed: list[str], checksums: bool, share: tuple[int, int] = (0, 1),
               hash_fd: Callable[[int], str] = sha256_of_fd) -> None:
        """The ``needed`` files are listed in the manifest and there with their size (and,
        with ``checksums``, their sha256), before anything is loaded. ``share`` = (rank, world
        size): the ranks of one load divide the hashing, rank r hashing every world-th file
        from the r-th (each file read once in all, not once per rank: 8 ranks resuming a 1 TB
        checkpoint read 1 TB to check it, not 8); the caller makes a failure on any rank fail
        every rank."""
        rank, world = share
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"share must be (rank, world size) with 0 <= rank < world size, "
                             f"got {share}")
        files = self.manifest.get("files", {})
        for name in needed:
            if not isinstance(files, dict) or name not in files:
                raise CheckpointError(f"the manifest of {self.directory} lists no {name}: the "
                                      "checkpoint is damaged; load another tag")
        self.open_all(needed)
        for name in needed:
            size = os.fstat(self._fds[name]).st_size
            if size != files[name]["bytes"]:
                raise CheckpointError(f"checkpoint file {self.directory / name} has {size} bytes, "
                                      f"its manifest says {files[name]['bytes']}: the file is "
                                      "truncated or was changed; load another tag")
        self._check_save_id(needed)
        if not checksums:
            return
        for name in needed[rank::world]:   # one after the other: side by side was slower (measured)
            if hash_fd(self._fds[name]) != files[name]["sha256"]:
                raise CheckpointError(f"checkpoint file {self.directory / name} does not match "
                                      "its sha256 in the manifest: the file is damaged; load "
                                      "another tag")

    def _check_save_id(self, needed: list[str]) -> None:
        """Each of ``needed`` carries the manifest's save id (see [Note: which save a file
        belongs to] in checkpoint/directory.py); a manifest without one (an older save) is
        not checked."""
        expected = self.manifest.get(SAVE_ID)
        if expected is None:
            return
        for name in needed:
            with self.reader(name) as reader:
                found = reader.metadata.get(SAVE_ID)
            if found != expected:
                said = f"carries save {found}'s id" if found else "carries no save id"
                raise CheckpointError(
                    f"checkpoint file {self.directory / name} {said}, not this checkpoint's "
                    f"({expected}, in its manifest.json): it was copied in from another save "
                    "(loading it would mix two saves), or its header is damaged. Put back this "
                    "save's own file, or load another tag")

    def reader(self, name: str) -> TensorFileReader:
        """The tensor file ``name`` of this save (a descriptor of its own, the file's table
        checked)."""
        return TensorFileReader(self.directory / name, fd=os.dup(self._open(name)))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if getattr(self, "_dir_fd", -1) >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> "PinnedSave":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pin_save(locate: Callable[[], Path | None], needed: Callable[[PinnedSave], list[str]],
             checksums: bool, share: tuple[int, int] = (0, 1)) -> PinnedSave | None:
    """The checkpoint ``locate()`` names (None: none to load) pinned, with the files
    ``needed(pin)`` names verified (``PinnedSave.verify``); opened again when a save replaces
    it meanwhile, up to ``ATTEMPTS`` times."""
    for attempt in range(1, ATTEMPTS + 1):
        directory = locate()
        if directory is None:
            return None
        pin = None
        try:
            pin = PinnedSave(directory)
            pin.verify(needed(pin), checksums, share)
            return pin
        except SavedWhileLoading as exc:
            if pin is not None:
                pin.close()
            if attempt == ATTEMPTS:
                raise SavedWhileLoading(f"{exc} (tried {ATTEMPTS} times: is a job saving this "
                                        "tag in a loop?)") from None
            log.warning("%s; opening it again", exc)
        except BaseException:
            if pin is not None:
                pin.close()
            raise
    raise AssertionError("unreachable")
