"""infinity.io: the asynchronous I/O engine between aligned host buffers and (swap) files.

    from infinity.io import AioConfig, AioEngine, IORequest, wait_all, aligned_empty, open_direct
"""
from infinity.io.aio import AioEngine, IORequest, wait_all
from infinity.io.buffers import aligned_empty
from infinity.config.aio import AioConfig  # the one AioConfig (the config's "aio" section)
from infinity.io.files import IOFile, filesystem_of, open_direct, open_file
from infinity.io.pagecache import drop_cached, resident_pages


def backend_available(name: str) -> bool:
    """Whether backend ``name`` ("io_uring", "libaio", "threads", "mmap") works in this process."""
    from infinity.io import _lib

    if name not in _lib.BACKENDS or name == "auto":
        raise ValueError(f"unknown aio backend {name!r}; choose from io_uring, libaio, threads, mmap")
    return _lib.backend_available(name)


__all__ = [
    "AioConfig", "AioEngine", "IORequest", "IOFile", "wait_all", "aligned_empty", "open_direct",
    "open_file", "filesystem_of", "resident_pages", "drop_cached", "backend_available",
]
