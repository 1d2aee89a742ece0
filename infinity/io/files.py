"""``IOFile`` and ``open_direct``: files opened for the aio engine, O_DIRECT unless asked otherwise.

Why a module of its own: opening is where O_DIRECT is refused (tmpfs and some FUSE/overlay
filesystems say EINVAL), and that error has to name the path and its filesystem and say what to do
(use the "mmap" backend or a path on a real disk) before any I/O is attempted.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path
from typing import Literal

Mode = Literal["r", "w", "rw"]
_MODES = ("r", "w", "rw")


class IOFile:
    """An open file for the aio engine: ``path``, ``fd``, ``size`` (live), ``direct``, ``close()``.

    ``align`` is the file offset unit that direct I/O needs (statx DIOALIGN, 4096 when unknown);
    reads/writes need offsets that are multiples of it (and of 512).
    """

    def __init__(self, path: str, fd: int, mode: Mode, direct: bool, align: int) -> None:
        self.path = path
        self.fd = fd
        self.mode = mode
        self.direct = direct
        self.align = align
        self._lock = threading.Lock()
        self._requests: set = set()  # IORequests on this file not yet seen finished

    @property
    def size(self) -> int:
        """Current size of the file in bytes."""
        return os.fstat(self._live_fd()).st_size

    @property
    def closed(self) -> bool:
        return self.fd < 0

    @property
    def readable(self) -> bool:
        return self.mode in ("r", "rw")

    @property
    def writable(self) -> bool:
        return self.mode in ("w", "rw")

    def _live_fd(self) -> int:
        fd = self.fd
        if fd < 0:
            raise ValueError(f"I/O on closed file {self.path}")
        return fd

    def close(self) -> None:
        """Wait for this file's requests in flight, then close the descriptor (idempotent).

        Closing first would let a queued piece reach whatever file reuses the descriptor number.
        """
        with self._lock:
            pending = list(self._requests)
        for req in pending:
            req._finish_quietly()
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def _track(self, req: object, add: bool) -> None:
        with self._lock:
            if add:
                self._requests.add(req)
            else:
                self._requests.discard(req)

    def __enter__(self) -> "IOFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        kind = "direct" if self.direct else "buffered"
        return f"IOFile({self.path!r}, mode={self.mode!r}, {kind}, fd={self.fd})"


def _unescape_mount_field(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes (\040 ...).
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_of(path: str | os.PathLike[str]) -> tuple[str, Path | None]:
    """(filesystem type, mount point) holding ``path`` (or, when it does not exist yet, its
    parent), from the longest /proc/self/mounts entry that is a prefix of whole path components
    (``/mnt/data`` does not hold ``/mnt/data2``); ("unknown", None) when none can be read."""
    real = os.path.realpath(path)
    if not os.path.exists(real):
        real = os.path.dirname(real) or "/"
    best: tuple[str, Path | None] = ("unknown", None)
    best_len = -1
    try:
        with open("/proc/self/mounts") as mounts:
            lines = mounts.readlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount_point = _unescape_mount_field(parts[1])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        # ">=": a later mount over the same point hides the earlier one.
        if inside and len(mount_point) >= best_len:
            best, best_len = (parts[2], Path(mount_point)), len(mount_point)
    return best


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """Filesystem type of the mount holding ``path`` (e.g. "ext4", "tmpfs"); "unknown" if not found."""
    return mount_of(path)[0]


def open_file(path: str | os.PathLike[str], mode: Mode = "r", *, create: bool = False,
              direct: bool = True) -> IOFile:
    """Open ``path`` for the aio engine. ``mode`` "r", "w" or "rw"; ``create`` makes a missing file.

    "w" opens read-write underneath when allowed, because an unaligned tail is written
    read-modify-write; the engine still refuses reads through a "w" file. Never truncates.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    path = os.fspath(path)
    flags = os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    if create:
        if mode == "r":
            raise ValueError(f"create=True needs a writable mode ('w' or 'rw'), got 'r' for {path}")
        flags |= os.O_CREAT
    access = os.O_RDONLY if mode == "r" else os.O_RDWR
    try:
        fd = os.open(path, flags | access, 0o600)
    except PermissionError:
        if mode != "w":
            raise
        fd = os.open(path, flags | os.O_WRONLY, 0o600)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            fs = filesystem_of(path)
            raise OSError(
                errno.EINVAL,
                f"O_DIRECT is not supported for {path} (filesystem {fs}); use the aio backend "
                f"\"mmap\" for this path, or put the file on a real disk (ext4, xfs)") from exc
        raise
    align = 1
    if direct:
        from infinity.io import _lib

        off, mem = ctypes.c_uint32(0), ctypes.c_uint32(0)
        rc = _lib.lib().inf_aio_dio_align(fd, ctypes.byref(off), ctypes.byref(mem))
        align = off.value if rc == 0 and off.value else 4096
    return IOFile(path, fd, mode, direct, align)


def open_direct(path: str | os.PathLike[str], mode: Mode = "r", *, create: bool = False) -> IOFile:
    """Open ``path`` with O_DIRECT (see ``open_file``); a clear error when the filesystem refuses it."""
    return open_file(path, mode, create=create, direct=True)
