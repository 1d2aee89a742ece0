"""The dry run's timeline: where each resource of one rank was busy, as a Chrome trace-event
file (``infinity plan --dry-run --trace FILE``; loads in Perfetto or chrome://tracing) or a
picture (``--plot FILE.png``), so a user sees where the step waits.

Rows, one per resource the simulated clock runs (simulate/clock.py,
simulate/copies.py): the training thread's compute (the GPU's forward and backward kernels, or
the CPU's), the time it waits for a transfer, a copy, a slot, a step or a collective, the
host-to-device copies ("H2D": a unit's parameters going up, each labelled with its unit), the
device-to-host copies ("D2H": a unit's gradient coming down), the NVMe (reads and writes share
the drives), the CPU Adam (the step stream) and the collectives. The copy rows are a GPU's
copy streams; on a CPU device copies are free and immediate (as the engine's are) and the rows
stay empty.

A step's time is the training thread's: its compute plus its waits, i.e. the schedule's
critical path through every resource it waited on; the other rows show what ran behind it.
So it is at least the busiest resource's time in the step (each serves one thing at a time)
and at most all of their times together (the thread waits only while some resource works for
it); where it is near the former, the others overlap the busiest.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from infinity.simulate.clock import COMPUTE, WAIT
from infinity.simulate.copies import D2H, H2D
from infinity.simulate.stepper import HOST_ADDS

if TYPE_CHECKING:
    from infinity.commands.dry_run import DryRunReport

__all__ = ["ROWS", "busy_seconds", "union", "covered", "hidden_share", "chrome_trace",
           "write_trace", "plot_timeline"]

ROWS = (COMPUTE, WAIT, H2D, D2H, "NVMe", "CPU Adam", HOST_ADDS, "collectives")
"""The timeline's rows, top to bottom."""

Span = tuple[str, float, float, str]


def busy_seconds(spans: Sequence[Span], start: float, end: float) -> dict[str, float]:
    """Seconds each resource was busy between ``start`` and ``end`` (spans clipped to it)."""
    busy = {row: 0.0 for row in ROWS}
    for resource, lo, hi, _ in spans:
        lo, hi = max(lo, start), min(hi, end)
        if hi > lo:
            busy[resource] = busy.get(resource, 0.0) + hi - lo
    return busy


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly what ``intervals`` cover (empty ones
    dropped)."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if hi <= lo:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def covered(intervals: Iterable[tuple[float, float]],
            cover: Iterable[tuple[float, float]]) -> float:
    """Length of the part of ``intervals`` (their union) that ``cover`` also covers."""
    a, b = union(intervals), union(cover)
    total, j = 0.0, 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            total += min(hi, b[k][1]) - max(lo, b[k][0])
            k += 1
    return total


def hidden_share(spans: Sequence[Span], row: str, start: float, end: float,
                 behind: str = COMPUTE) -> float | None:
    """The share of ``row``'s busy time between ``start`` and ``end`` during which ``behind``
    was busy too (None: ``row`` was idle): for a copy row, the part of the copies hidden
    behind compute. It is the figure a GPU profile measures from its kernels and copies
    (tools/bench/gpu_profile.py, "hidden", with ``covered`` too), predicted: the two are
    compared there."""
    def clipped(name: str) -> list[tuple[float, float]]:
        return [(max(lo, start), min(hi, end)) for r, lo, hi, _ in spans if r == name]

    busy = sum(hi - lo for lo, hi in union(clipped(row)))
    if busy <= 0:
        return None
    return covered(clipped(row), clipped(behind)) / busy


def chrome_trace(report: DryRunReport) -> dict[str, Any]:
    """The report's timeline as Chrome trace events: one complete event ("X") per busy span,
    one row (thread) per resource, an instant event at each step's start; times in
    microseconds of the simulated clock."""
    rows = list(ROWS) + sorted({r for r, *_ in report.spans} - set(ROWS))
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1,
         "args": {"name": "infinity plan --dry-run (one rank, simulated clock)"}}]
    for tid, row in enumerate(rows):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"name": row}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"sort_index": tid}})
    for number, step in enumerate(report.steps, 1):
        events.append({"name": f"step {number}", "ph": "i", "s": "g", "pid": 1, "tid": 0,
                       "ts": step.start * 1e6})
    for resource, lo, hi, what in report.spans:
        events.append({"name": what or resource, "cat": resource, "ph": "X", "pid": 1,
                       "tid": rows.index(resource), "ts": lo * 1e6, "dur": (hi - lo) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"simulated_step_s": report.steps[-1].seconds,
                          "busy_s_last_step": report.busy_s()}}


def write_trace(report: DryRunReport, path: str | Path) -> None:
    """Write ``chrome_trace(report)`` to ``path`` as JSON."""
    Path(path).write_text(json.dumps(chrome_trace(report)))


def plot_timeline(report: DryRunReport, path: str | Path) -> None:
    """A picture of the last step's timeline (matplotlib), one bar row per resource."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"--plot {path} needs matplotlib (pip install matplotlib); "
                           "--trace FILE writes the same timeline as a Chrome trace "
                           "without it") from exc
    step = report.steps[-1]
    start, end = step.start, step.start + step.seconds
    rows = [row for row in ROWS if any(r == row for r, *_ in report.spans)]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.2))
    for y, row in enumerate(rows):
        bars = [(max(lo, start) - start, min(hi, end) - max(lo, start))
                for r, lo, hi, _ in report.spans if r == row and hi > start and lo < end]
        ax.broken_barh(bars, (y - 0.35, 0.7))
    busy = report.busy_s()
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{row} ({busy.get(row, 0.0):.2f} s)" for row in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(step.seconds, 1e-9))
    ax.set_xlabel("seconds into the step (simulated)")
    ax.set_title(f"infinity plan --dry-run: one step of one rank, {step.seconds:.2f} s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
