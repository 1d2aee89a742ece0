"""infinity.train.metrics and .progress: records, the JSON-lines file, summary, bar, plot."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from infinity.train.metrics import (MetricsWriter, StepRecord, read_metrics, render_summary,
                                    summarize, write_plot)
from infinity.train.progress import ProgressBar, format_duration, format_step

STATS = {"step_s": 2.0, "compute_s": 1.0, "io_wait_s": 0.5, "optimizer_s": 0.4, "comm_s": 0.1,
         "device_bytes": 10, "host_bytes": 20, "nvme_bytes": 30, "io_read_bytes": 3e9,
         "io_write_bytes": 1e9, "prefetch_hit_ratio": 0.9}


def _record(step: int, loss: float, **changes) -> StepRecord:
    return StepRecord.from_stats(step, loss, 1e-3, 256, {**STATS, **changes})


def test_record_from_engine_stats() -> None:
    r = _record(1, 3.5)
    assert (r.step_s, r.compute_s, r.io_wait_s, r.optimizer_s, r.comm_s) == (2.0, 1.0, 0.5, 0.4, 0.1)
    assert (r.device_bytes, r.host_bytes, r.nvme_bytes) == (10, 20, 30)
    assert r.tokens_per_s == 128.0
    assert r.io_gbps == pytest.approx(2.0)  # (3 + 1) GB over 2 s
    sparse = StepRecord.from_stats(2, 1.0, 0.0, 8, {"step_s": 1.0})  # missing keys are 0
    assert sparse.io_wait_s == 0.0 and sparse.io_gbps == 0.0


def test_metrics_file_has_one_line_per_step_with_the_promised_keys(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    assert not path.exists()  # created at the first record: a failed start leaves nothing
    for step in (1, 2):
        writer.write(_record(step, 4.0 - step))
        assert len(path.read_text().splitlines()) == step  # flushed per line
    writer.close()
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 2.0
    for key in ("step", "loss", "step_s", "compute_s", "io_wait_s", "optimizer_s", "comm_s",
                "device_bytes", "host_bytes", "nvme_bytes", "io_gbps", "tokens_per_s", "lr"):
        assert key in rows[0], key
    json.dumps(rows)  # plain JSON values


def test_a_resumed_run_replaces_the_records_written_after_its_checkpoint(tmp_path: Path) -> None:
    """Interrupted after step 5 with a checkpoint at step 3: the resumed run starts at step 4,
    and the records of steps 4-5 it repeats are dropped (they were listed twice); a line that
    is not a record is kept."""
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    for step in range(1, 6):
        writer.write(_record(step, 1.0))
    writer.close()
    with path.open("a") as f:
        f.write("# a note of the user's\n")
    resumed = MetricsWriter(path, append=True)
    for step in range(4, 9):
        resumed.write(_record(step, 2.0))
    resumed.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()
             if line.startswith("{")]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert "# a note of the user's" in path.read_text()
    assert [r["loss"] for r in map(json.loads, path.read_text().splitlines()[:3])] == [1.0] * 3


def test_metrics_path_is_checked_up_front(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory"):
        MetricsWriter(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MetricsWriter(tmp_path / "no" / "m.jsonl")


def test_summary_compares_the_first_and_last_ten_steps() -> None:
    records = [_record(i + 1, 30.0 - i, step_s=10.0 if i == 0 else 2.0) for i in range(30)]
    s = summarize(records)
    assert s.steps == 30 and s.tokens == 30 * 256
    assert s.loss_first == pytest.approx(25.5) and s.loss_last == pytest.approx(5.5)
    assert s.loss_ratio == pytest.approx(5.5 / 25.5)
    assert s.median_step_s == 2.0  # the warm-up step stays out of the median
    assert s.median_phases["io_wait_s"] == 0.5
    assert s.wall_s == pytest.approx(10.0 + 29 * 2.0)
    assert s.peak_tiers == {"device_bytes": 10, "host_bytes": 20, "nvme_bytes": 30}
    text = render_summary(s)
    assert "ratio 0.216" in text and "compute 1.000" in text and "I/O wait 0.500" in text
    with pytest.raises(ValueError, match="no steps"):
        summarize([])
    # a short run: halves that do not overlap (6 steps: 3 and 3), one step alone
    short = summarize(records[:6])
    assert (short.loss_first, short.loss_last) == (pytest.approx(29.0), pytest.approx(26.0))
    assert "(mean of first 3)" in render_summary(short)
    assert summarize(records[:1]).loss_ratio == 1.0


def test_progress_redraws_in_place_on_a_tty() -> None:
    stream = io.StringIO()
    bar = ProgressBar(3, stream=stream, tty=True)
    for step in (1, 2, 3):
        bar.update(_record(step, 2.0))
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")
    assert "step 3/3" in text


def test_progress_off_a_tty_prints_every_n_steps_and_the_last() -> None:
    stream = io.StringIO()
    bar = ProgressBar(10, stream=stream, tty=False, every=4)
    for step in range(1, 11):
        bar.update(_record(step, 2.0))
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split("|")[0].strip() for line in lines] == \
        ["step  1/10", "step  4/10", "step  8/10", "step 10/10"]
    assert "\r" not in stream.getvalue()


def test_progress_line_shows_every_quantity() -> None:
    line = format_step(_record(7, 1.23456), 100)
    for part in ("step   7/100", "loss 1.2346", "128 tok/s", "compute 1.00", "io 0.50",
                 "opt 0.40", "comm 0.10", "dev 10 B", "host 20 B", "nvme 30 B", "io 2.00 GB/s"):
        assert part in line, (part, line)


def test_progress_shows_the_time_left_from_the_recent_steps() -> None:
    """The first step (the warm-up) is left out once there are others: 1 step of 9 s then 2 s
    a step, 10 steps: 12 s left after step 4, none shown after the last."""
    stream = io.StringIO()
    bar = ProgressBar(10, stream=stream, tty=False, every=4)
    for step in range(1, 11):
        bar.update(_record(step, 2.0, step_s=9.0 if step == 1 else 2.0))
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("| eta 1m21s"), lines[0]       # 9 x 9 s: only the first known
    assert lines[1].endswith("| eta 12 s"), lines[1]
    assert "eta" not in lines[-1], lines[-1]
    assert [format_duration(s) for s in (44.6, 185, 7800)] == ["45 s", "3m05s", "2h10m"]


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = write_plot([_record(i, 5.0 - i / 10) for i in range(1, 21)], tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
