"""ctypes declarations of the native aio component (``native/include/inf_aio.h``), declared once.

Kept apart from the engine so that every module of ``infinity.io`` (engine, buffers, page-cache
helpers) shares one set of argtypes; ctypes releases the GIL during each of these calls.
"""
from __future__ import annotations

import ctypes

from infinity.base import native_library

BACKENDS = {"auto": 0, "io_uring": 1, "libaio": 2, "threads": 3, "mmap": 4}
BACKEND_NAMES = {v: k for k, v in BACKENDS.items()}
OP_READ = 0
OP_WRITE = 1


class AioConfigStruct(ctypes.Structure):
    """Mirror of ``struct inf_aio_config``."""

    _fields_ = [
        ("backend", ctypes.c_int),
        ("queue_depth", ctypes.c_uint32),
        ("thread_count", ctypes.c_uint32),
        ("block_size", ctypes.c_uint64),
        ("single_submit", ctypes.c_int),
        ("overlap_events", ctypes.c_int),
    ]


def _signatures() -> dict:
    vp, u32, u64, i64, c_int = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
    return {
        "inf_aio_backend_available": (c_int, [c_int]),
        "inf_aio_backend_name": (ctypes.c_char_p, [c_int]),
        "inf_aio_create": (c_int, [ctypes.POINTER(AioConfigStruct), ctypes.POINTER(vp)]),
        "inf_aio_backend": (c_int, [vp]),
        "inf_aio_destroy": (c_int, [vp]),
        "inf_aio_submit": (c_int, [vp, c_int, c_int, u32, vp, u64, u64, ctypes.POINTER(vp)]),
        "inf_aio_req_done": (c_int, [vp]),
        "inf_aio_req_wait": (c_int, [vp, i64]),
        "inf_aio_req_result": (i64, [vp, ctypes.POINTER(u64)]),
        "inf_aio_req_free": (c_int, [vp]),
        "inf_aio_dio_align": (c_int, [c_int, ctypes.POINTER(u32), ctypes.POINTER(u32)]),
        "inf_aio_resident_pages": (i64, [c_int, u64, u64]),
        "inf_aio_buf_alloc": (c_int, [u64, u64, ctypes.POINTER(vp)]),
        "inf_aio_buf_free": (c_int, [vp, u64]),
    }


def lib() -> ctypes.CDLL:
    """The native library with the inf_aio_* signatures declared."""
    return native_library.declare("async I/O", _signatures)


def backend_available(name: str) -> bool:
    """Whether the named backend works in this process (the kernel accepts it)."""
    return bool(lib().inf_aio_backend_available(BACKENDS[name]))
