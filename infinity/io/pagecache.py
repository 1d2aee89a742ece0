"""Page-cache residency and eviction of a file, for proving that direct I/O bypassed the cache and
for cold-read benchmarks (``drop_cached``: fsync + posix_fadvise DONTNEED, no root needed)."""
from __future__ import annotations

import os

from infinity.io import _lib


def resident_pages(path_or_fd: str | os.PathLike[str] | int, offset: int = 0, length: int = 0) -> int:
    """Pages of the file's range [offset, offset+length) in the page cache (length 0: to the end).

    Uses mincore on a read-only shared mapping, which never faults pages in.
    """
    if isinstance(path_or_fd, int):
        return _resident(path_or_fd, offset, length, f"fd {path_or_fd}")
    path = os.fspath(path_or_fd)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _resident(fd, offset, length, path)
    finally:
        os.close(fd)


def _resident(fd: int, offset: int, length: int, what: str) -> int:
    n = _lib.lib().inf_aio_resident_pages(fd, offset, length)
    if n < 0:
        raise OSError(-n, f"checking page-cache residency of {what}: {os.strerror(-n)}")
    return int(n)


def drop_cached(path: str | os.PathLike[str]) -> None:
    """Write back and evict a file's pages from the page cache (clean pages only, as the kernel allows)."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
