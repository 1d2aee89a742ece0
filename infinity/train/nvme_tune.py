"""The nvme-tune sweep: measure sequential write and cold read GB/s of a swap path for a grid of
aio settings (backend x block size x queue depth x threads) and recommend an ``"aio"`` section.

Why here, in the top layer beside the main job and ``calibrate`` (whose ``measure_disk`` is one
point of this sweep): it is a measurement of this machine that the engine never runs. It drives
the I/O engine (``infinity.io``) on a private swap directory made and reclaimed by storage's one
copy of that rule (``storage.swap_dir``), on a path checked as the engine checks it
(``storage.preflight``), so it sits above both layers; the I/O layer, below storage, could not
hold it. Why a library module (the CLI, ``infinity nvme-tune``, is commands/nvme_tune.py): tools
and tests run the same sweep, and the numbers mean the same thing everywhere:

* the test file lives in a private swap directory (``swap_dir``), so it is removed on return, on
  Ctrl-C, and (by reclaim) even after a SIGKILL;
* it is preallocated and written once untimed before the sweep, so no point pays ext4's
  unwritten-extent conversion that only the first writer would see;
* a write pass submits the whole file as requests from one aligned buffer; by default it is not
  followed by an fsync, like the engine's own swap-outs (and DeepSpeed's aio bench and
  tools/bench/io.py), so a device with a write-back cache may report what its cache absorbs;
  ``fsync=True`` adds one ``fdatasync`` per pass (what the device sustains);
* before a read pass the file is fsync'd and evicted (``posix_fadvise(DONTNEED)``) and its page-cache
  residency recorded; reads use O_DIRECT (except the ``mmap`` backend), and the read-back is
  checked against the written pattern;
* repeats go round the whole grid (round-robin), so slow drifts of a shared or virtual disk hit
  every point alike; each point reports the median of its repeats.

GB/s are decimal (1e9 bytes per second). The recommendation maximises the rate at which a byte can
be swapped out and back in, ``1 / (1/write + 1/read)``; among points within ``tolerance`` of the
best it prefers fewer threads and then a smaller queue depth (less memory pinned in flight).
"""
from __future__ import annotations

import errno
import itertools
import os
import statistics
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes
from infinity.io.aio import FILE_TOO_LARGE
from infinity.storage.preflight import check_free_space, check_swap_path
from infinity.storage.swap_dir import SwapDir, reclaim_stale

_log = get_logger("train.nvme_tune")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_BACKENDS = ("io_uring", "libaio")
DEFAULT_BLOCK_SIZES = (256 * KiB, MiB, 4 * MiB)
DEFAULT_QUEUE_DEPTHS = (8, 32)
DEFAULT_THREADS = (1,)
DEFAULT_SIZE = GiB
MAX_BUFFER = 256 * MiB  # one host buffer, reused for every request of a pass
TOLERANCE = 0.05


@dataclass(frozen=True, order=True)
class TunePoint:
    """One setting of the aio knobs."""

    backend: str
    block_size: int
    queue_depth: int
    thread_count: int = 1

    def label(self) -> str:
        threads = f" t{self.thread_count}" if self.thread_count != 1 else ""
        return f"{self.backend} {_short(self.block_size)} qd{self.queue_depth}{threads}"


@dataclass
class PointResult:
    """Measured rates of one point (medians over repeats) and every sample."""

    point: TunePoint
    backend_used: str = ""
    write_samples: list[float] = field(default_factory=list)
    """Write GB/s of each repeat."""
    read_samples: list[float] = field(default_factory=list)
    """Read GB/s of each repeat."""
    resident_before_read: list[float] = field(default_factory=list)
    """Fraction of the file in the page cache just before each read pass (0.0 = cold)."""

    @property
    def write_GBps(self) -> float:
        return statistics.median(self.write_samples) if self.write_samples else 0.0

    @property
    def read_GBps(self) -> float:
        return statistics.median(self.read_samples) if self.read_samples else 0.0

    @property
    def swap_GBps(self) -> float:
        """Bytes per second swapped out and back in: ``1 / (1/write + 1/read)``."""
        w, r = self.write_GBps, self.read_GBps
        return 0.0 if w <= 0 or r <= 0 else 1.0 / (1.0 / w + 1.0 / r)

    def to_dict(self) -> dict:
        return {**asdict(self.point), "backend_used": self.backend_used,
                "write_GBps": round(self.write_GBps, 4), "read_GBps": round(self.read_GBps, 4),
                "swap_GBps": round(self.swap_GBps, 4),
                "write_samples_GBps": [round(x, 4) for x in self.write_samples],
                "read_samples_GBps": [round(x, 4) for x in self.read_samples],
                "resident_before_read": self.resident_before_read}


@dataclass
class TuneReport:
    """Everything a sweep measured, and the recommendation."""

    path: str
    fs_type: str
    size: int
    repeats: int
    writes_include_fsync: bool
    results: list[PointResult]
    skipped: list[str] = field(default_factory=list)
    """Points not measured, with the reason (e.g. a backend the kernel refuses)."""
    seconds: float = 0.0

    @property
    def best(self) -> PointResult:
        return recommend(self.results)

    def aio_section(self) -> dict:
        """The recommended ``"aio"`` section (DeepSpeed's keys, plus infinity's ``backend``)."""
        p = self.best.point
        return {"backend": self.best.backend_used or p.backend, "block_size": p.block_size,
                "queue_depth": p.queue_depth, "intra_op_parallelism": p.thread_count,
                "single_submit": False, "overlap_events": True}

    def to_dict(self) -> dict:
        best = self.best
        return {
            "path": self.path, "fs_type": self.fs_type, "size": self.size, "repeats": self.repeats,
            "units": "GB/s = 1e9 bytes/s, median of repeats",
            "writes_include_fsync": self.writes_include_fsync,
            "reads": "cold: O_DIRECT (page cache bypassed; mmap backend excepted) after fsync + "
                     "posix_fadvise(DONTNEED)",
            "seconds": round(self.seconds, 2),
            "points": [r.to_dict() for r in self.results],
            "skipped": self.skipped,
            "recommendation": {**best.to_dict(), "aio": self.aio_section()},
        }


def grid(backends: Iterable[str] = DEFAULT_BACKENDS, block_sizes: Iterable[int] = DEFAULT_BLOCK_SIZES,
         queue_depths: Iterable[int] = DEFAULT_QUEUE_DEPTHS,
         threads: Iterable[int] = DEFAULT_THREADS) -> list[TunePoint]:
    """Every combination of the knobs, in a stable order."""
    return [TunePoint(b, bs, qd, t) for b, bs, qd, t in
            itertools.product(backends, block_sizes, queue_depths, threads)]


def recommend(results: list[PointResult], tolerance: float = TOLERANCE) -> PointResult:
    """Best swap rate; within ``tolerance`` of it, fewer threads, then smaller queue depth."""
    measured = [r for r in results if r.swap_GBps > 0]
    if not measured:
        raise ValueError("no point was measured, so there is nothing to recommend")
    top = max(r.swap_GBps for r in measured)
    near = [r for r in measured if r.swap_GBps >= (1.0 - tolerance) * top]
    return min(near, key=lambda r: (r.point.thread_count, r.point.queue_depth, -r.swap_GBps))


ProgressFn = Callable[[int, int, TunePoint, str], None]
"""``progress(done, total, point, phase)``: called before each pass ("write"/"read") and at the end ("done")."""


class TuneFile:
    """A private swap dir under ``path`` holding one preallocated, laid-out test file and the
    buffer that is written from and read into; ``measure`` times one point on it. A context
    manager: the directory is removed on exit, whatever the exit (Ctrl-C included).

    The file persists across measurements (each write overwrites what the previous one wrote), as
    in a real sweep and in tools/bench/io.py.
    """

    def __init__(self, path: str | os.PathLike[str], size: int, *, direct_io: bool = True) -> None:
        from infinity.io import AioConfig, AioEngine, aligned_empty

        self.size = -(-size // 4096) * 4096
        if self.size <= 0:
            raise ValueError(f"nvme-tune: size must be positive, got {size}")
        report = check_swap_path(path, 0, direct_io=direct_io)
        reclaim_stale(path)     # before the space check: a killed run's files count as free
        free = check_free_space(path, self.size, "the nvme-tune test file",
                                remedy="give a smaller --size, or a --path on a larger disk")
        self.preflight = dataclasses.replace(report, free_bytes=free)
        self._dir = SwapDir.create(path)
        self.buf = None
        try:
            self.file_path = self._dir.register_file("tune-0.bin")
            fd = os.open(self.file_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:        # named as the engine's swap files name it
                hint = {errno.EFBIG: FILE_TOO_LARGE, errno.ENOSPC: "the disk is full",
                        errno.EDQUOT: "the disk quota is full"}.get(exc.errno)
                raise OSError(exc.errno, f"preallocating {format_bytes(self.size)} for the "
                              f"nvme-tune test file {self.file_path} failed: {exc.strerror}"
                              + (f" ({hint}); give a smaller --size" if hint else "")) from None
            finally:
                os.close(fd)
            self.buf = aligned_empty(min(self.size, MAX_BUFFER))
            self._check = _Check(self.buf)
            # untimed layout write; "mmap" where no point uses O_DIRECT (a file system without
            # it: the sweep the preflight's advice leads to)
            with AioEngine(AioConfig(backend="auto" if direct_io else "mmap")) as layout:
                _write_pass(layout, self.file_path, self.buf, self.size, fsync=True)
        except BaseException:
            self.close()
            raise

    def measure(self, point: TunePoint, *, fsync: bool = False,
                before_read: Callable[[], None] | None = None) -> tuple[str, float, float, float]:
        """(backend used, write GB/s, cold read GB/s, fraction cached before the read) of ``point``."""
        from infinity.io import AioConfig, AioEngine

        cfg = AioConfig(backend=point.backend, block_size=point.block_size,
                        queue_depth=point.queue_depth, thread_count=point.thread_count)
        with AioEngine(cfg) as engine:
            write_s = _write_pass(engine, self.file_path, self.buf, self.size, fsync)
            if before_read:
                before_read()
            self._check.clear()
            read_s, resident = _read_pass(engine, self.file_path, self.buf, self.size)
            if not self._check.verify():
                raise OSError(f"nvme-tune: the data read back from {self.file_path} with "
                              f"{point.label()} differs from what was written; the disk or the "
                              "I/O engine is corrupting data")
            return engine.backend, self.size / write_s / 1e9, self.size / read_s / 1e9, resident

    def close(self) -> None:
        self.buf = None
        self._check = None
        self._dir.remove()

    def __enter__(self) -> TuneFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sweep(path: str | os.PathLike[str], points: list[TunePoint], *, size: int = DEFAULT_SIZE,
          repeats: int = 1, fsync: bool = False, progress: ProgressFn | None = None) -> TuneReport:
    """Measure every point ``repeats`` times on a ``size``-byte file in a private dir under ``path``."""
    from infinity.io import backend_available

    if not points:
        raise ValueError("nvme-tune: the grid is empty; give at least one value for every knob")
    if repeats < 1:
        raise ValueError(f"nvme-tune: repeats must be >= 1, got {repeats}")
    skipped, runnable = [], []
    for p in points:
        if p.backend != "auto" and not backend_available(p.backend):
            skipped.append(f"{p.label()}: backend {p.backend} is not available here")
        else:
            runnable.append(p)
    if not runnable:
        raise ValueError("nvme-tune: no requested backend is available here: " + "; ".join(skipped))
    results = {p: PointResult(p) for p in runnable}
    started = time.perf_counter()
    with TuneFile(path, size, direct_io=any(p.backend != "mmap" for p in runnable)) as tf:
        total = repeats * len(runnable)
        done = 0
        for _ in range(repeats):
            for point in runnable:
                res = results[point]
                if progress:
                    progress(done, total, point, "write")
                backend, write, read, resident = tf.measure(
                    point, fsync=fsync,
                    before_read=(lambda p=point, d=done: progress(d, total, p, "read")) if progress else None)
                res.backend_used = backend
                res.write_samples.append(write)
                res.read_samples.append(read)
                res.resident_before_read.append(resident)
                done += 1
                if progress:
                    progress(done, total, point, "done")
    return TuneReport(path=str(path), fs_type=tf.preflight.fs_type, size=tf.size, repeats=repeats,
                      writes_include_fsync=fsync, results=list(results.values()), skipped=skipped,
                      seconds=time.perf_counter() - started)


class _Check:
    """A pattern in the buffer, and a sampled check that a read pass brought it back.

    Every request of a pass moves the same buffer, so every chunk of the file holds this pattern:
    tiles (64 KiB, or 4 KiB when the buffer is not a multiple of that) of a fixed byte sequence,
    each stamped with its index in its first 8 bytes (so a piece read from the wrong offset shows).
    Before a read pass the sampled tiles (every 16th and the last) are zeroed; after it they must
    hold the pattern again. Whole-tensor ops only: many small torch ops are slow on a busy machine.
    """

    TILE = 64 * KiB

    def __init__(self, buf) -> None:
        import torch

        n = buf.numel()
        t = self.TILE if n % self.TILE == 0 else 4096
        self.rows = buf.view(-1, t)
        i = torch.arange(t, dtype=torch.int32)
        self.rows.copy_(((i * 7 + i // 4096) % 251).to(torch.uint8).expand_as(self.rows))
        nrows = self.rows.shape[0]
        self.rows[:, :8].copy_(torch.arange(nrows, dtype=torch.int64).view(torch.uint8).view(-1, 8))
        # Samples: every 16th tile (a strided view) and the last one, as int64 (fast copies).
        self.views = [self.rows[::16].view(torch.int64), self.rows[-1:].view(torch.int64)]
        self.expected = [v.clone() for v in self.views]

    def clear(self) -> None:
        for v in self.views:
            v.zero_()

    def verify(self) -> bool:
        import torch

        return all(torch.equal(v, e) for v, e in zip(self.views, self.expected))


def _chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def _write_pass(engine, file_path: Path, buf, size: int, fsync: bool) -> float:
    """Seconds to write ``size`` bytes (all requests submitted at once; + fdatasync if asked)."""
    from infinity.io import wait_all

    with engine.open(file_path, "rw") as f:
        t0 = time.perf_counter()
        wait_all([engine.write(buf, f, off, n) for off, n in _chunks(size, buf.numel())])
        if fsync:
            os.fdatasync(f.fd)
        return time.perf_counter() - t0


def _read_pass(engine, file_path: Path, buf, size: int) -> tuple[float, float]:
    """(seconds to read ``size`` bytes cold, fraction of the file cached just before)."""
    from infinity.io import drop_cached, resident_pages, wait_all

    drop_cached(file_path)
    resident = resident_pages(file_path) * os.sysconf("SC_PAGE_SIZE") / size
    with engine.open(file_path, "r") as f:
        t0 = time.perf_counter()
        wait_all([engine.read(buf, f, off, n) for off, n in _chunks(size, buf.numel())])
        return time.perf_counter() - t0, round(min(1.0, resident), 4)


def _short(nbytes: int) -> str:
    for unit, name in ((GiB, "G"), (MiB, "M"), (KiB, "K")):
        if nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return str(nbytes)


def describe(report: TuneReport) -> str:
    """The human-readable table and recommendation."""
    lines = [f"nvme-tune {report.path} ({report.fs_type}): {format_bytes(report.size)} file, "
             f"{report.repeats} repeat(s), {report.seconds:.0f} s",
             "writes: O_DIRECT, " + ("including one fdatasync per pass" if report.writes_include_fsync
                                     else "no fsync (a device write cache may absorb them; "
                                          "--fsync adds one fdatasync per pass)")
             + "; reads: cold (fsync + fadvise DONTNEED, O_DIRECT). GB/s = 1e9 B/s, median of "
             "repeats", ""]
    header = f"{'backend':<9} {'block':>6} {'qd':>4} {'thr':>4} {'write GB/s':>11} {'read GB/s':>10} {'swap GB/s':>10}"
    lines += [header, "-" * len(header)]
    best = report.best
    for r in report.results:
        p = r.point
        mark = "  <- recommended" if r is best else ""   # within 5% of the fastest
        lines.append(f"{r.backend_used or p.backend:<9} {_short(p.block_size):>6} {p.queue_depth:>4} "
                     f"{p.thread_count:>4} {r.write_GBps:>11.3f} {r.read_GBps:>10.3f} "
                     f"{r.swap_GBps:>10.3f}{mark}")
    for s in report.skipped:
        lines.append(f"skipped: {s}")
    lines += ["", f"recommended: {best.point.label()} (write {best.write_GBps:.2f} GB/s, read "
                  f"{best.read_GBps:.2f} GB/s; swap = 1/(1/write + 1/read) within "
                  f"{TOLERANCE:.0%} of the best, fewest threads and smallest queue depth)",
              "paste into ds_config.json:"]
    return "\n".join(lines)
