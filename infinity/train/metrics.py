"""Per-step metrics of ``infinity train``: the record, the JSON-lines file, the summary, the plot.

Why one module: the progress bar, ``--metrics FILE``, the closing summary table and ``--plot``
all read the same ``StepRecord``, so a number means the same thing everywhere. One JSON line per
optimizer step is written and flushed as the step ends, so a killed run keeps its metrics.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes

_log = get_logger("train.metrics")

PHASES = ("compute_s", "io_wait_s", "optimizer_s", "comm_s")
"""The split of a step's time, in the engine's step_stats keys."""
TIERS = ("device_bytes", "host_bytes", "nvme_bytes")


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one optimizer step did (one JSON line of ``--metrics``)."""

    step: int
    """Optimizer step, from 1."""
    loss: float
    """Mean loss over the step's micro-batches."""
    lr: float
    """Learning rate the step used."""
    tokens: int
    """Tokens consumed by the step (all micro-batches)."""
    step_s: float
    """Wall time of the step (first forward to the end of the optimizer step)."""
    compute_s: float
    """Forward and backward compute."""
    io_wait_s: float
    """Time compute waited for swap I/O."""
    optimizer_s: float
    """Optimizer step (including its own swap I/O that did not overlap)."""
    comm_s: float
    """Collectives (0 at world size 1)."""
    device_bytes: int
    """Bytes held in the DEVICE tier at the end of the step."""
    host_bytes: int
    """Bytes held in the HOST tier."""
    nvme_bytes: int
    """Bytes held in swap files."""
    io_read_bytes: int
    """Bytes read from swap files during the step."""
    io_write_bytes: int
    """Bytes written to swap files during the step."""
    comm_sent_bytes: int = 0
    """Bytes this rank sent in the step's collectives (0 at world size 1); with several ranks the
    record is rank 0's, and ``tokens`` and ``loss`` are all ranks' together."""
    comm_received_bytes: int = 0
    """Bytes this rank received in the step's collectives."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def io_gbps(self) -> float:
        """Swap I/O (read + write) in GB/s over the step's wall time."""
        moved = self.io_read_bytes + self.io_write_bytes
        return moved / self.step_s / 1e9 if self.step_s > 0 else 0.0

    @classmethod
    def from_stats(cls, step: int, loss: float, lr: float, tokens: int,
                   stats: dict[str, Any]) -> "StepRecord":
        """A record from an engine's ``step_stats()`` dict (missing keys count as 0)."""
        def num(key: str) -> float:
            value = stats.get(key, 0.0)
            return float(value) if value is not None else 0.0

        return cls(step=step, loss=float(loss), lr=float(lr), tokens=int(tokens),
                   step_s=num("step_s"), compute_s=num("compute_s"), io_wait_s=num("io_wait_s"),
                   optimizer_s=num("optimizer_s"), comm_s=num("comm_s"),
                   device_bytes=int(num("device_bytes")), host_bytes=int(num("host_bytes")),
                   nvme_bytes=int(num("nvme_bytes")), io_read_bytes=int(num("io_read_bytes")),
                   io_write_bytes=int(num("io_write_bytes")),
                   comm_sent_bytes=int(num("comm_sent_bytes")),
                   comm_received_bytes=int(num("comm_received_bytes")))

    def to_json(self) -> dict[str, Any]:
        """The JSON line: every field plus ``tokens_per_s`` and ``io_gbps``."""
        out = asdict(self)
        out["tokens_per_s"] = round(self.tokens_per_s, 3)
        out["io_gbps"] = round(self.io_gbps, 4)
        return out


class MetricsWriter:
    """Writes one JSON line per step to ``path``, flushed per line.

    The path is checked at construction (``check_writable``); the file is created (or truncated,
    or with ``append`` added to) at the first record, so a run that fails before its first step
    leaves no file behind.
    """

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        check_writable(self.path, "--metrics")
        self.append = append     # a resumed run adds its steps to the interrupted run's
        self._file: IO[str] | None = None
        self._closed = False

    def write(self, record: StepRecord) -> None:
        if self._closed:
            raise RuntimeError(f"metrics file {self.path} is already closed")
        if self._file is None:
            if self.append:
                self._drop_records_from(record.step)
            self._file = open(self.path, "a" if self.append else "w", encoding="utf-8")
        self._file.write(json.dumps(record.to_json()) + "\n")
        self._file.flush()

    def _drop_records_from(self, step: int) -> None:
        """A resumed run starts again at its checkpoint's step: the interrupted run's records of
        that step and later (written after the checkpoint) are dropped, so each step appears
        once. Other lines are kept as they are; the file is replaced whole (temp + rename)."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if not _record_at_or_after(line, step)]
        if len(kept) == len(lines):
            return
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.writelines(kept)
            os.replace(temp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None


def _record_at_or_after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and isinstance(record.get("step"), int) and \
        record["step"] >= step


def write_probe(directory: Path) -> None:
    """Create a file in ``directory`` and remove it at once; raises OSError where this process
    cannot write there (permission bits say nothing for root, nor for a read-only mount or
    /proc)."""
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".infinity-probe-")
    os.close(fd)
    os.unlink(probe)


def check_writable(path: Path, flag: str, example: str = "metrics.jsonl") -> None:
    """Raise now, not after the run, when ``path`` cannot be written (the run's results would be lost).

    Writing is tried for real (a probe file next to it, removed at once; an existing file is
    opened for appending, which changes nothing): permission bits say nothing for root, nor for
    a read-only mount or /proc. The file itself is not created, so a run that fails before its
    first step leaves none behind.
    """
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; pass a file path such as "
                         f"{path / example}")
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"{flag} {path}: directory {parent} does not exist; create it "
                                "or choose another path")
    try:
        if path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        else:
            write_probe(parent)
    except OSError as exc:
        where = path if path.exists() else parent
        raise PermissionError(f"{flag} {path}: cannot write {where} ({exc.strerror or exc}); "
                              "choose a writable path") from None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``--metrics`` file, as dicts (for tests and tools)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclass(frozen=True, kw_only=True)
class Summary:
    """What a run did, over its steps (the first step, which warms up, is kept out of the medians)."""

    steps: int
    tokens: int
    wall_s: float
    """Sum of step times."""
    loss_first: float
    """Mean loss of the first ``loss_window`` steps."""
    loss_last: float
    """Mean loss of the last ``loss_window`` steps."""
    median_step_s: float
    median_phases: dict[str, float]
    tokens_per_s: float
    """Tokens over the summed step time."""
    peak_tiers: dict[str, int]
    io_read_bytes: int
    io_write_bytes: int
    io_gbps: float
    """Swap bytes moved over the summed step time."""
    comm_sent_bytes: int = 0
    """Bytes sent in collectives over the run (this rank's)."""
    comm_received_bytes: int = 0
    """Bytes received in collectives over the run (this rank's)."""

    @property
    def loss_window(self) -> int:
        """Steps in each loss mean: 10, or half the run when shorter (never overlapping: the
        windows of a 6-step run were all six, and compared the run with itself)."""
        return loss_window(self.steps)

    @property
    def loss_ratio(self) -> float:
        """``loss_last / loss_first``: below 1 when the loss fell."""
        return self.loss_last / self.loss_first if self.loss_first else math.nan


def loss_window(steps: int) -> int:
    """See ``Summary.loss_window``."""
    return max(1, min(10, steps // 2))


def summarize(records: Sequence[StepRecord]) -> Summary:
    """Summary of ``records`` (at least one)."""
    if not records:
        raise ValueError("no steps were recorded; nothing to summarize")
    window = loss_window(len(records))
    timed = list(records[1:]) or list(records)
    wall = sum(r.step_s for r in records)
    read = sum(r.io_read_bytes for r in records)
    written = sum(r.io_write_bytes for r in records)
    tokens = sum(r.tokens for r in records)
    return Summary(
        steps=len(records), tokens=tokens, wall_s=wall,
        loss_first=statistics.fmean(r.loss for r in records[:window]),
        loss_last=statistics.fmean(r.loss for r in records[-window:]),
        median_step_s=statistics.median(r.step_s for r in timed),
        median_phases={p: statistics.median(getattr(r, p) for r in timed) for p in PHASES},
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        peak_tiers={t: max(getattr(r, t) for r in records) for t in TIERS},
        io_read_bytes=read, io_write_bytes=written,
        io_gbps=(read + written) / wall / 1e9 if wall > 0 else 0.0,
        comm_sent_bytes=sum(r.comm_sent_bytes for r in records),
        comm_received_bytes=sum(r.comm_received_bytes for r in records))


def render_summary(summary: Summary, title: str = "infinity train summary") -> str:
    """The closing table, as Markdown-style text."""
    s = summary
    ph = s.median_phases
    rows = [
        ("steps", f"{s.steps} ({s.tokens:,} tokens)"),
        ("loss", f"{s.loss_first:.4f} (mean of first {s.loss_window}) -> {s.loss_last:.4f} "
                 f"(mean of last {s.loss_window}), ratio {s.loss_ratio:.3f}"),
        ("step time (median)", f"{s.median_step_s:.3f} s: compute {ph['compute_s']:.3f}, I/O wait "
                               f"{ph['io_wait_s']:.3f}, optimizer {ph['optimizer_s']:.3f}, "
                               f"comm {ph['comm_s']:.3f}"),
        ("throughput", f"{s.tokens_per_s:,.1f} tokens/s over {s.wall_s:.1f} s of steps"),
        ("peak held", f"device {format_bytes(s.peak_tiers['device_bytes'])}, host "
                      f"{format_bytes(s.peak_tiers['host_bytes'])}, NVMe "
                      f"{format_bytes(s.peak_tiers['nvme_bytes'])}"),
        ("swap I/O", f"read {format_bytes(s.io_read_bytes)}, written "
                     f"{format_bytes(s.io_write_bytes)}, {s.io_gbps:.2f} GB/s"),
    ]
    if s.comm_sent_bytes or s.comm_received_bytes:
        rows.append(("collectives (rank 0)",
                     f"sent {format_bytes(s.comm_sent_bytes)}, received "
                     f"{format_bytes(s.comm_received_bytes)} "
                     f"({format_bytes(s.comm_sent_bytes // s.steps)} / "
                     f"{format_bytes(s.comm_received_bytes // s.steps)} a step)"))
    width = max(len(k) for k, _ in rows)
    lines = [title, "| " + "what".ljust(width) + " | value |", "|" + "-" * (width + 2) + "|---|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def plot_available() -> bool:
    """True when matplotlib can be imported (``pip install infinity-offload[plot]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_formats() -> set[str]:
    """The file extensions matplotlib writes (png, pdf, svg, ...)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return set(Figure().canvas.get_supported_filetypes())


def check_plot_path(path: Path, flag: str = "--plot", example: str = "plot.png") -> Path:
    """Raise now, before a run or a sweep of minutes, when the picture asked for at ``path``
    could not be drawn at its end: matplotlib missing, a file type it does not write, a path
    that cannot be written (see ``check_writable``). Returns ``path``."""
    if not plot_available():
        raise ValueError(f"{flag} {path} needs matplotlib, which is not installed; pip install "
                         f"matplotlib (or infinity-offload[plot]) or drop {flag}")
    check_writable(path, flag, example=example)
    formats = plot_formats()
    if path.suffix.lower().lstrip(".") not in formats:
        kind = f"{path.suffix} file" if path.suffix else "file without an extension"
        raise ValueError(f"{flag} {path}: matplotlib cannot write a {kind}; end the name in one "
                         f"of {', '.join('.' + f for f in sorted(formats))} (e.g. {example})")
    return path


def write_plot(records: Iterable[StepRecord], path: str | Path) -> Path:
    """A PNG of the loss (left) and of the step-time split (right); needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    path = Path(path)
    steps = [r.step for r in records]
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4))
    ax_loss.plot(steps, [r.loss for r in records], color="tab:blue")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_loss.grid(alpha=0.3)
    bottom = [0.0] * len(records)
    labels = {"compute_s": "compute", "io_wait_s": "I/O wait", "optimizer_s": "optimizer",
              "comm_s": "communication"}
    for phase in PHASES:
        values = [getattr(r, phase) for r in records]
        ax_time.bar(steps, values, bottom=bottom, label=labels[phase], width=0.9)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_time.plot(steps, [r.step_s for r in records], color="black", linewidth=1, label="step")
    ax_time.set_xlabel("step")
    ax_time.set_ylabel("seconds")
    ax_time.set_title("step time split")
    ax_time.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    _log.info("wrote plot %s", path)
    return path
