"""The dry run's timeline (commands/dry_run_trace.py, ``infinity plan --dry-run --trace FILE
--plot FILE.png``): a Chrome trace with one row per resource, and a step whose time is the
training thread's and is bounded by what the resources did: at least the busiest resource's
time (every resource serves one thing at a time), at most all of their times together (the
thread waits only while some resource works for it). Small targets on a described GPU, so that
the parameters and Adam states stream from NVMe behind compute, and two GPUs for the
collectives."""
from __future__ import annotations

import json

import pytest

from infinity import cli
from infinity.commands.dry_run_trace import hidden_share

# 85M (the main job's model) on a 2.3 GiB GPU: ZeRO-Infinity with NVMe (4.2 GiB of host: both
# on NVMe; two GPUs with 8.6 GiB: the optimizer on NVMe, collectives between them)
TARGETS = {
    "1 GPU, both on NVMe": ["--gpus", "1", "--host-memory", "4.2GiB"],
    "2 GPUs, optimizer on NVMe": ["--gpus", "2", "--host-memory", "8.6GiB"],
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_the_timeline_bounds_the_step_and_loads_as_a_chrome_trace(tmp_path, capsys,
                                                                  target: str) -> None:
    trace, picture = tmp_path / "step.json", tmp_path / "step.png"
    assert cli.main(["plan", "--model-size", "85M", "--gpu-memory", "2.3GiB", "--nvme", "1TB",
                     *TARGETS[target], "--dry-run", "--json", "--trace", str(trace),
                     "--plot", str(picture)]) == 0
    plan = json.loads(capsys.readouterr().out)
    report = plan["dry_run"]
    step, busy = report["simulated_step_s"], report["busy_s"]
    resources = {row: s for row, s in busy.items() if row != "compute waits"}
    assert busy["NVMe"] > 0 and busy["compute"] > 0
    if "2 GPUs" in target:
        assert busy["collectives"] > 0
    assert max(resources.values()) <= step * (1 + 1e-9)
    assert step <= sum(resources.values()) * (1 + 1e-9)
    # the training thread is its compute and its waits
    assert busy["compute"] + busy["compute waits"] == pytest.approx(step, rel=1e-9)
    # each rank steps its own shard at its share of the node's CPU Adam: the analytical
    # step's figure (the whole model at the node's rate), whatever the number of ranks
    assert busy["CPU Adam"] == pytest.approx(plan["links"]["CPU Adam"], rel=0.01)

    events = json.loads(trace.read_text())["traceEvents"]
    rows = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    assert {"compute", "compute waits", "H2D", "D2H", "NVMe", "CPU Adam", "collectives"} \
        <= set(rows)
    assert busy["H2D"] > 0 and busy["D2H"] > 0      # a GPU's copies take the link's time
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] > 0 and e["tid"] in rows.values() for e in spans)
    # NVMe reads run behind compute (prefetch): some read overlaps some forward or backward
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == rows["compute"]]
    nvme = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == rows["NVMe"]]
    assert any(a < d and c < b for a, b in nvme for c, d in compute)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the copies' share hidden behind compute, as the report gives it, from the trace's own
    # spans of the last step (at 1 µs a step: a point-by-point count of the overlap)
    start = max(e["ts"] for e in events if e["ph"] == "i")
    last = [(e["tid"], max(e["ts"], start), e["ts"] + e["dur"]) for e in spans
            if e["ts"] + e["dur"] > start]
    busy_at = {row: {t for tid, lo, hi in last if tid == rows[row]
                     for t in range(int(lo), int(hi))} for row in ("compute", "H2D", "D2H")}
    for row in ("H2D", "D2H"):
        counted = len(busy_at[row] & busy_at["compute"]) / len(busy_at[row])
        assert report["hidden_behind_compute"][row] == pytest.approx(counted, abs=0.02)


def test_a_timeline_needs_the_dry_run(capsys) -> None:
    assert cli.main(["plan", "--model-size", "85M", "--trace", "t.json"]) == 2
    assert "add --dry-run" in capsys.readouterr().err


def test_the_hidden_share_counts_copy_time_under_compute_once() -> None:
    spans = [("compute", 0.0, 4.0, "f"), ("compute", 3.0, 6.0, "g"),   # overlapping kernels
             ("H2D", 1.0, 2.0, "a"), ("H2D", 1.5, 2.5, "b"),           # overlapping copies
             ("H2D", 5.0, 8.0, "c"), ("D2H", 9.0, 10.0, "d")]
    # H2D busy [1, 2.5] and [5, 8]: 4.5 s, of which [1, 2.5] and [5, 6] under compute
    assert hidden_share(spans, "H2D", 0.0, 10.0) == pytest.approx(2.5 / 4.5)
    assert hidden_share(spans, "D2H", 0.0, 10.0) == 0.0
    # clipped to the window: [5, 6] of [5, 7]
    assert hidden_share(spans, "H2D", 4.5, 7.0) == pytest.approx(0.5)
    assert hidden_share(spans, "H2D", 8.5, 9.0) is None       # no copies: no share


def test_a_trace_or_plot_path_that_cannot_be_written_is_refused_first(tmp_path, capsys,
                                                                      monkeypatch) -> None:
    """A directory, or a file in a directory that does not exist: refused in one line before
    the dry run (an IsADirectoryError after it escaped as a traceback)."""
    from infinity.commands import plan

    def no_dry_run(*args, **kwargs):
        raise AssertionError("planned before the path was checked")

    monkeypatch.setattr(plan, "target_from_args", no_dry_run)
    from infinity.train.metrics import plot_available

    cases = [("--trace", tmp_path, "is a directory"),
             ("--plot", tmp_path / "none" / "x.png", "does not exist")]
    if plot_available():
        # a file type matplotlib does not write: it failed after the dry run, the trace written
        cases.append(("--plot", tmp_path / "step.json", "matplotlib cannot write a .json file"))
    for flag, path, said in cases:
        assert cli.main(["plan", "--model-size", "tiny", "--dry-run", flag, str(path)]) == 2
        assert said in capsys.readouterr().err
