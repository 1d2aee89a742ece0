"""Process-wide glibc malloc tuning for out-of-core training (peak RSS).

Why: glibc serves a large allocation with its own mapping, but after such a mapping is freed it
raises its threshold (up to 32 MiB), so the next gradients and activations of that size come
from the heap instead. Freed there, they stay in the process as fragments between longer-lived
blocks. Measured on the 1.04B out-of-core bench (tools/bench/step_timeline.py, 4 steps): with
glibc's adaptive threshold peak RSS climbed 3.87 -> 4.25 GiB; pinned at 4 MiB or 2 MiB it still
crept to 3.93-3.97 GiB (the model's 1 MiB hidden states stayed on the heap); pinned at 1 MiB it
stayed at 3.72 GiB from the second step on. Setting the threshold explicitly also switches
glibc's adaptation off. Other C libraries are left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from infinity.log import get_logger

log = get_logger("memory")

M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter number
GLIBC_MAX_THRESHOLD = 32 << 20  # HEAP_MAX_SIZE / 2 on 64-bit glibc

_applied: int | None = None


def set_mmap_threshold(nbytes: int) -> bool:
    """Pin glibc's mmap threshold at ``nbytes``; False (with a log line) where it cannot be set."""
    global _applied
    if _applied == nbytes:
        return True
    if not 0 < nbytes <= GLIBC_MAX_THRESHOLD:
        raise ValueError(f"malloc_mmap_threshold = {nbytes} bytes: glibc accepts 1 byte to "
                         f"{GLIBC_MAX_THRESHOLD} bytes (32 MiB); use null to leave malloc alone")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None) if libc is not None else None
        version = getattr(libc, "gnu_get_libc_version", None) if libc is not None else None
    except OSError:
        mallopt = version = None
    if mallopt is None or version is None:
        log.info("malloc_mmap_threshold: not a glibc system, malloc left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        log.warning("malloc_mmap_threshold: glibc refused %d bytes; malloc left as it is", nbytes)
        return False
    _applied = nbytes
    log.debug("glibc mmap threshold pinned at %d bytes", nbytes)
    return True
