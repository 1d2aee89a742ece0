"""One writer per checkpoint directory at a time: the save lock.

Why: two processes saving into one ``save_dir`` (a scheduler's retry of a job that is still
running, two runs given the same output path) used to share a tag's staging directory, delete
each other's files while writing, and commit a mix of both: no loadable checkpoint was left
while both reported success. Each save now holds ``save_dir/.infinity-save.lock`` from its
first file to its ``latest``, and a second writer is refused with the owner's name.

[Note: save lock]
* The lock is an exclusive ``flock`` on the lock file, which the kernel drops when its process
  dies however it dies; the file also holds the owner (pid, start time, boot id, hostname,
  as a swap directory's marker does) so that a refusal can name it, and so that filesystems
  without flock can still judge the owner. Who is alive is decided by
  ``storage.swap_dir.judge_owner``: the same rules as for a swap directory, not a copy.
* The file is created with O_NOFOLLOW and removed (through the directory's fd) by its holder
  before the lock is dropped; a writer that locked a file someone removed meanwhile sees that
  its inode is no longer the path's and tries again, so two writers never both hold it.
* A lock whose owner is dead (killed with kill -9, a node that rebooted) is taken over; one
  whose owner may live (alive here, or on another host that shares the filesystem) is not,
  and the error says how to tell and what to remove if that job is in fact gone.
* Per save, not per run: taken by ``save_checkpoint`` and released when it returns or
  fails, so runs that take turns in one directory (a resume, a second engine of the same
  process) are not refused; only overlapping saves are. Two threads of one process saving
  at once are two writers too (the flock is per open file).
* The ranks of one job are one writer: rank 0 takes the lock and names the staging
  directory; the other ranks write into it and rank 0 commits (see checkpoint/directory.py).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
from dataclasses import asdict
from pathlib import Path

from infinity.checkpoint.tensor_file import CheckpointError
from infinity.base.log import get_logger
from infinity.storage.swap_dir import Liveness, Owner, judge_owner

log = get_logger("checkpoint")

LOCK_NAME = ".infinity-save.lock"
LOCK_FORMAT = "infinity-save-lock/1"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class SaveDirBusyError(CheckpointError):
    """Another live process is saving into this checkpoint directory."""


def _read_owner(fd: int) -> Owner | None:
    """The owner a lock file names, or None when it is empty or not one of ours (a writer
    killed between creating and filling it)."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        data = json.loads(text)
        if data.get("format") != LOCK_FORMAT:
            return None
        o = data["owner"]
        return Owner(pid=int(o["pid"]), boot_id=str(o["boot_id"]),
                     start_time=int(o["start_time"]), rank=int(o["rank"]),
                     hostname=str(o["hostname"]))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _describe(owner: Owner | None) -> str:
    if owner is None:
        return "a process whose lock file says nothing yet"
    return f"pid {owner.pid} on host {owner.hostname!r}"


class SaveLock:
    """The save lock of one checkpoint directory, held by this process (see the Note)."""

    def __init__(self, save_dir: Path, dir_fd: int, fd: int, owner: Owner) -> None:
        self.save_dir = save_dir
        self.owner = owner
        self._dir_fd = dir_fd
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    @classmethod
    def acquire(cls, save_dir: Path) -> SaveLock:
        """Take the lock of ``save_dir`` (an existing directory), or raise SaveDirBusyError
        naming the live owner."""
        # the save_dir is the user's to name, a symbolic link to a scratch disk included
        dir_fd = os.open(save_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for _ in range(100):
                lock = cls._try_once(save_dir, dir_fd)
                if lock is not None:
                    return lock
            raise SaveDirBusyError(f"could not take the save lock {save_dir / LOCK_NAME}: it kept "
                                   "being replaced; is another job saving here in a loop?")
        except BaseException:
            os.close(dir_fd)
            raise

    @classmethod
    def _try_once(cls, save_dir: Path, dir_fd: int) -> SaveLock | None:
        path = save_dir / LOCK_NAME
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(f"{path} is a symbolic link; it is left alone: remove it "
                                      "(infinity creates this file itself)") from None
            raise OSError(exc.errno, f"cannot create the save lock {path}: {exc.strerror}") from exc
        try:
            lock_held: bool | None = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                raise SaveDirBusyError(
                    f"{save_dir} is being saved into by another process ({_describe(owner)}), "
                    f"which holds {path}: one writer per checkpoint directory at a time. Stop "
                    "that job, or save this one to another save_dir") from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                lock_held = None      # no flock here: the owner's pid alone decides
            if not _is_the_path(fd, dir_fd):
                os.close(fd)          # its holder removed it meanwhile: take the new one
                return None
            me = Owner.of_this_process(rank=0)
            previous = _read_owner(fd)
            if previous is not None and previous != me:
                state, reason = judge_owner(previous, lock_held)
                if state is not Liveness.DEAD:
                    raise SaveDirBusyError(
                        f"{save_dir} may be in use by another writer ({_describe(previous)}): "
                        f"{reason}. One writer per checkpoint directory at a time: stop that "
                        f"job, or save to another save_dir; if you know it is gone, remove {path}")
                log.info("taking over the save lock of %s from a dead writer (%s)", save_dir,
                         reason)
            text = json.dumps({"format": LOCK_FORMAT, "owner": asdict(me)}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, text, 0)
            os.fsync(fd)
            return cls(save_dir, dir_fd, fd, me)
        except BaseException:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise

    def release(self) -> None:
        """Remove the lock file, then drop the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if _is_the_path(fd, self._dir_fd):
                os.unlink(LOCK_NAME, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
            os.close(self._dir_fd)

    def __enter__(self) -> SaveLock:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.release()
            return
        try:
            self.release()
        except OSError as failed:   # the save's own failure is the one to report
            log.warning("could not remove the save lock's file %s after the save failed: %s "
                        "(the lock itself is dropped; the next writer takes the file over)",
                        LOCK_NAME, failed)


def _is_the_path(fd: int, dir_fd: int) -> bool:
    """Whether the open lock file is still the one its name points to."""
    try:
        named = os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
