"""nvme-tune: the CLI's JSON on a real file, the table, the recommendation, and cleanup on Ctrl-C."""
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
from infinity.train import nvme_tune as tune
from infinity.train.nvme_tune import PointResult, TunePoint

MiB = 1 << 20


def test_one_point_json_in_a_subprocess(disk_dir: Path) -> None:
    cmd = [sys.executable, "-m", "infinity.cli", "nvme-tune", "--path", str(disk_dir),
           "--size", "16MiB", "--backend", "threads", "--block-size", "1M", "--queue-depth", "8",
           "--threads", "1", "--repeats", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # stdout is exactly one JSON object
    assert data["size"] == 16 * MiB and data["writes_include_fsync"] is False
    [point] = data["points"]
    assert (point["backend"], point["block_size"], point["queue_depth"], point["thread_count"]) == \
        ("threads", MiB, 8, 1)
    assert point["read_GBps"] > 0 and point["write_GBps"] > 0
    assert point["resident_before_read"] == [0.0], "reads must start cold"
    assert data["recommendation"]["aio"] == {
        "backend": "threads", "block_size": MiB, "queue_depth": 8, "intra_op_parallelism": 1,
        "single_submit": False, "overlap_events": True}
    assert "1/1" in out.stderr  # the progress bar went to stderr
    assert os.listdir(disk_dir) == [], "nvme-tune must remove its private directory"


def test_small_grid_table_and_paste_ready_section(disk_dir: Path, capsys) -> None:
    assert main(["nvme-tune", "--path", str(disk_dir), "--size", "4MiB", "--backend",
                 "threads,mmap", "--block-size", "256K,1M", "--queue-depth", "4", "--repeats",
                 "2", "--fsync"]) == 0
    out = capsys.readouterr().out
    assert out.count(" qd") >= 1 and "including one fdatasync" in out and "<- recommended" in out
    rows = [line for line in out.splitlines() if line.startswith(("threads ", "mmap "))]
    assert len(rows) == 4
    section = json.loads(out[out.index("{"):])
    assert set(section["aio"]) == {"backend", "block_size", "queue_depth", "intra_op_parallelism",
                                   "single_submit", "overlap_events"}
    assert section["aio"]["block_size"] in (256 << 10, MiB)
    assert os.listdir(disk_dir) == []


def test_ctrl_c_mid_sweep_removes_the_test_file(disk_dir: Path) -> None:
    seen = []

    def interrupt(done, total, point, phase):
        if phase == "read":
            seen.extend(os.listdir(disk_dir))
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune.sweep(disk_dir, tune.grid(["threads"], [MiB], [4]), size=4 * MiB, progress=interrupt)
    assert seen and seen[0].startswith("infinity-swap-"), "the sweep runs in a private dir"
    assert os.listdir(disk_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_the_command_cleans_up(disk_dir: Path, sig: int) -> None:
    cmd = [sys.executable, "-m", "infinity.cli", "nvme-tune", "--path", str(disk_dir),
           "--size", "512MiB", "--backend", "threads", "--block-size", "256K", "--queue-depth",
           "1", "--repeats", "50"]
    # SIGINT as in a terminal: a suite started in the background inherits it ignored, and
    # the command (rightly) leaves an ignored SIGINT alone
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any(p.name.startswith("infinity-swap-") for p in disk_dir.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err
    assert os.listdir(disk_dir) == []


def test_unavailable_backend_is_skipped_with_a_reason(disk_dir: Path, monkeypatch) -> None:
    import infinity.io

    monkeypatch.setattr(infinity.io, "backend_available", lambda name: name != "libaio")
    report = tune.sweep(disk_dir, tune.grid(["libaio", "threads"], [MiB], [4]), size=MiB)
    assert [r.point.backend for r in report.results] == ["threads"]
    assert report.skipped == ["libaio 1M qd4: backend libaio is not available here"]
    with pytest.raises(ValueError, match="no requested backend is available"):
        tune.sweep(disk_dir, tune.grid(["libaio"], [MiB], [4]), size=MiB)


def _result(backend: str, qd: int, threads: int, write: float, read: float) -> PointResult:
    return PointResult(TunePoint(backend, MiB, qd, threads), backend, [write], [read])


def test_recommendation_prefers_cheaper_settings_within_tolerance() -> None:
    fast = _result("io_uring", 32, 2, 2.0, 2.0)       # swap 1.00
    close = _result("io_uring", 8, 1, 1.96, 1.96)     # swap 0.98: within 5%, fewer threads
    slow = _result("libaio", 4, 1, 1.0, 1.0)          # swap 0.50
    assert tune.recommend([fast, close, slow]) is close
    assert tune.recommend([fast, slow]) is fast
    with pytest.raises(ValueError, match="nothing to recommend"):
        tune.recommend([])


def test_bad_arguments_exit_2(disk_dir: Path, capsys, monkeypatch) -> None:
    assert main(["nvme-tune", "--path", str(disk_dir), "--block-size", "1000"]) == 2
    assert "multiple of 4096" in capsys.readouterr().err
    assert main(["nvme-tune", "--path", str(disk_dir / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["nvme-tune", "--path", str(disk_dir), "--plot", str(disk_dir / "x.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_plot_is_written(disk_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert main(["nvme-tune", "--path", str(disk_dir), "--size", "1MiB", "--backend", "threads",
                 "--block-size", "256K,1M", "--queue-depth", "4", "--repeats", "1",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_dropped_inside_a_finalizer_still_stops_the_sweep(tmp_path, monkeypatch,
                                                                        capsys) -> None:
    """Python prints and drops a KeyboardInterrupt raised while a finalizer runs (an I/O buffer
    freed by the garbage collector): the command must still stop at the next phase, not finish
    the sweep and exit 0."""
    import weakref

    phases = []

    def sweep_with_a_dropped_interrupt(path, points, *, size, repeats, fsync, progress):
        class Buffer:
            pass

        buf = Buffer()
        weakref.finalize(buf, os.kill, os.getpid(), signal.SIGINT)
        del buf            # the handler runs inside the finalizer; its exception is dropped
        for phase in ("write", "read", "done"):
            phases.append(phase)
            progress(0, 1, points[0], phase)
        raise AssertionError("the sweep went on after the interrupt")

    monkeypatch.setattr(tune, "sweep", sweep_with_a_dropped_interrupt)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # SIG_IGN under nohup
    try:
        rc = main(["nvme-tune", "--path", str(tmp_path), "--size", "1MiB", "--backend", "threads",
                   "--block-size", "256K"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # restored
    finally:
        signal.signal(signal.SIGINT, outer)
    err = capsys.readouterr().err
    assert rc == 130, err
    assert phases == ["write"]
    assert "interrupted" in err


def test_a_size_below_the_block_size_is_refused(disk_dir: Path, capsys) -> None:
    """A 4 KiB file measured with 256K-4M blocks printed a "recommended" section."""
    assert main(["nvme-tune", "--path", str(disk_dir), "--size", "4KiB"]) == 2
    err = capsys.readouterr().err
    assert "smaller than block size(s) 256.00 KiB, 1.00 MiB, 4.00 MiB" in err, err
    assert list(disk_dir.iterdir()) == []


def test_a_grid_value_out_of_range_is_refused_before_the_sweep(disk_dir: Path, capsys) -> None:
    """--queue-depth 8,5000: the sweep measured the first points, then stopped on 5000 naming
    the config key, the points measured thrown away."""
    assert main(["nvme-tune", "--path", str(disk_dir), "--size", "4MiB", "--block-size", "1M",
                 "--backend", "threads", "--queue-depth", "8,5000"]) == 2
    err = capsys.readouterr().err
    assert "--queue-depth: aio.queue_depth = 5000 is out of range" in err, err
    assert "1/" not in err and list(disk_dir.iterdir()) == []     # nothing measured or made


def test_a_size_reads_k_m_g_as_the_block_size_does(disk_dir: Path, capsys) -> None:
    """--size 4M --block-size 4M: "4M" was 4 MB for the size and 4 MiB for the block (fio's),
    so the file was refused as smaller than one block."""
    assert main(["nvme-tune", "--path", str(disk_dir), "--size", "4M", "--block-size", "4M",
                 "--backend", "threads", "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["size"] == 4 << 20


def test_a_file_larger_than_allowed_names_the_file_and_the_flag(disk_dir: Path, capsys,
                                                                 monkeypatch) -> None:
    """ulimit -f below --size: a raw traceback of posix_fallocate's EFBIG."""
    import errno

    def too_large(fd, off, size):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(tune.os, "posix_fallocate", too_large)
    assert main(["nvme-tune", "--path", str(disk_dir), "--size", "4MiB", "--block-size", "1M",
                 "--backend", "threads"]) == 2
    err = capsys.readouterr().err
    assert "for the nvme-tune test file" in err and "ulimit -f" in err and "smaller --size" in err
    assert list(disk_dir.iterdir()) == []
