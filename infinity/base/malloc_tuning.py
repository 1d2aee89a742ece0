"""Process-wide glibc malloc tuning for out-of-core training (peak RSS).

Why: glibc serves a large allocation with its own mapping, but after such a mapping is freed it
raises its threshold (up to 32 MiB), so the next gradients and activations of that size come
from the heap instead. Freed there, they stay in the process as fragments between longer-lived
blocks. Measured on the out-of-core bench model (tools/bench/step_timeline.py): at 1.04B, with
glibc's adaptive threshold peak RSS climbed 3.87 -> 4.25 GiB over four steps; pinned at 4 MiB
it crept to 3.97 GiB, and pinned at 4 MiB with the heap trimmed after each step (``trim``) it
stayed at 3.84-3.87 GiB over five. At 0.49B the same setting was also the fastest (8.4-8.8 s a
step against 9.2-9.9 s adaptive and 9.1-10.2 s at 1 MiB, where every 1 MiB hidden state is
mapped and faulted in afresh). Setting the threshold explicitly also switches glibc's
adaptation off. Other C libraries are left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from infinity.base.log import get_logger

log = get_logger("memory")

M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter number
GLIBC_MAX_THRESHOLD = 32 << 20  # HEAP_MAX_SIZE / 2 on 64-bit glibc

_applied: int | None = None


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``gnu_get_libc_version``), else None; loaded once."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            lib = None
        _libc = lib if lib is not None and hasattr(lib, "gnu_get_libc_version") else False
    return _libc or None


def set_mmap_threshold(nbytes: int) -> bool:
    """Pin glibc's mmap threshold at ``nbytes``; False (with a log line) where it cannot be set."""
    global _applied
    if _applied == nbytes:
        return True
    if not 0 < nbytes <= GLIBC_MAX_THRESHOLD:
        raise ValueError(f"malloc_mmap_threshold = {nbytes} bytes: glibc accepts 1 byte to "
                         f"{GLIBC_MAX_THRESHOLD} bytes (32 MiB); use null to leave malloc alone")
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        log.info("malloc_mmap_threshold: not a glibc system, malloc left as it is")
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if libc.mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        log.warning("malloc_mmap_threshold: glibc refused %d bytes; malloc left as it is", nbytes)
        return False
    _applied = nbytes
    log.debug("glibc mmap threshold pinned at %d bytes", nbytes)
    return True


def trim() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``); no-op elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


_libc: ctypes.CDLL | bool | None = None   # False: not glibc
