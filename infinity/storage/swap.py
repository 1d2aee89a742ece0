"""``SwapSpace``: one rank's NVMe tier: extents of a few large preallocated swap files.

Why: the tier manager needs "a place on disk for N bytes" for every offloaded tensor, and reads and
writes of those places at disk speed. One file per tensor (as DeepSpeed does) means thousands of
files and opens; a few large files preallocated with fallocate, carved into aligned extents by
``ExtentAllocator``, keep the filesystem out of the hot path and the disk layout contiguous.

Lifecycle (see ``swap_dir``): the constructor first reclaims directories of killed runs under
``nvme_path``, runs the preflight (writable disk directory, O_DIRECT, free space for
``reserve_bytes``), then creates this rank's private directory and preallocates ``reserve_bytes``.
``close()``, or the garbage collection of the space, or interpreter exit (``weakref.finalize``)
waits for this space's requests still in flight, closes and deletes its swap files and removes the
directory. A SIGKILL leaves the directory; the next start (or ``infinity clean``) reclaims it.

Growth: when no free range holds a request, a file is added (never while a fitting hole exists);
free space is checked first, so a full disk is a ``SwapPathError`` naming both sizes, and a failed
fallocate an ``OSError`` naming the file. I/O errors (ENOSPC, EIO) come back from the request's
``wait()`` as ``OSError`` naming the swap file, offset and size (the aio engine's contract).

Integrity: every write records fingerprints of its pages and every read checks them when it is
waited on; bytes changed behind the engine's back come back from ``wait()`` as a
``SwapCorruptionError`` naming the file and the extent (see [Note: swap-space integrity check] in
integrity.py).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes, parse_bytes
from infinity.io.aio import FILE_TOO_LARGE
from infinity.storage.extents import ALIGNMENT, Extent, ExtentAllocator, round_up
from infinity.storage.integrity import CheckMode, PageFingerprints, SwapCorruptionError
from infinity.storage.preflight import PreflightReport, check_free_space, check_swap_path
from infinity.storage.swap_dir import SwapDir, reclaim_stale

if TYPE_CHECKING:
    from infinity.io.aio import AioEngine, IORequest
    from infinity.io.files import IOFile

_log = get_logger("storage.swap")

MiB = 1 << 20
AUTO_MIN_FILE = 64 * MiB
AUTO_MAX_FILE = 16 << 30          # a file added as the space grows
AUTO_MAX_RESERVE_FILE = 1 << 40   # a file of the reserve (ext4 holds files of up to 16 TiB)
AUTO_DEFAULT_FILE = 256 * MiB
_PRUNE_AT = 512  # prune the list of requests in flight when it gets this long


def auto_file_size(reserve_bytes: int) -> int:
    """File size for ``file_size="auto"``: the reserve in as few files of at most 1 TiB as
    hold it, all of one size (at least 64 MiB). Few because an extent never spans two files:
    each file's tail shorter than the next extent is lost, and the reserve split in four files
    of a few large extents each left up to a quarter of it unused, the difference added as one
    more file (the disk 26-58% over the plan)."""
    if reserve_bytes <= 0:
        return AUTO_DEFAULT_FILE
    files = -(-reserve_bytes // AUTO_MAX_RESERVE_FILE)
    return min(AUTO_MAX_RESERVE_FILE, max(AUTO_MIN_FILE, round_up(-(-reserve_bytes // files), MiB)))


def auto_growth_size(capacity: int, padded: int) -> int:
    """A file added under ``file_size="auto"`` once the space is full: a quarter of what the
    space holds (64 MiB..16 GiB), so the number of files stays small however far it grows, and
    never less than the extent it is added for."""
    return max(padded, min(AUTO_MAX_FILE, max(AUTO_MIN_FILE, round_up(capacity // 4, MiB))))


class _Resources:
    """What must be released when the space goes away; held by the finalizer (never the space)."""

    def __init__(self, swap_dir: SwapDir) -> None:
        self.swap_dir = swap_dir
        self.owner_pid = os.getpid()
        self.files: list[IOFile] = []
        self.pending: list[IORequest] = []  # requests submitted and not yet seen finished
        self.lock = threading.Lock()

    def release(self) -> None:
        try:
            self._release()
        except BaseException:
            # interrupted (a second Ctrl-C during close): the finalizer will not run again, so
            # finish at interpreter exit rather than leave gigabytes of swap files behind
            atexit.register(self._release_at_exit)
            raise

    def _release_at_exit(self) -> None:
        with contextlib.suppress(BaseException):
            self._release()

    def _release(self) -> None:
        if os.getpid() != self.owner_pid:
            # a forked child's exit (its finalizers run at its interpreter exit): the space, its
            # files and requests are the parent's, which still trains on them
            return
        # Wait for this space's I/O in flight: closing a file under a running request could let a
        # reused descriptor number receive its bytes. Errors were (or will be) seen by the owner.
        with self.lock:
            pending, self.pending = self.pending, []
        for req in pending:
            try:
                req.wait()
            except Exception:  # noqa: BLE001 - already reported through the request
                pass
        for f in self.files:
            f.close()
        result = self.swap_dir.remove()
        _log.debug("removed swap dir %s: %s in %d files", result.path,
                   format_bytes(result.bytes_freed), result.files_removed)


class SwapSpace:
    """This rank's swap files under ``nvme_path``, handed out as aligned extents.

    ``aio`` is the engine that moves the bytes (its backend decides whether O_DIRECT is checked).
    ``reserve_bytes`` are checked against free space and preallocated now; ``file_size`` is the
    size of each swap file ("auto": the reserve in as few files as hold it, 256 MiB without a
    reserve, and files added later grow with the space so their number stays small).
    """

    def __init__(self, nvme_path: str | os.PathLike[str], *, rank: int = 0, aio: AioEngine,
                 reserve_bytes: int = 0, file_size: int | str = "auto",
                 check_mode: CheckMode = "sampled") -> None:
        if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be a non-negative int, got {reserve_bytes!r}")
        self._auto = file_size == "auto"
        if self._auto:
            base = auto_file_size(reserve_bytes)
        else:
            base = parse_bytes(file_size, "file_size")
            if base < ALIGNMENT:
                raise ValueError(f"file_size must be at least {ALIGNMENT} bytes, got {file_size!r}")
        self._file_size = round_up(base, ALIGNMENT)
        self.nvme_path = Path(os.path.abspath(nvme_path))
        self.rank = rank
        self.aio = aio
        direct = getattr(aio, "backend", None) != "mmap"
        check_swap_path(self.nvme_path, 0, direct_io=direct)
        reclaim_stale(self.nvme_path)  # before the space check: a killed run's files count as free
        report = check_swap_path(self.nvme_path, reserve_bytes, direct_io=False)
        self.preflight: PreflightReport = report
        self._lock = threading.Lock()
        self._alloc = ExtentAllocator(ALIGNMENT)
        self._tags: dict[tuple[int, int], str] = {}
        self.integrity = PageFingerprints(check_mode)   # [Note: swap-space integrity check]
        self._dir = SwapDir.create(self.nvme_path, rank)
        self._res = _Resources(self._dir)
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        self._largest_allowed: int | None = None   # learned from EFBIG (auto sizes)
        try:
            while self._alloc.capacity < reserve_bytes:
                self._add_fitting_file(
                    min(self._file_size, round_up(reserve_bytes - self._alloc.capacity)), 0)
        except BaseException:
            self.close()
            raise
        _log.info("swap space %s (rank %d, backend %s, %s): %s preallocated in %d files",
                  self._dir.path, rank, getattr(aio, "backend", "?"), report.fs_type,
                  format_bytes(self._alloc.capacity), len(self._res.files))

    # -- extents --------------------------------------------------------------------------------
    def allocate(self, nbytes: int, tag: str = "") -> Extent:
        """An extent for ``nbytes``; adds a swap file when no free range holds it."""
        self._check_open()
        with self._lock:
            extent = self._alloc.allocate(nbytes)
            if extent is None:
                padded = round_up(nbytes, ALIGNMENT)
                self._grow(padded, tag)
                extent = self._alloc.allocate(nbytes)
                assert extent is not None, "a fresh file must hold the request"
            self._tags[(extent.file_index, extent.offset)] = tag
            return extent

    def free(self, extent: Extent) -> None:
        """Give ``extent`` back (its bytes may be handed out again at once)."""
        with self._lock:
            self._alloc.free(extent)
            self._tags.pop((extent.file_index, extent.offset), None)
            self.integrity.forget(extent.file_index, extent.offset, extent.padded_nbytes)

    def tag_of(self, extent: Extent) -> str:
        """The tag ``extent`` was allocated with (for messages)."""
        return self._tags.get((extent.file_index, extent.offset), "")

    def layout(self) -> list[tuple[str, Path, int, int]]:
        """Where each live extent lies: ``(tag, swap file, offset, padded length)``, by file and
        offset (for diagnostics and for tests that touch the files behind the engine's back)."""
        with self._lock:
            live = sorted(self._tags.items())
            return [(tag, Path(self._res.files[f].path), off, self._alloc.padded_of(f, off))
                    for (f, off), tag in live]

    # -- I/O ------------------------------------------------------------------------------------
    def write(self, extent: Extent, tensor: Any, offset: int = 0,
              nbytes: int | None = None) -> IORequest:
        """Write ``tensor`` (an aligned contiguous host buffer) into ``extent`` at ``offset``.

        ``nbytes`` defaults to the buffer's size, capped at what the extent holds from ``offset``
        (so a larger slot may be passed). ``offset`` is relative to the extent, a multiple of 4096.
        """
        return self._submit("write", extent, tensor, offset, nbytes)

    def read(self, extent: Extent, tensor: Any, offset: int = 0,
             nbytes: int | None = None) -> IORequest:
        """Read ``extent`` from ``offset`` into ``tensor``; same size rules as ``write``."""
        return self._submit("read", extent, tensor, offset, nbytes)

    def _submit(self, op: str, extent: Extent, tensor: Any, offset: int,
                nbytes: int | None) -> IORequest:
        self._check_open()
        tag = self._tags.get((extent.file_index, extent.offset))
        if tag is None:
            raise ValueError(f"{op} of {extent}: the extent is not allocated in this swap space "
                             "(freed already, or from another space)")
        if offset < 0 or offset % ALIGNMENT or offset >= extent.padded_nbytes:
            raise ValueError(f"{op} of extent {tag!r}: offset {offset} must be a multiple of "
                             f"{ALIGNMENT} inside the extent's {extent.padded_nbytes} bytes")
        buf_bytes = tensor.numel() * tensor.element_size()
        room = extent.padded_nbytes - offset
        if nbytes is None:
            nbytes = min(buf_bytes, room)
        elif nbytes > min(buf_bytes, room):
            raise ValueError(f"{op} of {nbytes} bytes for extent {tag!r}: the buffer holds "
                             f"{buf_bytes} bytes and the extent {room} from offset {offset}")
        f = self._res.files[extent.file_index]
        at = extent.offset + offset
        try:
            if op == "write":
                req = self.aio.write(tensor, f, at, nbytes)
            else:
                req = self.aio.read(tensor, f, at, nbytes)
        except OSError as exc:
            raise OSError(exc.errno, f"submitting {op} of {nbytes} bytes at offset {at} of swap "
                                     f"file {f.path} (extent {tag!r}): {exc.strerror or exc}") from exc
        check = self.integrity
        if check.active:
            if op == "write":
                check.record(extent.file_index, at, tensor, nbytes)
            else:
                # not through self: the request waits in the finalizer's list, and a lambda of
                # self there kept the space (and its directory) alive until exit
                req.check_on_wait(functools.partial(
                    SwapSpace._verify, check, extent, tag, f.path, at, tensor, nbytes))
        with self._res.lock:
            pending = self._res.pending
            pending.append(req)
            if len(pending) >= _PRUNE_AT:
                pending[:] = [r for r in pending if not r.done()]
        return req

    @staticmethod
    def _verify(check: PageFingerprints, extent: Extent, tag: str, path: str, at: int,
                tensor: Any, nbytes: int) -> None:
        """A read of ``extent`` finished: its pages must be what this space wrote there."""
        bad, checked, first, last = check.verify(extent.file_index, at, tensor, nbytes)
        if bad:
            err = SwapCorruptionError(
                path=str(path), tag=tag, extent_offset=extent.offset,
                extent_nbytes=extent.nbytes, offset=at, nbytes=nbytes, bad_pages=bad,
                checked_pages=checked, first_bad_offset=first, last_bad_offset=last,
                mode=check.mode)
            _log.error("%s", err.strerror)
            raise err

    # -- accounting -----------------------------------------------------------------------------
    @property
    def bytes_allocated(self) -> int:
        """Bytes of the swap files held by live extents (padded to 4096)."""
        return self._alloc.allocated

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of all swap files (preallocated)."""
        return self._alloc.capacity

    @property
    def files(self) -> list[Path]:
        """Paths of the swap files, by file index."""
        return [Path(f.path) for f in self._res.files]

    @property
    def path(self) -> Path:
        """This rank's private directory."""
        return self._dir.path

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for this space's requests in flight, delete its swap files and its directory."""
        self._finalizer()

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else (
            f"{format_bytes(self.bytes_allocated)} of {format_bytes(self.bytes_on_disk)} in "
            f"{len(self._res.files)} files")
        return f"SwapSpace({self._dir.path}, {state})"

    # -- internals ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"swap space {self._dir.path} is closed")

    def _grow(self, padded: int, tag: str) -> None:
        """Add a file that holds ``padded`` bytes (caller holds the lock)."""
        if not self._dir.path.is_dir():
            raise FileNotFoundError(
                errno.ENOENT, f"the swap directory {self._dir.path} was removed from outside "
                "the engine (by hand, or by a cleanup of its parent) while this run used it: "
                f"the states it held are lost, and extent {tag!r} has nowhere to go. close() "
                "this engine and resume from the last checkpoint; keep other cleanups out of "
                "the nvme_path while a run is alive", str(self._dir.path))
        if self._auto:
            capacity = self._alloc.capacity     # none yet: no reserve was given
            size = auto_growth_size(capacity, padded) if capacity else max(self._file_size, padded)
            if self._largest_allowed is not None:
                size = max(padded, min(size, self._largest_allowed))
            try:
                check_free_space(self._dir.path, size)
            except ValueError:
                size = padded   # short of room: the smallest file that does the job
        else:
            size = max(self._file_size, padded)
        check_free_space(self._dir.path, size,
                         what=f"swap file {len(self._res.files)} (for extent {tag!r})")
        self._add_fitting_file(size, padded)

    def _add_fitting_file(self, size: int, least: int) -> None:
        """Add a file of ``size`` bytes; under auto sizes, one larger than the process or the
        filesystem allows (EFBIG: ulimit -f; ext4 of 1 KiB blocks holds 16 GiB) is tried again
        at half the size, down to ``least`` (the extent it is for) or 64 MiB, and the size that
        worked bounds every later file (growth asked for a quarter of the space again and
        failed mid-run)."""
        while True:
            try:
                self._add_file(size)
                return
            except OSError as exc:
                smallest = max(least, AUTO_MIN_FILE)
                if not (self._auto and exc.errno == errno.EFBIG and size > smallest):
                    raise
                self._largest_allowed = max(smallest, round_up(size // 2, MiB))
                self._file_size = min(self._file_size, self._largest_allowed)
                _log.info("swap file of %s too large here (%s): files of %s", format_bytes(size),
                          os.strerror(errno.EFBIG), format_bytes(self._largest_allowed))
                size = self._largest_allowed

    def _add_file(self, size: int) -> None:
        # Named by a counter of registrations, so a name that failed once is never reused.
        path = self._dir.register_file(f"swap-{len(self._dir.file_names)}.bin")
        created = False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            created = True
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as exc:
            if created:        # ours to remove; a file already at the name (EEXIST) is not
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            hint = ("the disk is full; free space or choose a larger nvme_path"
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) else
                    f"{FILE_TOO_LARGE}: raise the limit, or choose a filesystem that holds "
                    "larger files"
                    if exc.errno == errno.EFBIG else
                    "check the swap path")
            raise OSError(exc.errno, f"preallocating {size} bytes ({format_bytes(size)}) for swap "
                                     f"file {path} failed: {os.strerror(exc.errno or 0)}; {hint}") from exc
        self._res.files.append(self.aio.open(path, "rw"))
        self.integrity.add_file(size)
        self._alloc.add_file(size)
