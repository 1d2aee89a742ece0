"""infinity.train.loop in-process on the torch baseline: accumulation, outputs, phase timers, plot."""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from infinity.base.log import get_logger
from infinity.train.loop import TrainOptions, run_training
from infinity.train.metrics import read_metrics


@pytest.fixture
def log_lines():
    """Records of the package logger (it does not propagate to the root, so caplog misses it)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = get_logger()
    handler = Keep(level=logging.INFO)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_torch_run_with_accumulation_and_wall_clock_breakdown(tmp_path: Path, log_lines) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "wall_clock_breakdown": True, "steps_per_print": 2}))
    metrics = tmp_path / "m.jsonl"
    stream, out = io.StringIO(), io.StringIO()
    result = run_training(TrainOptions(engine="torch", config=str(config), model_size="tiny",
                                       steps=4, seq_len=32, metrics=str(metrics),
                                       progress_every=2), stream=stream, out=out)
    assert [r.step for r in result.records] == [1, 2, 3, 4]
    assert all(r.tokens == 2 * 2 * 32 for r in result.records)
    assert [row["step"] for row in read_metrics(metrics)] == [1, 2, 3, 4]
    assert result.summary.steps == 4 and result.n_params > 0 and result.swap_dirs == []
    assert "torch engine, 0.12M params" in out.getvalue() and "| loss " in out.getvalue()
    assert [line.split("|")[0].strip() for line in stream.getvalue().splitlines()] == \
        ["step 1/4", "step 2/4", "step 4/4"]
    phase_lines = [m for m in log_lines if "mean over the last 2 steps" in m]
    assert len(phase_lines) == 2 and all("forward" in m and "backward" in m for m in phase_lines)


def test_no_phase_timers_without_wall_clock_breakdown(log_lines) -> None:
    run_training(TrainOptions(engine="torch", model_size="tiny", steps=2, seq_len=16),
                 stream=io.StringIO(), out=io.StringIO())
    assert not [m for m in log_lines if "mean over the last" in m]


def test_plot_next_to_metrics_when_matplotlib_is_there(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "m.jsonl"
    result = run_training(TrainOptions(engine="torch", model_size="tiny", steps=2, seq_len=16,
                                       metrics=str(metrics)), stream=io.StringIO(), out=io.StringIO())
    assert result.plot == str(tmp_path / "m.png") and Path(result.plot).stat().st_size > 0


def test_the_plot_never_replaces_the_metrics(tmp_path: Path) -> None:
    """--metrics run.png: the default picture goes beside it (it replaced the metrics, every
    JSON line lost); --plot naming the --metrics file is refused before the run."""
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "run.png"
    result = run_training(TrainOptions(engine="torch", model_size="tiny", steps=2, seq_len=16,
                                       metrics=str(metrics)), stream=io.StringIO(), out=io.StringIO())
    assert result.plot == str(tmp_path / "run.png.png")
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    with pytest.raises(ValueError, match="--plot .* is the --metrics file"):
        run_training(TrainOptions(engine="torch", model_size="tiny", steps=1, seq_len=16,
                                  metrics=str(tmp_path / "b.png"), plot=str(tmp_path / "b.png")),
                     stream=io.StringIO(), out=io.StringIO())
    assert not (tmp_path / "b.png").exists()


def test_plot_off_writes_no_plot(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "m.jsonl"
    result = run_training(TrainOptions(engine="torch", model_size="tiny", steps=1, seq_len=16,
                                       metrics=str(metrics), plot="off"),
                          stream=io.StringIO(), out=io.StringIO())
    assert result.plot is None and sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


def test_explicit_plot_without_matplotlib_is_a_usage_error(tmp_path: Path, monkeypatch) -> None:
    import infinity.train.loop as loop
    import infinity.train.metrics as metrics

    for module in (loop, metrics):
        monkeypatch.setattr(module, "plot_available", lambda: False)
    with pytest.raises(ValueError, match="needs matplotlib"):
        run_training(TrainOptions(engine="torch", model_size="tiny", steps=1, seq_len=16,
                                  plot=str(tmp_path / "p.png")), stream=io.StringIO(),
                     out=io.StringIO())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", [-1, 2**63, 99999999999999999999])
def test_a_seed_torch_cannot_take_is_refused_naming_the_flag(seed: int) -> None:
    with pytest.raises(ValueError, match=f"--seed must be from 0 to 2\\*\\*63 - 1, got {seed}"):
        run_training(TrainOptions(engine="torch", model_size="tiny", steps=1, seq_len=16,
                                  seed=seed), stream=io.StringIO(), out=io.StringIO())


def test_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        run_training(TrainOptions(engine="torch", steps=0))
