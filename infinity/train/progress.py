"""The progress line of ``infinity train`` on stderr.

Why our own: it shows what an out-of-core run needs to be judged by (loss, tokens/s, the step
time split into compute / I/O wait / optimizer / communication, bytes held per tier, swap I/O
GB/s), which a generic bar does not, and the time left (the mean of the last ETA_STEPS steps'
times, the first left out once there are others: it holds the warm-up). On a terminal one line
is redrawn in place; otherwise (a log file, CI) one line is written every ``every`` steps and at
the last step, so logs stay short.
"""
from __future__ import annotations

import sys
import time
from typing import IO

from infinity.base.sizes import format_bytes
from infinity.train.metrics import StepRecord


ETA_STEPS = 10


def format_duration(seconds: float) -> str:
    """``seconds`` as a person reads a time left: 45 s, 3m05s, 2h10m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_step(record: StepRecord, total_steps: int) -> str:
    """One step as a single line (no newline)."""
    r = record
    width = len(str(total_steps))
    moved = r.comm_sent_bytes + r.comm_received_bytes
    # with several ranks: the bytes rank 0 sent and received in the step's collectives
    comm = f" | comm {format_bytes(moved)}" if moved else ""
    return (f"step {r.step:>{width}}/{total_steps} | loss {r.loss:.4f} | "
            f"{r.tokens_per_s:,.0f} tok/s | {r.step_s:.2f} s (compute {r.compute_s:.2f}, "
            f"io {r.io_wait_s:.2f}, opt {r.optimizer_s:.2f}, comm {r.comm_s:.2f}) | "
            f"dev {format_bytes(r.device_bytes)} host {format_bytes(r.host_bytes)} "
            f"nvme {format_bytes(r.nvme_bytes)} | io {r.io_gbps:.2f} GB/s{comm}")


class ProgressBar:
    """Shows each step on ``stream`` (stderr by default): in place on a TTY, else every N steps."""

    def __init__(self, total_steps: int, *, stream: IO[str] | None = None, every: int | None = None,
                 tty: bool | None = None) -> None:
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", lambda: False)())
        # Off a terminal: about 20 lines per run, at least one per step for short runs.
        self.every = every if every is not None else max(1, total_steps // 20)
        self._open_line = False
        self._started = time.perf_counter()
        self._step_times: list[float] = []

    def eta_s(self, record: StepRecord) -> float:
        """Seconds left after ``record``'s step, from the recent steps' times."""
        self._step_times.append(record.step_s)
        recent = self._step_times[1:] if len(self._step_times) > 1 else self._step_times
        recent = recent[-ETA_STEPS:]
        return max(0, self.total_steps - record.step) * sum(recent) / len(recent)

    def update(self, record: StepRecord) -> None:
        line = format_step(record, self.total_steps)
        eta = self.eta_s(record)
        if record.step < self.total_steps:
            line += f" | eta {format_duration(eta)}"
        if self.tty:
            elapsed = time.perf_counter() - self._started
            self.stream.write(f"\r\x1b[2K{line} | {elapsed:.0f} s")
            self._open_line = True
        elif record.step % self.every == 0 or record.step == self.total_steps or record.step == 1:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line so later output starts on a fresh one."""
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
