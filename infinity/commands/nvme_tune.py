"""``infinity nvme-tune --path DIR``: measure a swap path and recommend an ``"aio"`` section.

Sweeps backend x block size x queue depth x threads (each knob takes one value or a comma list;
one value for every knob measures a single point), shows a progress bar on stderr, prints a table
of write and cold-read GB/s per point and the recommended ``"aio"`` JSON (``--json``: one JSON
object with every point instead), and draws the sweep with ``--plot FILE.png`` (needs matplotlib).
The sweep logic is ``infinity.train.nvme_tune``; this module is only the command line.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from infinity.base.sizes import format_bytes, parse_bytes
from infinity.train import nvme_tune as tune

_BACKENDS = ("auto", "io_uring", "libaio", "threads", "mmap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, type=Path,
                        help="directory to measure (the nvme_path you will use); a private "
                             "subdirectory is created there and removed afterwards")
    parser.add_argument("--size", default="1GiB",
                        help="bytes written and read per pass (default 1GiB)")
    parser.add_argument("--backend", default=",".join(tune.DEFAULT_BACKENDS),
                        help=f"comma list of {', '.join(_BACKENDS)} (default io_uring,libaio)")
    parser.add_argument("--block-size", default="256K,1M,4M",
                        help="comma list of piece sizes, multiples of 4096; a bare K/M/G is binary as in "
                             "fio (default 256K,1M,4M)")
    parser.add_argument("--queue-depth", default="8,32",
                        help="comma list of pieces in flight per thread (default 8,32)")
    parser.add_argument("--threads", default="1",
                        help="comma list of I/O threads (lanes), DeepSpeed's intra_op_parallelism "
                             "(default 1)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes per point, taken round-robin over the grid (default 2)")
    parser.add_argument("--fsync", action="store_true",
                        help="include one fdatasync per write pass (flushes the device's write "
                             "cache: what the disk sustains). Default: none, like the engine's "
                             "swap-outs, DeepSpeed's aio bench and tools/bench/io.py")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with every point and the recommendation")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="draw write and read GB/s per point into a PNG (needs matplotlib)")


def _split(text: str, what: str, parse) -> list:
    values = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        try:
            values.append(parse(item))
        except ValueError as exc:
            raise ValueError(f"--{what}: cannot read {item!r} ({exc})") from None
    if not values:
        raise ValueError(f"--{what}: give at least one value")
    return list(dict.fromkeys(values))


def _backend(name: str) -> str:
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend; choose from {', '.join(_BACKENDS)}")
    return name


def _fio_bytes(text: str, what: str) -> int:
    """fio's convention: a bare K/M/G is binary (1M = 1MiB); "1MB" stays decimal."""
    if text[-1:].lower() in ("k", "m", "g") and text[:-1].isdigit():
        text += "iB"
    return parse_bytes(text, what)


def _size(text: str) -> int:
    return _fio_bytes(text, "--size")


def _block(text: str) -> int:
    n = _fio_bytes(text, "block size")
    if n <= 0 or n % 4096:
        raise ValueError(f"{n} bytes is not a positive multiple of 4096")
    return n


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError("must be >= 1")
    return n


class _ProgressBar:
    """A one-line bar on stderr (redrawn in place on a terminal, one line per point otherwise)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, point: tune.TunePoint, phase: str) -> None:
        if not self.tty and phase != "done":
            return
        width = 24
        filled = int(width * done / total)
        elapsed = time.monotonic() - self.start
        eta = f", ~{elapsed / done * (total - done):.0f} s left" if done else ""
        text = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                f"{point.label()} {phase} ({elapsed:.0f} s{eta})")
        if self.tty:
            sys.stderr.write("\r\033[K" + text + ("\n" if done == total and phase == "done" else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _plot(report: tune.TuneReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.point.label() for r in report.results]
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels) + 2), 4.5))
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [r.write_GBps for r in report.results], width, label="write")
    ax.bar([x + width / 2 for x in xs], [r.read_GBps for r in report.results], width, label="read (cold)")
    ax.set_xticks(list(xs), labels, rotation=45, ha="right")
    ax.set_ylabel("GB/s (1e9 B/s)")
    fsync = "with" if report.writes_include_fsync else "without"
    ax.set_title(f"nvme-tune {report.path} ({report.fs_type}), writes {fsync} fdatasync")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _check_points(points: list[tune.TunePoint]) -> None:
    """Every point of the grid as the aio section takes it, before the sweep (a value out of
    range stopped the sweep when it reached that point, the earlier ones thrown away), named
    by its flag."""
    from infinity.io import AioConfig

    flags = {"aio.queue_depth": "--queue-depth", "aio.thread_count": "--threads",
             "aio.block_size": "--block-size", "aio.backend": "--backend"}
    for point in points:
        try:
            AioConfig(backend=point.backend, block_size=point.block_size,
                      queue_depth=point.queue_depth, thread_count=point.thread_count)
        except ValueError as exc:
            text = str(exc)
            flag = next((f for key, f in flags.items() if text.startswith(key)), None)
            raise ValueError(f"{flag}: {text}" if flag else text) from None


def run(args: argparse.Namespace) -> int:
    # --size reads a bare K/M/G as --block-size does (fio's binary: 4M is 4MiB)
    size = _size(args.size)
    if size < 4096:
        raise ValueError(f"--size {args.size!r}: give at least 4KiB (e.g. 1GiB)")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: give at least 1")
    blocks = _split(args.block_size, "block-size", _block)
    too_big = [b for b in blocks if b > size]
    if too_big:
        # one request would cover the whole file: nothing about that block size is measured
        raise ValueError(f"--size {args.size!r} is smaller than block size(s) "
                         f"{', '.join(format_bytes(b) for b in too_big)}: give a --size of at "
                         "least a few blocks (e.g. 1GiB), or smaller --block-size values")
    points = tune.grid(_split(args.backend, "backend", _backend), blocks,
                       _split(args.queue_depth, "queue-depth", _positive_int),
                       _split(args.threads, "threads", _positive_int))
    _check_points(points)
    if args.plot is not None:
        from infinity.train.metrics import check_plot_path

        # before the sweep, not after it: a sweep of minutes lost its picture
        check_plot_path(args.plot, example="sweep.png")
    # SIGTERM unwinds like Ctrl-C, so the private directory is removed either way. The signal
    # is also remembered: a KeyboardInterrupt raised while Python runs a finalizer (an I/O
    # buffer freed by the garbage collector) is printed and dropped, so the sweep checks the
    # flag at each phase and raises again.
    caught: list[int] = []
    # (SIGINT only where it is not ignored: a sweep started with nohup or in the background)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)
                if sig != signal.SIGINT or signal.getsignal(sig) is signal.default_int_handler}

    def _interrupt(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    bar = _ProgressBar()

    def progress(done: int, total: int, point: tune.TunePoint, phase: str) -> None:
        if caught:
            raise KeyboardInterrupt
        bar(done, total, point, phase)

    for sig in previous:
        signal.signal(sig, _interrupt)
    try:
        report = tune.sweep(args.path, points, size=size, repeats=args.repeats, fsync=args.fsync,
                            progress=progress)
        if caught:
            raise KeyboardInterrupt   # the last phase's interrupt was dropped
    except KeyboardInterrupt:
        print("infinity nvme-tune: interrupted; the test file was removed", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    section = {"aio": report.aio_section()}
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(tune.describe(report))
        print(json.dumps(section, indent=2))
    if args.plot is not None:
        _plot(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
