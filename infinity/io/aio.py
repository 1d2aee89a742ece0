"""``AioEngine``: asynchronous reads and writes between host buffers and files, as futures.

The native engine (native/src/aio_*.c) does the work: it splits each request into ``block_size``
pieces and keeps ``queue_depth`` of them in flight per lane. This module validates every request
before any I/O (alignment, modes, sizes: a ValueError or OSError that names the values), keeps each
buffer alive until its request is observed finished, and turns native results into ``int`` byte
counts or ``OSError`` with the path, offset and size in the message.

[Note: request lifetime]
A request's buffer must outlive the I/O. The engine holds every request (and so its buffer) in
``_inflight`` until someone sees it finish (``done()``, ``wait()``, ``wait_all``, the periodic
sweep, or ``close()``); only then is the native request freed. A thread blocked in the native wait
counts as a user of the native handle, and the handle is freed by the last user out.

A request may carry a check (``check_on_wait``, the swap space's integrity check of what a read
brought back): it runs once, on the first thread whose ``wait()`` sees the request finished
without error, before that ``wait()`` returns; an ``OSError`` it raises becomes the request's
error, raised by every ``wait()``. ``done()`` never runs it, so a caller must ``wait()`` before
using a read's bytes (as it must to see I/O errors).
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterable

import torch

from infinity.io import _lib
from infinity.config.aio import AioConfig
from infinity.io.files import IOFile, Mode, open_file
from infinity.base.log import get_logger
from infinity.base.native_info import record_in_use

_log = get_logger("io.aio")
FILE_TOO_LARGE = "a file size limit (ulimit -f) or the filesystem's largest file"
"""What an EFBIG means, wherever a file of the engine's meets it (a swap file, a checkpoint)."""

_SECTOR = 512
_WAIT_SLICE_S = 0.25  # native waits are cut into slices so Ctrl-C is handled between them
_SWEEP_MIN = 1024


class IORequest:
    """A future for one read or write: ``done()``, ``wait(timeout=None) -> bytes moved``."""

    def __init__(self, engine: "AioEngine", handle: int, buf: Any, file: IOFile, op: str,
                 offset: int, nbytes: int, allow_short: bool) -> None:
        self.file = file
        self.op = op
        self.offset = offset
        self.nbytes = nbytes
        self.allow_short = allow_short
        self._engine = engine
        self._handle: int | None = handle
        self._buf = buf          # kept alive until the request is collected
        self._users = 0          # threads inside a native call on _handle
        self._orphan: int | None = None  # collected while in use: freed by the last user
        self._lock = threading.RLock()
        self._result = 0
        self._error: tuple[int, str] | None = None
        self._check: Callable[[], None] | None = None   # see check_on_wait
        self._check_error: OSError | None = None

    # -- public -----------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the request has finished (successfully or not); never blocks."""
        with self._lock:
            h = self._handle
            if h is None:
                return True
            if not _lib.lib().inf_aio_req_done(h):
                return False
            self._collect()
            return True

    def wait(self, timeout: float | None = None) -> int:
        """Block until finished; return the bytes moved or raise its OSError (TimeoutError on timeout)."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            if deadline is None:
                slice_s = _WAIT_SLICE_S
            else:
                slice_s = min(_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            if self._native_wait(slice_s):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self._describe()} still in flight after {timeout} s")
        if self._error is not None:
            code, msg = self._error
            raise OSError(code, msg)
        if self._check is not None:
            self._run_check()
        if self._check_error is not None:
            raise self._check_error
        return self._result

    def check_on_wait(self, check: Callable[[], None]) -> None:
        """Run ``check()`` once the request has finished without error, before ``wait()``
        returns; an ``OSError`` it raises is the request's error from then on (see the module
        docstring). Set it right after submission, before anyone waits."""
        with self._lock:
            self._check = check

    def _run_check(self) -> None:
        with self._lock:   # one thread runs it; another waiting thread sees its outcome
            check, self._check = self._check, None
            if check is None:
                return
            try:
                check()
            except OSError as exc:
                self._check_error = exc

    def _finish_quietly(self) -> None:
        """Block until finished without raising its error (for close paths)."""
        while not self._native_wait(_WAIT_SLICE_S):
            pass

    def __repr__(self) -> str:
        state = "done" if self._handle is None else "in flight"
        return f"IORequest({self.op} {self.nbytes} B at {self.offset} of {self.file.path!r}, {state})"

    # -- internals ----------------------------------------------------------------------------
    def _describe(self) -> str:
        verb, prep = ("reading", "from") if self.op == "read" else ("writing", "to")
        return f"{verb} {self.nbytes} bytes at offset {self.offset} {prep} {self.file.path}"

    def _native_wait(self, seconds: float) -> bool:
        with self._lock:
            h = self._handle
            if h is None:
                return True
            self._users += 1
        try:
            rc = _lib.lib().inf_aio_req_wait(h, int(seconds * 1e9))
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._orphan is not None:
                    _lib.lib().inf_aio_req_free(self._orphan)
                    self._orphan = None
        if rc == 0:
            with self._lock:
                self._collect()
            return True
        return False

    def _collect(self) -> None:
        """Record the result of a finished request and free it (caller holds self._lock)."""
        h = self._handle
        if h is None:
            return
        L = _lib.lib()
        if not L.inf_aio_req_done(h):
            return  # not finished: nothing to collect yet
        err_off = ctypes.c_uint64(0)
        res = L.inf_aio_req_result(h, ctypes.byref(err_off))
        self._handle = None
        if self._users == 0:
            _lib.lib().inf_aio_req_free(h)
        else:
            self._orphan = h
        self._buf = None
        self._engine._forget(h)
        self.file._track(self, False)
        if res < 0:
            self._error = (-res, self._error_message(-res, err_off.value))
        elif res < self.nbytes and not (self.op == "read" and self.allow_short):
            self._error = (errno.EIO, self._short_message(res))
            self._result = res
        else:
            self._result = res

    def _error_message(self, code: int, err_offset: int) -> str:
        hint = {
            errno.EINVAL: f"offsets and sizes must suit the file's direct-I/O alignment "
                          f"({self.file.align} bytes)",
            errno.ENOSPC: "the filesystem is full; free space or use another swap path",
            errno.EBADF: "the file descriptor does not allow this operation (closed, or opened "
                         "with the wrong mode)",
            errno.EFBIG: f"the offset is beyond {FILE_TOO_LARGE}",
            errno.EIO: "the device reported an I/O error; check dmesg",
        }.get(code, "")
        return (f"{self._describe()} failed at file offset {err_offset} "
                f"(backend {self._engine.backend}): {os.strerror(code)}" + (f"; {hint}" if hint else ""))

    def _short_message(self, got: int) -> str:
        if self.op == "write":
            return f"{self._describe()}: only {got} bytes were written"
        try:
            size = f"{self.file.size} bytes"
        except (OSError, ValueError):
            size = "of unknown size"
        if SWAP_DIR_MARK in str(getattr(self.file, "path", "")):
            # the engine's own swap file, preallocated whole: someone else cut it
            return (f"read past end of file: {self._describe()} got only {got} bytes; the swap "
                    f"file is {size}, shorter than the engine made it: it was truncated or "
                    "replaced from outside the engine, and the states it held are lost. close() "
                    "the engine and load_checkpoint the last checkpoint into a new one")
        return (f"read past end of file: {self._describe()} got only {got} bytes; the file is "
                f"{size}. Pass allow_short=True to accept a short read")


SWAP_DIR_MARK = "infinity-swap-"    # in the path of every swap directory (storage/swap_dir.py)


class AioEngine:
    """Asynchronous file I/O with many requests in flight; also a context manager.

    ``backend`` is the backend actually in use ("io_uring", "libaio", "threads" or "mmap").
    Several Python threads may submit to and wait on one engine.
    """

    def __init__(self, config: AioConfig | None = None) -> None:
        self.config = config if config is not None else AioConfig()
        cfg = self.config
        L = _lib.lib()
        st = _lib.AioConfigStruct(_lib.BACKENDS[cfg.backend], cfg.queue_depth, cfg.thread_count,
                                  cfg.block_size, int(cfg.single_submit), int(cfg.overlap_events))
        handle = ctypes.c_void_p()
        rc = L.inf_aio_create(ctypes.byref(st), ctypes.byref(handle))
        if rc < 0:
            code = -rc
            if code == errno.ENOSYS:
                raise OSError(code, f"aio backend {cfg.backend!r} is not available here (the kernel "
                                    "refuses it, e.g. io_uring_disabled or a seccomp filter); use "
                                    "backend=\"auto\" or \"threads\"")
            hint = ""
            if code in (errno.EAGAIN, errno.ENOMEM):
                # io_setup/io_uring_setup: the kernel's limit on in-flight requests
                hint = (f"; the kernel refused {cfg.queue_depth} x {cfg.thread_count} in-flight "
                        "requests (queue_depth x thread_count; libaio counts them against "
                        "/proc/sys/fs/aio-max-nr, shared by every process): lower queue_depth "
                        "or thread_count, or raise fs.aio-max-nr")
            raise OSError(code, f"starting the aio engine ({cfg}) failed: "
                                f"{os.strerror(code)}{hint}")
        self._handle: int | None = handle.value
        self._pid = os.getpid()  # lanes are threads: a forked child has none of them
        self.backend: str = _lib.BACKEND_NAMES[L.inf_aio_backend(self._handle)]
        self._lock = threading.Lock()
        self._inflight: dict[int, IORequest] = {}
        self._sweep_at = _SWEEP_MIN
        record_in_use("io_backend", self.backend)
        _log.debug("aio engine started: backend %s, %s", self.backend, cfg)

    # -- files --------------------------------------------------------------------------------
    def open(self, path: str | os.PathLike[str], mode: Mode = "r", *, create: bool = False) -> IOFile:
        """Open a file for this engine: O_DIRECT unless the backend is "mmap"."""
        return open_file(path, mode, create=create, direct=self.backend != "mmap")

    # -- I/O ----------------------------------------------------------------------------------
    def read(self, buf: Any, f: IOFile, offset: int, nbytes: int | None = None, *,
             allow_short: bool = False) -> IORequest:
        """Read ``nbytes`` (default: all of ``buf``) at ``offset`` of ``f`` into ``buf``."""
        return self._submit("read", buf, f, offset, nbytes, allow_short)

    def write(self, buf: Any, f: IOFile, offset: int, nbytes: int | None = None) -> IORequest:
        """Write ``nbytes`` (default: all of ``buf``) from ``buf`` at ``offset`` of ``f``."""
        return self._submit("write", buf, f, offset, nbytes, False)

    def _submit(self, op: str, buf: Any, f: IOFile, offset: int, nbytes: int | None,
                allow_short: bool) -> IORequest:
        if not isinstance(f, IOFile):
            raise TypeError(f"expected an IOFile from AioEngine.open/open_direct, got {type(f).__name__}")
        fd = f._live_fd()
        if op == "read" and not f.readable:
            raise OSError(errno.EBADF, f"cannot read {f.path}: it was opened with mode {f.mode!r}; "
                                       "open it with 'r' or 'rw'")
        if op == "write" and not f.writable:
            raise OSError(errno.EBADF, f"cannot write {f.path}: it was opened read-only ('r'); "
                                       "open it with 'w' or 'rw'")
        addr, size, keep = _buffer_of(buf, writable=(op == "read"))
        if nbytes is None:
            nbytes = size
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= size:
            raise ValueError(f"nbytes={nbytes!r} must be an int in [0, {size}] (the buffer's size) "
                             f"for {op} of {f.path}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r} for {op} of {f.path}")
        if f.direct and nbytes:
            unit = max(_SECTOR, f.align)
            if addr % _SECTOR:
                raise ValueError(f"{op} of {f.path}: buffer address {addr:#x} is not {_SECTOR}-byte "
                                 "aligned, which O_DIRECT needs; allocate it with "
                                 "infinity.io.aligned_empty()")
            if offset % unit:
                raise ValueError(f"{op} of {f.path}: offset {offset} is not a multiple of {unit} "
                                 "bytes (the file's direct-I/O block); align the offset")
        out = ctypes.c_void_p()
        code = _lib.OP_READ if op == "read" else _lib.OP_WRITE
        if os.getpid() != self._pid:
            raise RuntimeError(f"{op} of {f.path}: this AioEngine was created in process {self._pid} "
                               f"and its I/O threads do not exist after fork(); create a new "
                               f"AioEngine in process {os.getpid()}")
        with self._lock:
            if self._handle is None:
                raise RuntimeError(f"{op} of {f.path}: the aio engine is closed")
            rc = _lib.lib().inf_aio_submit(self._handle, code, fd, f.align if f.direct else 1,
                                           addr, nbytes, offset, ctypes.byref(out))
            if rc < 0:
                raise OSError(-rc, f"submitting {op} of {nbytes} bytes at offset {offset} of "
                                   f"{f.path}: {os.strerror(-rc)}")
            req = IORequest(self, out.value, keep, f, op, offset, nbytes, allow_short)
            self._inflight[out.value] = req
            f._track(req, True)
            sweep = len(self._inflight) >= self._sweep_at
        if sweep:
            self._sweep()
        return req

    def _forget(self, handle: int) -> None:
        with self._lock:
            self._inflight.pop(handle, None)

    def _sweep(self) -> None:
        """Collect finished requests nobody waited for, so their buffers can be freed."""
        with self._lock:
            reqs = list(self._inflight.values())
        for r in reqs:
            r.done()
        with self._lock:
            self._sweep_at = max(_SWEEP_MIN, 2 * len(self._inflight))

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet seen finished."""
        with self._lock:
            return len(self._inflight)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every request in flight, then stop the engine (idempotent)."""
        with self._lock:
            handle, self._handle = self._handle, None
            reqs = list(self._inflight.values())
        if handle is None or os.getpid() != self._pid:
            return  # after fork() the parent owns the native engine; leave it alone
        for r in reqs:
            r._finish_quietly()
        _lib.lib().inf_aio_destroy(handle)

    def __enter__(self) -> "AioEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else f"{self.in_flight} in flight"
        return f"AioEngine(backend={self.backend!r}, {state})"


def wait_all(reqs: Iterable[IORequest]) -> list[int]:
    """Wait for every request; return their byte counts, or raise the first error once all finished."""
    results: list[int] = []
    first: BaseException | None = None
    for r in reqs:
        try:
            results.append(r.wait())
        except OSError as exc:
            results.append(-1)
            if first is None:
                first = exc
    if first is not None:
        raise first
    return results


def _buffer_of(buf: Any, *, writable: bool) -> tuple[int, int, Any]:
    """(address, size in bytes, object to keep alive) of a contiguous host buffer."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"the buffer is on {buf.device}; the aio engine moves host memory: "
                             "stage through a host tensor from infinity.io.aligned_empty()")
        if not buf.is_contiguous():
            raise ValueError(f"the buffer tensor (shape {tuple(buf.shape)}, strides {buf.stride()}) "
                             "is not contiguous; pass .contiguous() or a flat view")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"expected a CPU torch.Tensor or an object with the buffer protocol, got "
                        f"{type(buf).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("the buffer is not C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"cannot read into a read-only buffer ({type(buf).__name__})")
    if view.nbytes == 0:
        return 0, 0, buf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers are fine for writes
        t = torch.frombuffer(view, dtype=torch.uint8)
    return t.data_ptr(), view.nbytes, (buf, t)
