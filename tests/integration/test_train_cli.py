"""``infinity train`` end to end: a real out-of-core run on a tiny preset, and bad input.

The run goes through the installed entry point in a subprocess (as a user types it), with its
swap directory on a real disk (``disk_dir``), and is judged by its --metrics file and by what it
leaves behind. Bad input runs in-process through ``infinity.cli.main`` (fast): one line, exit 2,
nothing created.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infinity.cli import main
from infinity.train.metrics import plot_available, read_metrics

METRIC_KEYS = ("step", "loss", "step_s", "compute_s", "io_wait_s", "optimizer_s", "comm_s",
               "device_bytes", "host_bytes", "nvme_bytes", "io_read_bytes", "io_write_bytes",
               "io_gbps", "tokens_per_s")


def _infinity(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INFINITY_LOG_LEVEL": "INFO"}
    return subprocess.run([sys.executable, "-m", "infinity.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_tiny_out_of_core_run_writes_metrics_and_cleans_up(disk_dir: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    proc = _infinity("train", "--model-size", "tiny", "--steps", "20", "--seq-len", "64",
                     "--lr", "3e-3", "--nvme-path", str(disk_dir), "--host-budget", "256MiB",
                     "--metrics", str(metrics), "--progress-every", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for row in rows:
        for key in METRIC_KEYS:
            assert key in row, (key, row)
        assert row["step_s"] > 0 and row["loss"] == row["loss"]  # not NaN
    # Parameters and optimizer states really lived in swap files and moved through them.
    assert all(r["nvme_bytes"] > 0 for r in rows), rows[-1]
    assert sum(r["io_read_bytes"] for r in rows) > 0 and sum(r["io_write_bytes"] for r in rows) > 0
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first, (first, last)  # even 20 steps of a tiny model learn byte frequencies
    # The progress went to stderr (one line per 5 steps off a TTY), the summary to stdout.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in progress] == \
        ["1/20", "5/20", "10/20", "15/20", "20/20"]
    assert "| loss " in proc.stdout and "ratio" in proc.stdout
    assert list(disk_dir.iterdir()) == []  # the swap directory was removed


def test_engine_torch_is_the_same_run_in_plain_pytorch(disk_dir: Path, tmp_path: Path) -> None:
    """`--engine torch` starts from the same weights and batches as the out-of-core engine, so
    their losses agree step by step (fp32, lr 3e-3, 3 steps)."""
    from infinity.train.run_config import demo_config

    config = demo_config()
    config["infinity"]["compute_dtype"] = "fp32"    # "auto" is bf16 on a CPU with native bf16
    (tmp_path / "fp32.json").write_text(json.dumps(config))
    losses = {}
    for engine in ("infinity", "torch"):
        metrics = tmp_path / f"{engine}.jsonl"
        proc = _infinity("train", "--model-size", "tiny", "--steps", "3", "--seq-len", "32",
                         "--lr", "3e-3", "--nvme-path", str(disk_dir), "--engine", engine,
                         "--metrics", str(metrics), "--config", str(tmp_path / "fp32.json"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[engine] = [r["loss"] for r in read_metrics(metrics)]
    assert losses["infinity"] == pytest.approx(losses["torch"], rel=1e-5), losses


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["train", *args])
    err = capsys.readouterr().err
    return code, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("infinity train: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_data_file(capsys: pytest.CaptureFixture[str], disk_dir: Path) -> None:
    code, err = _run_cli(capsys, "--data", str(disk_dir / "nope.txt"), "--nvme-path", str(disk_dir))
    assert code == 2
    assert "nope.txt does not exist" in _one_error_line(err)
    assert list(disk_dir.iterdir()) == []


def test_empty_corpus(capsys: pytest.CaptureFixture[str], tmp_path: Path, disk_dir: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    metrics = tmp_path / "m.jsonl"
    code, err = _run_cli(capsys, "--data", str(empty), "--nvme-path", str(disk_dir),
                         "--metrics", str(metrics))
    assert code == 2 and "is empty" in _one_error_line(err)
    assert list(disk_dir.iterdir()) == [] and not metrics.exists()


def test_config_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, disk_dir: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_parm": {}}}))
    code, err = _run_cli(capsys, "--config", str(config), "--nvme-path", str(disk_dir))
    assert code == 2
    assert "offload_parm" in _one_error_line(err) and "did you mean" in err
    assert list(disk_dir.iterdir()) == []


def test_non_finite_number_in_the_config(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                         disk_dir: Path) -> None:
    """Python's json reads the bare literal Infinity; it was an OverflowError traceback."""
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3, "sub_group_size": Infinity}}')
    code, err = _run_cli(capsys, "--config", str(config), "--nvme-path", str(disk_dir))
    assert code == 2 and "Traceback" not in err
    assert "zero_optimization.sub_group_size = inf: must be a finite number" in _one_error_line(err)
    assert list(disk_dir.iterdir()) == []


def _unwritable_dirs(tmp_path: Path) -> list[Path]:
    """Directories this process cannot write in: /proc (even as root) and, unless root, a 0555 one."""
    dirs = [Path("/proc")]
    if os.geteuid() != 0:   # root ignores permission bits
        locked = tmp_path / "read-only"
        locked.mkdir(mode=0o555)
        dirs.append(locked)
    return dirs


@pytest.mark.parametrize("flag", ["--metrics", "--plot"])
def test_unwritable_metrics_or_plot_path_fails_before_training(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, disk_dir: Path,
        monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    """It failed only after the run (the first record, or the plot at the end)."""
    from infinity.train import loop, metrics

    def no_training(*args: object) -> None:
        raise AssertionError("the engine was built before the bad path was reported")

    monkeypatch.setattr(loop, "_make_engine", no_training)
    monkeypatch.setattr(loop, "plot_available", lambda: True)   # --plot without matplotlib
    monkeypatch.setattr(metrics, "plot_available", lambda: True)
    for where in _unwritable_dirs(tmp_path):
        target = where / ("m.jsonl" if flag == "--metrics" else "m.png")
        extra = [] if flag == "--metrics" else ["--metrics", str(tmp_path / "ok.jsonl")]
        code, err = _run_cli(capsys, "--model-size", "tiny", "--steps", "1", "--nvme-path",
                             str(disk_dir), flag, str(target), *extra)
        line = _one_error_line(err)
        assert code == 2 and f"{flag} {target}: cannot write" in line, err
        assert "choose a writable path" in line and "Traceback" not in err
        assert list(disk_dir.iterdir()) == [] and not target.exists()
    assert not (tmp_path / "ok.jsonl").exists()    # the good file is not created early either


def test_an_export_path_that_cannot_be_written_fails_before_training(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, disk_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It was tried only after the run: a file there, or a directory it could not write in,
    lost the trained model (without --save-dir nothing else keeps it)."""
    from infinity.train import loop

    def no_training(*args: object) -> None:
        raise AssertionError("the engine was built before the bad path was reported")

    monkeypatch.setattr(loop, "_make_engine", no_training)
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    cases = [(a_file, "is a file"), (a_file / "sub", "is a file")]
    cases += [(where / "out", "cannot write") for where in _unwritable_dirs(tmp_path)]
    for target, said in cases:
        code, err = _run_cli(capsys, "--model-size", "tiny", "--steps", "1", "--nvme-path",
                             str(disk_dir), "--export", str(target))
        line = _one_error_line(err)
        assert code == 2 and f"--export {target}" in line and said in line, err
        assert "Traceback" not in err and list(disk_dir.iterdir()) == []
    assert a_file.read_text() == "mine\n"


def test_host_budget_too_small_states_the_given_value_and_the_minimum(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, disk_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "... only 0 B of the 0 B host budget is free" (the share left after the engine's
    device pool), after preallocating the swap files."""
    from infinity.train import loop

    def no_engine(*args: object) -> None:
        raise AssertionError("the engine was built before the budget was checked")

    monkeypatch.setattr(loop, "_make_engine", no_engine)
    code, err = _run_cli(capsys, "--model-size", "tiny", "--nvme-path", str(disk_dir),
                         "--host-budget", "1B")
    line = _one_error_line(err)
    assert code == 2 and "the host memory budget 1B (--host-budget) is too small" in line, err
    assert "needs at least " in line and "pass --host-budget " in line and " 0 B" not in line
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(disk_dir)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(disk_dir)}},
        "infinity": {"host_memory_budget": 1}}))
    code, err = _run_cli(capsys, "--model-size", "tiny", "--config", str(config))
    line = _one_error_line(err)
    assert code == 2 and f"budget 1 (= 1 B, infinity.host_memory_budget in {config})" in line
    assert list(disk_dir.iterdir()) == []


def test_host_budget_error_of_the_engine_names_the_given_budget(
        capsys: pytest.CaptureFixture[str], disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the planner's check passes but the engine's pools do not fit, the engine's message
    (a share of the budget) is completed with the budget the user gave."""
    from infinity.engine import sizing
    from infinity.train import host_budget

    monkeypatch.setattr(host_budget, "check_host_budget", lambda *args: None)
    monkeypatch.setattr(sizing, "_refuse_a_host_budget_too_small", lambda *args: None)
    code, err = _run_cli(capsys, "--model-size", "tiny", "--nvme-path", str(disk_dir),
                         "--host-budget", "1B")
    line = _one_error_line(err)
    assert code == 2 and "of host memory" in line and "left of 1B (--host-budget)" in line, err
    assert list(disk_dir.iterdir()) == []


def test_swap_path_that_fails_preflight(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    code, err = _run_cli(capsys, "--model-size", "tiny", "--nvme-path", str(missing))
    assert code == 2 and "does not exist" in _one_error_line(err)
    assert not missing.exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, err = _run_cli(capsys, "--model-size", "tiny", "--nvme-path", str(a_file))
    assert code == 2 and "not a directory" in _one_error_line(err)


def test_unknown_preset(capsys: pytest.CaptureFixture[str], disk_dir: Path) -> None:
    code, err = _run_cli(capsys, "--model-size", "3Q", "--nvme-path", str(disk_dir))
    assert code == 2 and "is not a preset" in _one_error_line(err)
    assert list(disk_dir.iterdir()) == []


def test_bad_input_through_the_entry_point_exits_2(tmp_path: Path) -> None:
    proc = _infinity("train", "--data", str(tmp_path / "nope.txt"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("infinity train: error: data file")


def test_sigterm_mid_run_removes_the_swap_directory(disk_dir: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "infinity.cli", "train", "--model-size", "tiny", "--steps", "100000",
         "--seq-len", "32", "--nvme-path", str(disk_dir), "--metrics", str(metrics)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no step was recorded in 180 s"
            time.sleep(0.2)
        assert [p.name for p in disk_dir.iterdir()][0].startswith("infinity-swap-")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(disk_dir.iterdir()) == []  # unwound through engine.close(), like Ctrl-C


def test_a_resumed_run_continues_the_interrupted_one(disk_dir: Path, tmp_path: Path) -> None:
    """--save-dir/--save-interval/--resume: a run stopped after step 3 and resumed to step 6
    has the losses of the run that was not stopped (same batches, same states)."""
    common = ("--model-size", "tiny", "--seq-len", "32", "--lr", "3e-3", "--nvme-path",
              str(disk_dir), "--host-budget", "256MiB")
    whole, first = (tmp_path / f"{n}.jsonl" for n in ("whole", "first"))
    proc = _infinity("train", *common, "--steps", "6", "--metrics", str(whole),
                     "--save-dir", str(tmp_path / "whole"), "--save-interval", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == \
        ["global_step2", "global_step4", "global_step6", "latest"]
    proc = _infinity("train", *common, "--steps", "3", "--metrics", str(first),
                     "--save-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _infinity("train", *common, "--steps", "6", "--metrics", str(first),
                     "--save-dir", str(tmp_path / "run"), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    expected = [(r["step"], r["loss"]) for r in read_metrics(whole)]
    got = [(r["step"], r["loss"]) for r in read_metrics(first)]   # the resumed run appended
    assert got == expected
    proc = _infinity("train", *common, "--steps", "6", "--seed", "5",
                     "--save-dir", str(tmp_path / "run"), "--resume")
    assert proc.returncode == 2 and "taken from another run" in proc.stderr, proc.stderr[-2000:]
    # the same command line requeued after the run's last save (killed in its export): it
    # finishes the run, export included (it exited 2, "nothing is left to train")
    proc = _infinity("train", *common, "--steps", "6", "--save-dir", str(tmp_path / "run"),
                     "--resume", "--export", str(tmp_path / "out"))
    assert proc.returncode == 0 and "nothing is left to train" in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "out" / "config.json").is_file()
    proc = _infinity("train", *common, "--steps", "5", "--save-dir", str(tmp_path / "run"),
                     "--resume")
    assert proc.returncode == 2 and "it went further" in proc.stderr, proc.stderr[-2000:]
    assert list(disk_dir.iterdir()) == []


def test_a_resume_knows_its_data_by_its_bytes_not_its_path(disk_dir: Path, tmp_path: Path) -> None:
    """The same file named another way (a link) resumes; other bytes under the same name are
    refused. It was the other way round: the path's text was compared."""
    common = ("--model-size", "tiny", "--seq-len", "32", "--nvme-path", str(disk_dir),
              "--host-budget", "256MiB", "--save-dir", str(tmp_path / "run"))
    data = tmp_path / "data.txt"
    data.write_text("In the beginning was the text, and the text was long enough. " * 200)
    link = tmp_path / "link.txt"
    link.symlink_to(data)
    proc = _infinity("train", *common, "--steps", "2", "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _infinity("train", *common, "--steps", "3", "--data", str(link), "--resume")
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]
    data.write_text("Other words entirely, in another order, for another run of it. " * 200)
    proc = _infinity("train", *common, "--steps", "4", "--data", str(data), "--resume")
    assert proc.returncode == 2 and "taken from another run" in proc.stderr, proc.stderr[-2000:]
    assert "data_sha256" in proc.stderr


def test_outputs_that_would_overwrite_inputs_or_cannot_be_written_fail_first(tmp_path: Path) -> None:
    """--metrics naming the --data file (it was truncated after the first step), and a --plot
    format matplotlib does not write (it failed after the whole run): one line, exit 2, the
    input untouched."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "some words " * 20}) for _ in range(8)))
    before = corpus.read_bytes()
    proc = _infinity("train", "--model-size", "tiny", "--steps", "1", "--data", str(corpus),
                     "--metrics", str(corpus))
    assert proc.returncode == 2 and "is the --data file" in proc.stderr, proc.stderr[-2000:]
    assert corpus.read_bytes() == before
    if plot_available():
        proc = _infinity("train", "--model-size", "tiny", "--steps", "1", "--plot",
                         str(tmp_path / "run.xyz"))
        assert proc.returncode == 2 and "cannot write a .xyz file" in proc.stderr, proc.stderr
