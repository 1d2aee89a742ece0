"""Preflight of a swap path, before any work: it exists, is a writable directory on a disk (not
memory), O_DIRECT works there, and its free space covers what will be allocated.

Why up front: a run that discovers after an hour of training that its swap path is read-only,
on tmpfs, or too small wastes that hour; and an O_DIRECT failure deep inside the I/O engine says
EINVAL, not "this filesystem does not support direct I/O, use the mmap backend". Every failure is a
``SwapPathError`` (a ValueError, so the CLI prints it as one line and exits 2) that names the path,
the filesystem type and the numbers involved, and says what to do.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from infinity.io.files import mount_of
from infinity.base.sizes import format_bytes

# Filesystems whose "files" are memory: swapping there spends the RAM we are trying to save.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
_PROBE_BYTES = 4096


class SwapPathError(ValueError):
    """The swap path cannot hold swap files (the message names the path, the cause and a remedy)."""


@dataclass(frozen=True)
class PreflightReport:
    """What preflight found out about a swap path."""

    path: Path
    fs_type: str
    """Filesystem type from /proc/mounts ("ext4", "xfs", "tmpfs", ... or "unknown")."""
    mount_point: Path | None
    free_bytes: int
    """Bytes an unprivileged writer may still use there (statvfs f_bavail * f_frsize)."""
    direct_io: bool
    """Whether an O_DIRECT write and read of one page worked (False when not checked)."""


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes that may still be written under ``path`` (statvfs f_bavail * f_frsize)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


NVME_REMEDY = "point nvme_path at a larger disk, or offload less to NVMe"


def check_free_space(path: str | os.PathLike[str], need_bytes: int, what: str = "swap files",
                     remedy: str = NVME_REMEDY) -> int:
    """Raise SwapPathError unless ``need_bytes`` fit on ``path``'s filesystem (``remedy``: what
    to do, for the one asking); returns free bytes."""
    free = free_bytes(path)
    if need_bytes > free:
        fs_type, mount = mount_of(path)
        raise SwapPathError(
            f"not enough free space for {what} in {path}: need {format_bytes(need_bytes)} "
            f"({need_bytes} bytes) but only {format_bytes(free)} ({free} bytes) are free on "
            f"{mount or 'its filesystem'} ({fs_type}); free some space, {remedy}")
    return free


def probe_direct_io(path: str | os.PathLike[str]) -> None:
    """Write and read back one page with O_DIRECT in ``path``; raises OSError when that fails.

    The probe file has a fresh random name, is created with O_EXCL (so it can only be ours) and is
    removed again -- also where O_DIRECT is refused: created with O_DIRECT, the file was made and
    the open then failed (EINVAL), and every start on such a filesystem left one behind.
    """
    probe = Path(path) / f".infinity-probe-{os.getpid()}-{secrets.token_hex(4)}"
    os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
    except BaseException:
        os.unlink(probe)
        raise
    try:
        buf = mmap.mmap(-1, _PROBE_BYTES)  # anonymous mmap: page-aligned, as O_DIRECT needs
        try:
            buf.write(b"infinity-probe".ljust(_PROBE_BYTES, b"\0"))
            if os.pwritev(fd, [buf], 0) != _PROBE_BYTES:
                raise OSError(errno.EIO, f"short O_DIRECT write of the probe {probe}")
            buf.seek(0)
            buf.write(bytes(_PROBE_BYTES))
            if os.preadv(fd, [buf], 0) != _PROBE_BYTES or not buf[:14] == b"infinity-probe":
                raise OSError(errno.EIO, f"O_DIRECT read-back of the probe {probe} did not match")
        finally:
            buf.close()
    finally:
        os.close(fd)
        os.unlink(probe)


def check_swap_path(path: str | os.PathLike[str], need_bytes: int = 0, *, direct_io: bool = True,
                    allow_memory_fs: bool = False) -> PreflightReport:
    """Check that ``path`` can hold ``need_bytes`` of swap files; raise SwapPathError if not.

    ``direct_io=False`` skips the O_DIRECT probe (for the ``mmap`` backend). ``allow_memory_fs``
    accepts tmpfs/ramfs (only sensible in tests: swapping to memory saves no memory).
    """
    path = Path(path)
    if not path.exists():
        raise SwapPathError(f"swap path {path} does not exist; create it (mkdir -p {path}) or "
                            "choose an existing directory on a local disk")
    if not path.is_dir():
        raise SwapPathError(f"swap path {path} is not a directory; give the directory that should "
                            "hold the swap files")
    fs_type, mount = mount_of(path)
    where = f"{path} (filesystem {fs_type}, mounted at {mount or '?'})"
    if fs_type in MEMORY_FILESYSTEMS and not allow_memory_fs:
        raise SwapPathError(
            f"swap path {where} is memory, not a disk: swap files there would use the RAM that "
            "offloading is meant to save; choose a directory on an NVMe/SSD (e.g. /var/tmp or "
            "/local_nvme)")
    if not os.access(path, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        cause = "is on a read-only mount" if read_only else "is not writable by this user"
        raise SwapPathError(f"swap path {where} {cause}; choose a writable directory or fix its "
                            "permissions")
    direct_ok = False
    if direct_io:
        try:
            probe_direct_io(path)
            direct_ok = True
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise SwapPathError(f"swap path {where} is not writable ({os.strerror(exc.errno)}); "
                                    "choose a writable directory") from exc
            if exc.errno == errno.ENOSPC:
                raise SwapPathError(f"swap path {where} is full (no room for a 4 KiB probe); "
                                    "free space or choose another path") from exc
            raise SwapPathError(
                f"O_DIRECT does not work in {where}: {os.strerror(exc.errno or 0)} (errno "
                f"{exc.errno}); use the \"mmap\" I/O backend (aio backend \"mmap\"), or a swap path "
                "on a filesystem with direct I/O (ext4, xfs, btrfs on a local disk)") from exc
    free = check_free_space(path, need_bytes)
    return PreflightReport(path=path, fs_type=fs_type, mount_point=mount, free_bytes=free,
                           direct_io=direct_ok)
